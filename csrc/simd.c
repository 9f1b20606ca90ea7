/*
 * simd.c: the inner loops of cast, unscale_check and check_norm, with the best SIMD the
 * CPU has, picked once at run time (the build uses no -march flag): AVX-512 (16 lanes),
 * AVX2 + F16C (8 lanes) or scalar. The loads, stores and conversions are in simd.h.
 *
 * Each loop is fused: an element is loaded, widened to fp32, worked on and narrowed
 * back in registers, so every byte crosses the core once. Tails and old CPUs use the
 * scalar functions, which give the same bits for every non-NaN value.
 *
 * The loop bodies take the dtype as an argument and are always inlined into a switch
 * over constant dtypes, so each (ISA, dtype) pair gets its own branch-free loop.
 */
#include <stdlib.h>
#include <string.h>

#include "simd.h"

/* AMPC_CPU_ISA caps the choice, so the tests can check every path on one machine. */
enum ampc_isa ampc_cpu_isa(void)
{
    static int isa = ISA_UNKNOWN;       /* threads may race to set it: all set the same */
    enum ampc_isa seen = __atomic_load_n(&isa, __ATOMIC_RELAXED);
    if (seen == ISA_UNKNOWN) {
        const char *cap = getenv("AMPC_CPU_ISA");
        enum ampc_isa best = ISA_SCALAR;
        __builtin_cpu_init();
        if (__builtin_cpu_supports("avx512f"))
            best = ISA_AVX512;
        else if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                 __builtin_cpu_supports("f16c"))
            best = ISA_AVX2;
        if (cap && strcmp(cap, "scalar") == 0)
            best = ISA_SCALAR;
        else if (cap && strcmp(cap, "avx2") == 0 && best > ISA_AVX2)
            best = ISA_AVX2;
        __atomic_store_n(&isa, best, __ATOMIC_RELAXED);
        seen = best;
    }
    return seen;
}

/* The path's name, for ampc.ops.cpu_isa() (tests and CI check which path ran). */
__attribute__((visibility("default"))) const char *ampc_cpu_isa_name(void)
{
    switch (ampc_cpu_isa()) {
    case ISA_AVX512: return "avx512";
    case ISA_AVX2: return "avx2";
    default: return "scalar";
    }
}

// ---- scalar: the reference, and the tails of the vector loops ----

static void cast_scalar(void *dst, ampc_dtype dt, const void *src, ampc_dtype st, int64_t i,
                        int64_t n)
{
    for (; i < n; i++)
        store1(dst, dt, i, load1(src, st, i));
}

static int unscale_scalar(void *g, ampc_dtype t, float s, int64_t i, int64_t n)
{
    int bad = 0;
    for (; i < n; i++) {
        float f = load1(g, t, i);
        bad |= ampc_non_finite(f);
        store1(g, t, i, f * s);
    }
    return bad;
}

static int square_sum_scalar(const void *g, ampc_dtype t, int64_t i, int64_t n, double *sum)
{
    int bad = 0;
    double s = 0;
    for (; i < n; i++) {
        float f = load1(g, t, i);
        bad |= ampc_non_finite(f);
        s += (double)f * f;
    }
    *sum += s;
    return bad;
}

// ---- AVX-512: 16 lanes ----


AVX512 INLINE void cast_loop16(void *dst, ampc_dtype dt, const void *src, ampc_dtype st,
                               int64_t n, int stream)
{
    int64_t i = 0;
    if (stream && ((uintptr_t)dst & 63) == 0) {
        for (; i + 32 <= n; i += 32) {  /* two vectors: whole 64-byte lines of 16-bit out */
            __m512 a = load16(src, st, i);
            __m512 b = load16(src, st, i + 16);
            store16_to(dst, dt, i, a, 1);
            store16_to(dst, dt, i + 16, b, 1);
        }
        _mm_sfence();                   /* streamed lines are visible before we return */
    }
    for (; i + 32 <= n; i += 32) {
        __m512 a = load16(src, st, i);
        __m512 b = load16(src, st, i + 16);
        store16(dst, dt, i, a);
        store16(dst, dt, i + 16, b);
    }
    for (; i + 16 <= n; i += 16)
        store16(dst, dt, i, load16(src, st, i));
    cast_scalar(dst, dt, src, st, i, n);
}

