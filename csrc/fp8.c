/*
 * fp8.c: the fp8 casts on the CPU: cast_fp8 (fp32/fp16/bf16 -> e4m3fn or e5m2 with a scale,
 * and the amax of the input from the same read), fp8_amax (the amax alone) and
 * cast_from_fp8 (fp8 -> fp32/fp16/bf16 with the inverse scale).
 *
 * The per-element math is fp8.h's; the loops here compute the same bits lane by lane with
 * the best SIMD the CPU has (simd.h): AVX-512 (16 lanes), AVX2 + F16C (8 lanes) or scalar,
 * the tails in scalar code. Encoding is integer work on the fp32 bits (fp8.h explains the
 * steps), decoding is a lookup in a 256-entry table of exact fp32 values. The amax of each
 * chunk is kept as bits (Note [amax as bits]) and the chunks of a tensor are combined
 * after the walk, so the result does not depend on the thread count. The fp8 outputs go
 * through the cache even when large: a byte an element is a small share of the traffic,
 * and streaming stores (16 bytes or whole lines at a time) measured slower.
 */
#include <stdlib.h>

#include "fp8.h"
#include "simd.h"

// ---- scalar: the reference, and the tails of the vector loops ----

/* Elements [i, n): the max of their |x| bits; with dst, also their codes. */
INLINE uint32_t cast_fp8_scalar(uint8_t *dst, const void *src, ampc_dtype st, float s,
                                struct ampc_fp8_format f, int64_t i, int64_t n)
{
    float fmax = ampc_bits_f32(f.fmax);
    uint32_t m = 0;
    for (; i < n; i++) {
        float x = load1(src, st, i);
        uint32_t b = ampc_abs_bits(x);
        m = b > m ? b : m;
        if (dst)
            dst[i] = ampc_cast_fp8_element(x, s, fmax, f);
    }
    return m;
}

// ---- AVX-512: 16 lanes ----

/* fp8.h's ampc_fp8_encode on 16 lanes (y already saturated), packed to 16 bytes. */
AVX512 INLINE __m128i fp8_encode16(__m512 y, struct ampc_fp8_format f)
{
    __m512i u = _mm512_castps_si512(y);
    __m512i a = _mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff));
    __m512i sign = _mm512_and_si512(_mm512_srli_epi32(u, 24), _mm512_set1_epi32(0x80));
    __m512i magic = _mm512_set1_epi32((int)f.magic);
    __m512 sum = _mm512_add_ps(_mm512_castsi512_ps(a), _mm512_castsi512_ps(magic));
    __m512i sub = _mm512_sub_epi32(_mm512_castps_si512(sum), magic);
    __m512i odd = _mm512_and_si512(_mm512_srli_epi32(a, (unsigned)f.shift), _mm512_set1_epi32(1));
    __m512i bias = _mm512_set1_epi32((int)((1u << (f.shift - 1)) - 1u - f.rebias));
    __m512i norm = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(a, bias), odd),
                                     (unsigned)f.shift);
    __mmask16 small = _mm512_cmplt_epu32_mask(a, _mm512_set1_epi32((int)f.min_normal));
    __m512i code = _mm512_mask_blend_epi32(small, norm, sub);
    code = _mm512_min_epu32(code, _mm512_set1_epi32(0x7f));
    return _mm512_cvtepi32_epi8(_mm512_or_si512(code, sign));
}

/* max_ps returns its second operand when either is NaN, so a NaN product passes both. */
AVX512 INLINE __m512 saturate16(__m512 y, float fmax)
{
    return _mm512_min_ps(_mm512_set1_ps(fmax), _mm512_max_ps(_mm512_set1_ps(-fmax), y));
}

AVX512 INLINE uint32_t cast_fp8_loop16(uint8_t *dst, const void *src, ampc_dtype st, float s,
                                       struct ampc_fp8_format f, int64_t n)
{
    __m512 vs = _mm512_set1_ps(s);
    __m512i m = _mm512_setzero_si512();
    __m512i abs_mask = _mm512_set1_epi32(0x7fffffff);
    float fmax = ampc_bits_f32(f.fmax);
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m512 x = load16(src, st, i);
        m = _mm512_max_epu32(m, _mm512_and_si512(_mm512_castps_si512(x), abs_mask));
        if (dst)
            _mm_storeu_si128((__m128i *)(dst + i),
                             fp8_encode16(saturate16(_mm512_mul_ps(x, vs), fmax), f));
    }
    uint32_t r = (uint32_t)_mm512_reduce_max_epu32(m);
    uint32_t t = cast_fp8_scalar(dst, src, st, s, f, i, n);
    return r > t ? r : t;
}

