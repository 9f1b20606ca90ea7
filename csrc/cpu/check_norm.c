/*
 * check_norm.c: the read-only twin of unscale_check, on the CPU: the same inf/nan check
 * without writing, plus the global L2 norm of the unscaled grads,
 * |inv_scale| * sqrt(sum g^2).
 *
 * A chunk's squares are summed without overflow or unnoticed underflow (Note [fp32
 * squares when safe] in check_norm.h) with the best SIMD the CPU has (simd.h), and the
 * chunks' sums in double, in chunk order, so the result does not depend on the thread
 * count (cpu.h).
 */
#include <math.h>
#include <stdlib.h>

#include "check_norm.h"
#include "simd.h"

// ---- scalar: the reference, and the tails of the vector loops ----

static int square_sum_scalar(const void *g, ampc_dtype t, int64_t i, int64_t n, double *sum)
{
    int bad = 0;
    double s = 0;
    for (; i < n; i++) {
        float f = ampc_load(g, t, i);
        bad |= ampc_non_finite(f);
        s += ampc_square(f);
    }
    *sum += s;
    return bad;
}

// ---- AVX-512: 16 lanes ----

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

/* Note [fp32 squares when safe] (check_norm.h), in runs of SQUARE_RUN elements: 16 per
 * lane, relative error below 2^-19. */
#define SQUARE_RUN 512

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
        if (ampc_squares_safe_in_f32(m))
            total += _mm512_reduce_add_ps(_mm512_add_ps(s0, s1));
        else
            total += square_sum_double16(g, t, i, end);
        i = end;
    }
    *sum += total;
    return (bad != 0) | square_sum_scalar(g, t, i, n, sum);
}

// ---- AVX2 + F16C: 8 lanes ----

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

static int square_sum_block(const void *g, ampc_dtype dtype, int64_t n, double *sum)
{
    switch (ampc_cpu_isa()) {
    case ISA_AVX512: return square_sum_avx512(g, dtype, n, sum);
    case ISA_AVX2: return square_sum_avx2(g, dtype, n, sum);
    default: return square_sum_scalar(g, dtype, 0, n, sum);
    }
}


// ---- the walk over the list ----

struct norm_job {
    const struct ampc_list *grads;
    int found;              /* set (never cleared) by any thread that sees inf/nan */
    double *sumsq;          /* one partial sum per chunk */
};

static void norm_span(void *ctx, const struct ampc_span *s)
{
    struct norm_job *job = ctx;
    ampc_dtype dt = job->grads->dtype;
    const char *g = (const char *)job->grads->ptr[s->tensor] + s->begin * ampc_dtype_size(dt);
    job->sumsq[s->chunk] = 0;
    if (square_sum_block(g, dt, s->end - s->begin, &job->sumsq[s->chunk]))
        __atomic_store_n(&job->found, 1, __ATOMIC_RELAXED);
}

ampc_status ampc_check_norm_cpu(const struct ampc_list *grads, float *found_inf,
                                float *norm, const float *inv_scale)
{
    int64_t chunks = ampc_chunk_count(grads);
    struct norm_job job = { grads, 0, NULL };
    job.sumsq = malloc(sizeof(double) * (size_t)(chunks > 0 ? chunks : 1));
    if (!job.sumsq)
        return AMPC_ERR_NOMEM;
    ampc_status st = ampc_for_each_chunk(grads, norm_span, &job);
    if (st == AMPC_OK) {
        double total = 0;
        for (int64_t c = 0; c < chunks; c++)
            total += job.sumsq[c];
        *norm = (float)(fabs((double)*inv_scale) * sqrt(total));
        if (job.found)
            *found_inf = 1.0f;
    }
    free(job.sumsq);
    return st;
}