AVX512 INLINE int unscale_loop16(void *g, ampc_dtype t, float s, int64_t n)
{
    __m512 vs = _mm512_set1_ps(s);
    __mmask16 bad = 0;
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m512 f = load16(g, t, i);
        bad |= nonfinite16(f);
        store16(g, t, i, _mm512_mul_ps(f, vs));
    }
    return (bad != 0) | unscale_scalar(g, t, s, i, n);
}

/* Squares in double: the square of a finite fp32 value can overflow fp32, not a double.
 * 32 elements a turn into four sums, so four FMA chains run at once. */
AVX512 INLINE void square_add16(__m512 f, __m512d *lo_sum, __m512d *hi_sum)
{
    __m512d lo = _mm512_cvtps_pd(_mm512_castps512_ps256(f));
    __m256 upper = _mm256_castsi256_ps(_mm512_extracti64x4_epi64(_mm512_castps_si512(f), 1));
    __m512d hi = _mm512_cvtps_pd(upper);
    *lo_sum = _mm512_fmadd_pd(lo, lo, *lo_sum);
    *hi_sum = _mm512_fmadd_pd(hi, hi, *hi_sum);
}

/* The sum of squares of g[i..end), end - i a multiple of 16, in double. */
AVX512 INLINE double square_sum_double16(const void *g, ampc_dtype t, int64_t i, int64_t end)
{
    __m512d acc[4] = { _mm512_setzero_pd(), _mm512_setzero_pd(), _mm512_setzero_pd(),
                       _mm512_setzero_pd() };
    for (; i + 32 <= end; i += 32) {
        square_add16(load16(g, t, i), &acc[0], &acc[1]);
        square_add16(load16(g, t, i + 16), &acc[2], &acc[3]);
    }
    if (i < end)
        square_add16(load16(g, t, i), &acc[0], &acc[1]);
    __m512d total = _mm512_add_pd(_mm512_add_pd(acc[0], acc[1]), _mm512_add_pd(acc[2], acc[3]));
    return _mm512_reduce_add_pd(total);
}

/*
 * Note [fp32 squares when safe]: widening to double costs more than the memory read of
 * a 16-bit grad, so runs of SQUARE_RUN elements are summed in fp32 (16 elements per
 * lane, relative error below 2^-19) while the largest |g| of the run is checked: below
 * 2^58 no square nor the run's sum can overflow, and from 2^-40 up any square that
 * underflows is below 2^-46 of the largest one. A run outside those bounds (including
 * any inf or nan) is summed again in double.
 */
#define SQUARE_RUN 512
#define SQUARE_SAFE_MAX 0x5c800000u     /* 2^58 */
#define SQUARE_SAFE_MIN 0x2b800000u     /* 2^-40 */

AVX512 INLINE int square_sum_loop16(const void *g, ampc_dtype t, int64_t n, double *sum)
{
    __m512i abs_bits = _mm512_set1_epi32(0x7fffffff);
    __mmask16 bad = 0;
    double total = 0;
    int64_t i = 0;
    while (i + 16 <= n) {
        int64_t end = n - i >= SQUARE_RUN ? i + SQUARE_RUN : n - (n - i) % 16;
        __m512 s0 = _mm512_setzero_ps();
        __m512 s1 = _mm512_setzero_ps();
        __m512i top = _mm512_setzero_si512();
        for (int64_t j = i; j < end; j += 16) {
            __m512 f = load16(g, t, j);
            bad |= nonfinite16(f);
            top = _mm512_max_epu32(top, _mm512_and_si512(_mm512_castps_si512(f), abs_bits));
            if ((j - i) & 16)
                s1 = _mm512_fmadd_ps(f, f, s1);
            else
                s0 = _mm512_fmadd_ps(f, f, s0);
        }
        uint32_t m = (uint32_t)_mm512_reduce_max_epu32(top);
        if (m < SQUARE_SAFE_MAX && (m >= SQUARE_SAFE_MIN || m == 0))
            total += _mm512_reduce_add_ps(_mm512_add_ps(s0, s1));
        else
            total += square_sum_double16(g, t, i, end);
        i = end;
    }
    *sum += total;
    return (bad != 0) | square_sum_scalar(g, t, i, n, sum);
}