// ---- AVX2 + F16C: 8 lanes ----

/* As fp8_encode16, 8 lanes packed to the low 8 bytes. Every |y| pattern is below 2^31,
 * so a signed compare orders them. */
AVX2 INLINE __m128i fp8_encode8(__m256 y, struct ampc_fp8_format f)
{
    __m256i u = _mm256_castps_si256(y);
    __m256i a = _mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff));
    __m256i sign = _mm256_and_si256(_mm256_srli_epi32(u, 24), _mm256_set1_epi32(0x80));
    __m256i magic = _mm256_set1_epi32((int)f.magic);
    __m256 sum = _mm256_add_ps(_mm256_castsi256_ps(a), _mm256_castsi256_ps(magic));
    __m256i sub = _mm256_sub_epi32(_mm256_castps_si256(sum), magic);
    __m256i odd = _mm256_and_si256(_mm256_srli_epi32(a, f.shift), _mm256_set1_epi32(1));
    __m256i bias = _mm256_set1_epi32((int)((1u << (f.shift - 1)) - 1u - f.rebias));
    __m256i norm = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(a, bias), odd), f.shift);
    __m256i small = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)f.min_normal), a);
    __m256i code = _mm256_blendv_epi8(norm, sub, small);
    code = _mm256_min_epu32(code, _mm256_set1_epi32(0x7f));
    code = _mm256_or_si256(code, sign);
    /* 8 x 32 -> 8 x 16 -> 8 x 8: every code is below 256, so unsigned saturation keeps it */
    __m128i w = _mm_packus_epi32(_mm256_castsi256_si128(code), _mm256_extracti128_si256(code, 1));
    return _mm_packus_epi16(w, w);
}

AVX2 INLINE __m256 saturate8(__m256 y, float fmax)
{
    return _mm256_min_ps(_mm256_set1_ps(fmax), _mm256_max_ps(_mm256_set1_ps(-fmax), y));
}

/* Two vectors a step, so that 16 codes go out in one store. */
AVX2 INLINE uint32_t cast_fp8_loop8(uint8_t *dst, const void *src, ampc_dtype st, float s,
                                    struct ampc_fp8_format f, int64_t n)
{
    __m256 vs = _mm256_set1_ps(s);
    __m256i m = _mm256_setzero_si256();
    __m256i abs_mask = _mm256_set1_epi32(0x7fffffff);
    float fmax = ampc_bits_f32(f.fmax);
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m256 a = load8(src, st, i);
        __m256 b = load8(src, st, i + 8);
        m = _mm256_max_epu32(m, _mm256_and_si256(_mm256_castps_si256(a), abs_mask));
        m = _mm256_max_epu32(m, _mm256_and_si256(_mm256_castps_si256(b), abs_mask));
        if (dst) {
            __m128i lo = fp8_encode8(saturate8(_mm256_mul_ps(a, vs), fmax), f);
            __m128i hi = fp8_encode8(saturate8(_mm256_mul_ps(b, vs), fmax), f);
            _mm_storeu_si128((__m128i *)(dst + i), _mm_unpacklo_epi64(lo, hi));
        }
    }
    uint32_t lanes[8];
    _mm256_storeu_si256((__m256i *)lanes, m);
    uint32_t r = cast_fp8_scalar(dst, src, st, s, f, i, n);
    for (int k = 0; k < 8; k++)
        r = lanes[k] > r ? lanes[k] : r;
    return r;
}

// ---- one specialised loop per (ISA, source dtype, format; or the amax alone) ----

/* The loop bodies take everything as arguments and are always inlined, so each case is a
 * branch-free loop for its constants. */
#define FP8_LOOP(loop, st, fmt) loop(dst, src, st, s, ampc_fp8_format_of(fmt), n)
#define AMAX_LOOP(loop, st) loop(NULL, src, st, 1.0f, ampc_fp8_format_of(AMPC_F8E4M3), n)
#define FP8_CASES(loop)                                                                     \
    if (!dst) {                                                                             \
        switch (st) {                                                                       \
        case AMPC_F32: return AMAX_LOOP(loop, AMPC_F32);                                    \
        case AMPC_F16: return AMAX_LOOP(loop, AMPC_F16);                                    \
        default: return AMAX_LOOP(loop, AMPC_BF16);                                         \
        }                                                                                   \
    }                                                                                       \
    switch ((int)st * 2 + (fmt == AMPC_F8E5M2)) {                                           \
    case AMPC_F32 * 2: return FP8_LOOP(loop, AMPC_F32, AMPC_F8E4M3);                        \
    case AMPC_F32 * 2 + 1: return FP8_LOOP(loop, AMPC_F32, AMPC_F8E5M2);                    \
    case AMPC_F16 * 2: return FP8_LOOP(loop, AMPC_F16, AMPC_F8E4M3);                        \
    case AMPC_F16 * 2 + 1: return FP8_LOOP(loop, AMPC_F16, AMPC_F8E5M2);                    \
    case AMPC_BF16 * 2: return FP8_LOOP(loop, AMPC_BF16, AMPC_F8E4M3);                      \
    default: return FP8_LOOP(loop, AMPC_BF16, AMPC_F8E5M2);                                 \
    }

AVX512 static uint32_t cast_fp8_avx512(uint8_t *dst, ampc_dtype fmt, const void *src,
                                       ampc_dtype st, float s, int64_t n)
{
    FP8_CASES(cast_fp8_loop16)
}

AVX2 static uint32_t cast_fp8_avx2(uint8_t *dst, ampc_dtype fmt, const void *src,
                                   ampc_dtype st, float s, int64_t n)
{
    FP8_CASES(cast_fp8_loop8)
}

/* dst[0..n) = codes of src[0..n) (none when dst is NULL); returns the max of their |x|
 * bits. A NaN scale goes to the scalar loop, which picks the NaN (Note [NaN times a NaN
 * scale]). */
static uint32_t cast_fp8_block(uint8_t *dst, ampc_dtype fmt, const void *src, ampc_dtype st,
                               float s, int64_t n)
{
    switch (s == s ? ampc_cpu_isa() : ISA_SCALAR) {
    case ISA_AVX512: return cast_fp8_avx512(dst, fmt, src, st, s, n);
    case ISA_AVX2: return cast_fp8_avx2(dst, fmt, src, st, s, n);
    default: return cast_fp8_scalar(dst, src, st, s, ampc_fp8_format_of(fmt), 0, n);
    }
}

// ---- cast_fp8 and fp8_amax: the walk over the list ----

struct cast_fp8_job {
    const struct ampc_list *dst;    /* NULL for fp8_amax */
    const struct ampc_list *src;
    const struct ampc_list *scale;  /* NULL for fp8_amax */
    uint32_t *chunk_max;            /* per chunk, the max of its |x| bits */
};

static void cast_fp8_span(void *ctx, const struct ampc_span *s)
{
    const struct cast_fp8_job *job = ctx;
    ampc_dtype st = job->src->dtype;
    const char *src = (const char *)job->src->ptr[s->tensor] + s->begin * ampc_dtype_size(st);
    uint8_t *dst = job->dst ? (uint8_t *)job->dst->ptr[s->tensor] + s->begin : NULL;
    float scale = job->scale ? *(const float *)job->scale->ptr[s->tensor] : 1.0f;
    ampc_dtype fmt = job->dst ? job->dst->dtype : AMPC_F8E4M3;
    job->chunk_max[s->chunk] = cast_fp8_block(dst, fmt, src, st, scale, s->end - s->begin);
}

static ampc_status cast_fp8_walk(const struct ampc_list *dst, const struct ampc_list *amax,
                                 const struct ampc_list *src, const struct ampc_list *scale)
{
    int64_t chunks = ampc_chunk_count(src);
    uint32_t *chunk_max = malloc(sizeof(*chunk_max) * (size_t)(chunks ? chunks : 1));
    if (!chunk_max)
        return AMPC_ERR_NOMEM;
    struct cast_fp8_job job = { dst, src, scale, chunk_max };
    ampc_status st = ampc_for_each_chunk(src, cast_fp8_span, &job);
    for (int64_t i = 0, c = 0; st == AMPC_OK && i < src->count; i++) {
        uint32_t m = 0;         /* an empty tensor has no chunk: its amax is 0 */
        for (int64_t end = c + (src->numel[i] + AMPC_CHUNK - 1) / AMPC_CHUNK; c < end; c++)
            m = chunk_max[c] > m ? chunk_max[c] : m;
        *(float *)amax->ptr[i] = ampc_amax_value(m);
    }
    free(chunk_max);
    return st;
}