// ---- AVX2 + F16C: 8 lanes ----

AVX2 INLINE void cast_loop8(void *dst, ampc_dtype dt, const void *src, ampc_dtype st, int64_t n,
                            int stream)
{
    int64_t i = 0;
    if (stream && ((uintptr_t)dst & 63) == 0) {
        for (; i + 8 <= n; i += 8)
            store8_to(dst, dt, i, load8(src, st, i), 1);
        _mm_sfence();
    }
    for (; i + 8 <= n; i += 8)
        store8(dst, dt, i, load8(src, st, i));
    cast_scalar(dst, dt, src, st, i, n);
}

AVX2 INLINE int unscale_loop8(void *g, ampc_dtype t, float s, int64_t n)
{
    __m256 vs = _mm256_set1_ps(s);
    int bad = 0;
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 f = load8(g, t, i);
        bad |= nonfinite8(f);
        store8(g, t, i, _mm256_mul_ps(f, vs));
    }
    return (bad != 0) | unscale_scalar(g, t, s, i, n);
}

AVX2 INLINE void square_add8(__m256 f, __m256d *lo_sum, __m256d *hi_sum)
{
    __m256d lo = _mm256_cvtps_pd(_mm256_castps256_ps128(f));
    __m256d hi = _mm256_cvtps_pd(_mm256_extractf128_ps(f, 1));
    *lo_sum = _mm256_fmadd_pd(lo, lo, *lo_sum);
    *hi_sum = _mm256_fmadd_pd(hi, hi, *hi_sum);
}

AVX2 INLINE int square_sum_loop8(const void *g, ampc_dtype t, int64_t n, double *sum)
{
    __m256d acc[4] = { _mm256_setzero_pd(), _mm256_setzero_pd(), _mm256_setzero_pd(),
                       _mm256_setzero_pd() };
    int bad = 0;
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m256 a = load8(g, t, i);
        __m256 b = load8(g, t, i + 8);
        bad |= nonfinite8(a) | nonfinite8(b);
        square_add8(a, &acc[0], &acc[1]);
        square_add8(b, &acc[2], &acc[3]);
    }
    for (; i + 8 <= n; i += 8) {
        __m256 a = load8(g, t, i);
        bad |= nonfinite8(a);
        square_add8(a, &acc[0], &acc[1]);
    }
    double lanes[4];
    _mm256_storeu_pd(lanes, _mm256_add_pd(_mm256_add_pd(acc[0], acc[1]),
                                          _mm256_add_pd(acc[2], acc[3])));
    *sum += (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]);
    return (bad != 0) | square_sum_scalar(g, t, i, n, sum);
}

// ---- one specialised loop per (ISA, dtype) ----

#define PAIR(s, d) ((s) * 3 + (d))

AVX512 static void cast_avx512(void *dst, ampc_dtype dt, const void *src, ampc_dtype st,
                               int64_t n, int stream)
{
    switch (PAIR(st, dt)) {
    case PAIR(AMPC_F32, AMPC_F16): cast_loop16(dst, AMPC_F16, src, AMPC_F32, n, stream); break;
    case PAIR(AMPC_F32, AMPC_BF16): cast_loop16(dst, AMPC_BF16, src, AMPC_F32, n, stream); break;
    case PAIR(AMPC_F16, AMPC_F32): cast_loop16(dst, AMPC_F32, src, AMPC_F16, n, stream); break;
    case PAIR(AMPC_F16, AMPC_BF16): cast_loop16(dst, AMPC_BF16, src, AMPC_F16, n, stream); break;
    case PAIR(AMPC_BF16, AMPC_F32): cast_loop16(dst, AMPC_F32, src, AMPC_BF16, n, stream); break;
    case PAIR(AMPC_BF16, AMPC_F16): cast_loop16(dst, AMPC_F16, src, AMPC_BF16, n, stream); break;
    default: cast_scalar(dst, dt, src, st, 0, n);
    }
}