ampc_status ampc_cast_fp8_cpu(const struct ampc_list *dst, const struct ampc_list *amax,
                              const struct ampc_list *src, const struct ampc_list *scale)
{
    return cast_fp8_walk(dst, amax, src, scale);
}

ampc_status ampc_fp8_amax_cpu(const struct ampc_list *amax, const struct ampc_list *src)
{
    return cast_fp8_walk(NULL, amax, src, NULL);
}

// ---- cast_from_fp8 ----

struct cast_from_fp8_job {
    const struct ampc_list *dst;
    const struct ampc_list *src;
    const struct ampc_list *scale_inv;
    float table[256];               /* the exact value of each code of src's format */
};

AVX512 INLINE void from_fp8_loop16(void *dst, ampc_dtype dt, const uint8_t *src,
                                   const float *table, float s, int64_t n)
{
    __m512 vs = _mm512_set1_ps(s);
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(src + i)));
        store16(dst, dt, i, _mm512_mul_ps(_mm512_i32gather_ps(q, table, 4), vs));
    }
    for (; i < n; i++)
        store1(dst, dt, i, ampc_fp8_mul(table[src[i]], s));
}

AVX2 INLINE void from_fp8_loop8(void *dst, ampc_dtype dt, const uint8_t *src,
                                const float *table, float s, int64_t n)
{
    __m256 vs = _mm256_set1_ps(s);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256i q = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(src + i)));
        store8(dst, dt, i, _mm256_mul_ps(_mm256_i32gather_ps(table, q, 4), vs));
    }
    for (; i < n; i++)
        store1(dst, dt, i, ampc_fp8_mul(table[src[i]], s));
}

AVX512 static void from_fp8_avx512(void *dst, ampc_dtype dt, const uint8_t *src,
                                   const float *table, float s, int64_t n)
{
    switch (dt) {
    case AMPC_F32: from_fp8_loop16(dst, AMPC_F32, src, table, s, n); break;
    case AMPC_F16: from_fp8_loop16(dst, AMPC_F16, src, table, s, n); break;
    default: from_fp8_loop16(dst, AMPC_BF16, src, table, s, n);
    }
}

AVX2 static void from_fp8_avx2(void *dst, ampc_dtype dt, const uint8_t *src,
                               const float *table, float s, int64_t n)
{
    switch (dt) {
    case AMPC_F32: from_fp8_loop8(dst, AMPC_F32, src, table, s, n); break;
    case AMPC_F16: from_fp8_loop8(dst, AMPC_F16, src, table, s, n); break;
    default: from_fp8_loop8(dst, AMPC_BF16, src, table, s, n);
    }
}

static void cast_from_fp8_span(void *ctx, const struct ampc_span *s)
{
    const struct cast_from_fp8_job *job = ctx;
    ampc_dtype dt = job->dst->dtype;
    char *dst = (char *)job->dst->ptr[s->tensor] + s->begin * ampc_dtype_size(dt);
    const uint8_t *src = (const uint8_t *)job->src->ptr[s->tensor] + s->begin;
    float scale_inv = *(const float *)job->scale_inv->ptr[s->tensor];
    int64_t n = s->end - s->begin;
    switch (scale_inv == scale_inv ? ampc_cpu_isa() : ISA_SCALAR) {
    case ISA_AVX512: from_fp8_avx512(dst, dt, src, job->table, scale_inv, n); break;
    case ISA_AVX2: from_fp8_avx2(dst, dt, src, job->table, scale_inv, n); break;
    default:
        for (int64_t i = 0; i < n; i++)
            store1(dst, dt, i, ampc_fp8_mul(job->table[src[i]], scale_inv));
    }
}

ampc_status ampc_cast_from_fp8_cpu(const struct ampc_list *dst, const struct ampc_list *src,
                                   const struct ampc_list *scale_inv)
{
    struct cast_from_fp8_job job = { dst, src, scale_inv, { 0 } };
    for (int q = 0; q < 256; q++)
        job.table[q] = ampc_fp8_decode((uint8_t)q, src->dtype);
    return ampc_for_each_chunk(src, cast_from_fp8_span, &job);
}