AVX2 static void cast_avx2(void *dst, ampc_dtype dt, const void *src, ampc_dtype st, int64_t n,
                           int stream)
{
    switch (PAIR(st, dt)) {
    case PAIR(AMPC_F32, AMPC_F16): cast_loop8(dst, AMPC_F16, src, AMPC_F32, n, stream); break;
    case PAIR(AMPC_F32, AMPC_BF16): cast_loop8(dst, AMPC_BF16, src, AMPC_F32, n, stream); break;
    case PAIR(AMPC_F16, AMPC_F32): cast_loop8(dst, AMPC_F32, src, AMPC_F16, n, stream); break;
    case PAIR(AMPC_F16, AMPC_BF16): cast_loop8(dst, AMPC_BF16, src, AMPC_F16, n, stream); break;
    case PAIR(AMPC_BF16, AMPC_F32): cast_loop8(dst, AMPC_F32, src, AMPC_BF16, n, stream); break;
    case PAIR(AMPC_BF16, AMPC_F16): cast_loop8(dst, AMPC_F16, src, AMPC_BF16, n, stream); break;
    default: cast_scalar(dst, dt, src, st, 0, n);
    }
}

AVX512 static int unscale_avx512(void *g, ampc_dtype t, float s, int64_t n)
{
    switch (t) {
    case AMPC_F32: return unscale_loop16(g, AMPC_F32, s, n);
    case AMPC_F16: return unscale_loop16(g, AMPC_F16, s, n);
    default: return unscale_loop16(g, AMPC_BF16, s, n);
    }
}

AVX2 static int unscale_avx2(void *g, ampc_dtype t, float s, int64_t n)
{
    switch (t) {
    case AMPC_F32: return unscale_loop8(g, AMPC_F32, s, n);
    case AMPC_F16: return unscale_loop8(g, AMPC_F16, s, n);
    default: return unscale_loop8(g, AMPC_BF16, s, n);
    }
}

AVX512 static int square_sum_avx512(const void *g, ampc_dtype t, int64_t n, double *sum)
{
    switch (t) {
    case AMPC_F32: return square_sum_loop16(g, AMPC_F32, n, sum);
    case AMPC_F16: return square_sum_loop16(g, AMPC_F16, n, sum);
    default: return square_sum_loop16(g, AMPC_BF16, n, sum);
    }
}

AVX2 static int square_sum_avx2(const void *g, ampc_dtype t, int64_t n, double *sum)
{
    switch (t) {
    case AMPC_F32: return square_sum_loop8(g, AMPC_F32, n, sum);
    case AMPC_F16: return square_sum_loop8(g, AMPC_F16, n, sum);
    default: return square_sum_loop8(g, AMPC_BF16, n, sum);
    }
}

// ---- entry points (cpu.h) ----

void ampc_cast_block(void *dst, ampc_dtype dt, const void *src, ampc_dtype st, int64_t n,
                     int stream)
{
    if (st == dt) {
        memcpy(dst, src, (size_t)(n * ampc_dtype_size(st)));
        return;
    }
    switch (ampc_cpu_isa()) {
    case ISA_AVX512: cast_avx512(dst, dt, src, st, n, stream); break;
    case ISA_AVX2: cast_avx2(dst, dt, src, st, n, stream); break;
    default: cast_scalar(dst, dt, src, st, 0, n);
    }
}

int ampc_unscale_block(void *g, ampc_dtype dtype, float s, int64_t n)
{
    switch (ampc_cpu_isa()) {
    case ISA_AVX512: return unscale_avx512(g, dtype, s, n);
    case ISA_AVX2: return unscale_avx2(g, dtype, s, n);
    default: return unscale_scalar(g, dtype, s, 0, n);
    }
}

int ampc_square_sum_block(const void *g, ampc_dtype dtype, int64_t n, double *sum)
{
    switch (ampc_cpu_isa()) {
    case ISA_AVX512: return square_sum_avx512(g, dtype, n, sum);
    case ISA_AVX2: return square_sum_avx2(g, dtype, n, sum);
    default: return square_sum_scalar(g, dtype, 0, n, sum);
    }
}
