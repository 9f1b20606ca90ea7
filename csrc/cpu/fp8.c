/*
 * fp8.c: the fp8 casts on the CPU: cast_fp8 (fp32/fp16/bf16 -> e4m3fn or e5m2 with a scale,
 * and the amax of the input from the same read), fp8_amax (the amax alone) and
 * cast_from_fp8 (fp8 -> fp32/fp16/bf16 with the inverse scale).
 *
 * The per-element math is fp8.h's; the loops here compute the same bits lane by lane with
 * the best SIMD the CPU has (simd.h): AVX-512 (64 elements a step), AVX2 + F16C (32) or
 * scalar. Encoding is integer work on the fp32 bits (fp8.h explains the steps), decoding
 * is a lookup in a 256-entry table of exact fp32 values. The amax of each chunk is kept
 * as bits (Note [amax as bits]) and the chunks of a tensor are combined after the walk,
 * so the result does not depend on the thread count. A step stores its codes in one
 * 64-byte (AVX2: 32-byte) store; on AVX-512, outputs larger than the cache go out through
 * streaming stores (Note [streaming stores]), which measured faster once a store wrote a
 * whole line (16 or 32 bytes at a time, they were slower).
 */
#include <stdlib.h>
#include <string.h>

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
        float x = ampc_load(src, st, i);
        uint32_t b = ampc_abs_bits(x);
        m = b > m ? b : m;
        if (dst)
            dst[i] = ampc_cast_fp8_element(x, s, fmax, f);
    }
    return m;
}

/*
 * The loops prefetch their source PREFETCH_AHEAD bytes ahead: without it, the out-of-order
 * window alone keeps too few lines in flight to stream from memory (bf16 past the cache,
 * one thread: the AVX2 loop went from 17% of copy_'s GB/s to 80% with it, the AVX-512
 * one from 83% to over 100%). A prefetch past the end of a tensor is harmless
 * (prefetches never fault) and often fetches the next tensor of the list.
 */
#define PREFETCH_AHEAD 2048

/* Prefetches the source lines of elements [i, i + elems), PREFETCH_AHEAD bytes on (the
 * address is computed as an integer: it may lie past the tensor). */
INLINE void prefetch_step(const void *src, ampc_dtype st, int64_t i, int64_t elems)
{
    uintptr_t p = (uintptr_t)src + (uintptr_t)(i * ampc_dtype_size(st)) + PREFETCH_AHEAD;
    for (int64_t b = 0; b < elems * ampc_dtype_size(st); b += 64)
        _mm_prefetch((const char *)(p + (uintptr_t)b), _MM_HINT_T0);
}

/* The lines the first steps read, which the steps' own prefetches do not cover. */
INLINE void prefetch_start(const void *src, ampc_dtype st, int64_t n)
{
    int64_t bytes = n * ampc_dtype_size(st);
    for (int64_t b = 0; b < bytes && b < PREFETCH_AHEAD; b += 64)
        _mm_prefetch((const char *)src + b, _MM_HINT_T0);
}

// ---- AVX-512: 64 elements a step ----

/* The bits of |x|, for the amax (Note [amax as bits]). */
AVX512 INLINE __m512i abs_bits16(__m512 x)
{
    return _mm512_and_si512(_mm512_castps_si512(x), _mm512_set1_epi32(0x7fffffff));
}

/* The low `left` bits set (none when left <= 0, all 64 from 64 on): a tail's lane mask. */
INLINE uint64_t low_bits(int64_t left)
{
    return left <= 0 ? 0 : left >= 64 ? ~0ull : (1ull << left) - 1;
}

/*
 * fp8.h's ampc_cast_fp8_element on 16 lanes, each code left in its 32-bit lane (the packs
 * of fp8_pack64 narrow 64 at a time). The clamp works on |y|: min_ps returns its second
 * operand when either is NaN, so a NaN passes it, and the sign is put back at the end.
 */
AVX512 INLINE __m512i fp8_codes16(__m512 x, __m512 scale, struct ampc_fp8_format f)
{
    __m512i u = _mm512_castps_si512(_mm512_mul_ps(x, scale));
    __m512 abs_y = _mm512_castsi512_ps(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)));
    __m512 fmax = _mm512_castsi512_ps(_mm512_set1_epi32((int)f.fmax));
    __m512i a = _mm512_castps_si512(_mm512_min_ps(fmax, abs_y));
    __m512i magic = _mm512_set1_epi32((int)f.magic);
    __m512 sum = _mm512_add_ps(_mm512_castsi512_ps(a), _mm512_castsi512_ps(magic));
    __m512i odd = _mm512_and_si512(_mm512_srli_epi32(a, (unsigned)f.shift), _mm512_set1_epi32(1));
    __m512i bias = _mm512_set1_epi32((int)((1u << (f.shift - 1)) - 1u - f.rebias));
    __m512i code = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(a, bias), odd),
                                     (unsigned)f.shift);
    __mmask16 small = _mm512_cmplt_epu32_mask(a, _mm512_set1_epi32((int)f.min_normal));
    code = _mm512_mask_sub_epi32(code, small, _mm512_castps_si512(sum), magic);
    code = _mm512_min_epu32(code, _mm512_set1_epi32(0x7f));
    __m512i sign = _mm512_and_si512(_mm512_srli_epi32(u, 24), _mm512_set1_epi32(0x80));
    return _mm512_or_si512(code, sign);     /* one vpternlogd */
}

/* 64 codes (each < 256) from four vectors of 16: two dword-to-word packs and a word-to-byte
 * pack (3 shuffles, where vpmovdb costs 2 each) work within 128-bit lanes, so one
 * permute of 32-bit groups puts the bytes back in order (`order`, see the loop). */
AVX512 INLINE __m512i fp8_pack64(__m512i c0, __m512i c1, __m512i c2, __m512i c3, __m512i order)
{
    __m512i w01 = _mm512_packus_epi32(c0, c1);
    __m512i w23 = _mm512_packus_epi32(c2, c3);
    return _mm512_permutexvar_epi32(order, _mm512_packus_epi16(w01, w23));
}

/*
 * Elements [i, i + 64) of the list, or the `n - i` (< 64) left at the end with `tail`
 * (masked loads and a masked store; the lanes past the end load zeros, which leave the
 * amax alone). bf16 loads 32 elements at once and widens them by interleaving with zero
 * words (one shuffle for 16 elements, where vpmovzxwd and a shift cost two); the
 * interleave works within 128-bit lanes too, and the dword-to-word pack undoes it. The
 * amax of bf16 is taken on the 16-bit patterns (32 lanes an instruction), m16.
 */
AVX512 INLINE __m512i fp8_step64(const void *src, ampc_dtype st, int64_t i, int64_t n,
                                   int tail, __m512 scale, struct ampc_fp8_format f,
                                   __m512i *m32, __m512i *m16)
{
    __m512i c0, c1, c2, c3, order;
    if (st == AMPC_BF16) {
        const uint16_t *p = (const uint16_t *)src + i;
        __m512i h0, h1;
        if (tail) {
            uint64_t k = low_bits(n - i);
            h0 = _mm512_maskz_loadu_epi16((__mmask32)k, p);
            h1 = _mm512_maskz_loadu_epi16((__mmask32)(k >> 32), p + 32);
        } else {
            h0 = _mm512_loadu_si512(p);
            h1 = _mm512_loadu_si512(p + 32);
        }
        __m512i abs16 = _mm512_set1_epi16(0x7fff);
        *m16 = _mm512_max_epu16(*m16, _mm512_and_si512(h0, abs16));
        *m16 = _mm512_max_epu16(*m16, _mm512_and_si512(h1, abs16));
        __m512i zero = _mm512_setzero_si512();
        c0 = fp8_codes16(_mm512_castsi512_ps(_mm512_unpacklo_epi16(zero, h0)), scale, f);
        c1 = fp8_codes16(_mm512_castsi512_ps(_mm512_unpackhi_epi16(zero, h0)), scale, f);
        c2 = fp8_codes16(_mm512_castsi512_ps(_mm512_unpacklo_epi16(zero, h1)), scale, f);
        c3 = fp8_codes16(_mm512_castsi512_ps(_mm512_unpackhi_epi16(zero, h1)), scale, f);
        /* the packs leave 8 bytes of h0, then 8 of h1, per 128-bit lane */
        order = _mm512_setr_epi32(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15);
    } else {
        __m512 x[4];
        for (int v = 0; v < 4; v++) {
            int64_t at = i + 16 * v;
            __mmask16 k = (__mmask16)low_bits(n - at);
            if (!tail)
                x[v] = load16(src, st, at);
            else if (st == AMPC_F32)
                x[v] = _mm512_maskz_loadu_ps(k, (const float *)src + at);
            else
                x[v] = _mm512_cvtph_ps(_mm512_castsi512_si256(
                    _mm512_maskz_loadu_epi16(k, (const uint16_t *)src + at)));
            *m32 = _mm512_max_epu32(*m32, abs_bits16(x[v]));
        }
        c0 = fp8_codes16(x[0], scale, f);
        c1 = fp8_codes16(x[1], scale, f);
        c2 = fp8_codes16(x[2], scale, f);
        c3 = fp8_codes16(x[3], scale, f);
        /* the packs leave 4 bytes of each vector in turn, per 128-bit lane */
        order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    }
    return fp8_pack64(c0, c1, c2, c3, order);
}

AVX512 INLINE uint32_t cast_fp8_loop64(uint8_t *dst, const void *src, ampc_dtype st, float s,
                                         struct ampc_fp8_format f, int64_t n, int stream)
{
    __m512 scale = _mm512_set1_ps(s);
    __m512i m32 = _mm512_setzero_si512();
    __m512i m16 = _mm512_setzero_si512();
    int64_t i = 0;
    stream = stream && ((uintptr_t)dst & 63) == 0;
    prefetch_start(src, st, n);
    for (; i + 64 <= n; i += 64) {
        prefetch_step(src, st, i, 64);
        if (dst) {
            __m512i q = fp8_step64(src, st, i, n, 0, scale, f, &m32, &m16);
            if (stream)
                _mm512_stream_si512((__m512i *)(dst + i), q);
            else
                _mm512_storeu_si512(dst + i, q);
        } else if (st == AMPC_BF16) {
            __m512i abs16 = _mm512_set1_epi16(0x7fff);
            const uint16_t *p = (const uint16_t *)src + i;
            m16 = _mm512_max_epu16(m16, _mm512_and_si512(_mm512_loadu_si512(p), abs16));
            m16 = _mm512_max_epu16(m16, _mm512_and_si512(_mm512_loadu_si512(p + 32), abs16));
        } else {
            for (int v = 0; v < 4; v++)
                m32 = _mm512_max_epu32(m32, abs_bits16(load16(src, st, i + 16 * v)));
        }
    }
    if (stream)
        _mm_sfence();                       /* streamed lines are visible before we return */
    if (i < n) {
        __m512i q = fp8_step64(src, st, i, n, 1, scale, f, &m32, &m16);
        if (dst)
            _mm512_mask_storeu_epi8(dst + i, low_bits(n - i), q);
    }
    /* bf16's amax: the largest 16-bit |x| is the top half of the largest fp32 |x| */
    uint32_t m = (uint32_t)_mm512_reduce_max_epu32(m32);
    uint32_t h = (uint32_t)_mm512_reduce_max_epu32(_mm512_max_epu32(
        _mm512_and_si512(m16, _mm512_set1_epi32(0xffff)), _mm512_srli_epi32(m16, 16)));
    return m > h << 16 ? m : h << 16;
}

// ---- AVX2 + F16C: 32 elements a step ----

AVX2 INLINE __m256i abs_bits8(__m256 x)
{
    return _mm256_and_si256(_mm256_castps_si256(x), _mm256_set1_epi32(0x7fffffff));
}

/* As fp8_codes16, on 8 lanes. The subnormal test compares floats: |y| is not negative, and
 * a NaN fails it, as it fails the unsigned compare of the bits. */
AVX2 INLINE __m256i fp8_codes8(__m256 x, __m256 scale, struct ampc_fp8_format f)
{
    __m256i u = _mm256_castps_si256(_mm256_mul_ps(x, scale));
    __m256 abs_y = _mm256_castsi256_ps(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)));
    __m256 af = _mm256_min_ps(_mm256_castsi256_ps(_mm256_set1_epi32((int)f.fmax)), abs_y);
    __m256i a = _mm256_castps_si256(af);
    __m256i magic = _mm256_set1_epi32((int)f.magic);
    __m256 sum = _mm256_add_ps(af, _mm256_castsi256_ps(magic));
    __m256i sub = _mm256_sub_epi32(_mm256_castps_si256(sum), magic);
    __m256i odd = _mm256_and_si256(_mm256_srli_epi32(a, f.shift), _mm256_set1_epi32(1));
    __m256i bias = _mm256_set1_epi32((int)((1u << (f.shift - 1)) - 1u - f.rebias));
    __m256i norm = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(a, bias), odd), f.shift);
    __m256 small = _mm256_cmp_ps(af, _mm256_castsi256_ps(_mm256_set1_epi32((int)f.min_normal)),
                                 _CMP_LT_OQ);
    __m256i code = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(norm),
                                                        _mm256_castsi256_ps(sub), small));
    code = _mm256_min_epu32(code, _mm256_set1_epi32(0x7f));
    __m256i sign = _mm256_and_si256(_mm256_srli_epi32(u, 24), _mm256_set1_epi32(0x80));
    return _mm256_or_si256(code, sign);
}

/* 32 codes of elements [i, i + 32), as fp8_step64 on 8 lanes: the same packs within
 * 128-bit lanes and one permute (of 64-bit groups for bf16, of 32-bit ones otherwise). */
AVX2 INLINE __m256i fp8_step32(const void *src, ampc_dtype st, int64_t i, __m256 scale,
                               struct ampc_fp8_format f, __m256i *m32, __m256i *m16)
{
    __m256i c[4];
    if (st == AMPC_BF16) {
        const __m256i *p = (const __m256i *)((const uint16_t *)src + i);
        __m256i zero = _mm256_setzero_si256();
        for (int v = 0; v < 2; v++) {
            __m256i h = _mm256_loadu_si256(p + v);
            *m16 = _mm256_max_epu16(*m16, _mm256_and_si256(h, _mm256_set1_epi16(0x7fff)));
            c[2 * v] = fp8_codes8(_mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, h)), scale, f);
            __m256 hi = _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, h));
            c[2 * v + 1] = fp8_codes8(hi, scale, f);
        }
    } else {
        for (int v = 0; v < 4; v++) {
            __m256 x = load8(src, st, i + 8 * v);
            *m32 = _mm256_max_epu32(*m32, abs_bits8(x));
            c[v] = fp8_codes8(x, scale, f);
        }
    }
    __m256i b = _mm256_packus_epi16(_mm256_packus_epi32(c[0], c[1]),
                                    _mm256_packus_epi32(c[2], c[3]));
    if (st == AMPC_BF16)    /* 8 bytes of each source vector in turn, per 128-bit lane */
        return _mm256_permute4x64_epi64(b, 0xd8);
    return _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

/* Writes through the cache even past its size (`stream` is left alone): streaming stores
 * of 32 bytes, two to a line, measured slower than plain ones. */
AVX2 INLINE uint32_t cast_fp8_loop32(uint8_t *dst, const void *src, ampc_dtype st, float s,
                                     struct ampc_fp8_format f, int64_t n, int stream)
{
    __m256 scale = _mm256_set1_ps(s);
    __m256i m32 = _mm256_setzero_si256();
    __m256i m16 = _mm256_setzero_si256();
    int64_t i = 0;
    prefetch_start(src, st, n);
    for (; i + 32 <= n; i += 32) {
        prefetch_step(src, st, i, 32);
        if (dst) {
            __m256i q = fp8_step32(src, st, i, scale, f, &m32, &m16);
            _mm256_storeu_si256((__m256i *)(dst + i), q);
        } else if (st == AMPC_BF16) {
            const __m256i *p = (const __m256i *)((const uint16_t *)src + i);
            for (int v = 0; v < 2; v++)
                m16 = _mm256_max_epu16(m16, _mm256_and_si256(_mm256_loadu_si256(p + v),
                                                             _mm256_set1_epi16(0x7fff)));
        } else {
            for (int v = 0; v < 4; v++)
                m32 = _mm256_max_epu32(m32, abs_bits8(load8(src, st, i + 8 * v)));
        }
    }
    if (i < n) {                /* the last n - i < 32: one step on a zero-padded copy */
        float pad[32] = { 0 };
        size_t size = (size_t)ampc_dtype_size(st);
        memcpy(pad, (const char *)src + (size_t)i * size, (size_t)(n - i) * size);
        __m256i q = fp8_step32(pad, st, 0, scale, f, &m32, &m16);
        if (dst)
            memcpy(dst + i, &q, (size_t)(n - i));
    }
    uint32_t lanes[8];
    uint16_t halves[16];
    _mm256_storeu_si256((__m256i *)lanes, m32);
    _mm256_storeu_si256((__m256i *)halves, m16);
    uint32_t r = 0;
    for (int k = 0; k < 16; k++) {
        r = k < 8 && lanes[k] > r ? lanes[k] : r;
        r = (uint32_t)halves[k] << 16 > r ? (uint32_t)halves[k] << 16 : r;   /* bf16's */
    }
    return r;
}

// ---- one specialised loop per (ISA, source dtype, format; or the amax alone) ----

/* The loop bodies take everything as arguments and are always inlined, so each case is a
 * branch-free loop for its constants. */
#define FP8_LOOP(loop, st, fmt) loop(dst, src, st, s, ampc_fp8_format_of(fmt), n, stream)
#define AMAX_LOOP(loop, st) loop(NULL, src, st, 1.0f, ampc_fp8_format_of(AMPC_F8E4M3), n, 0)
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
                                         ampc_dtype st, float s, int64_t n, int stream)
{
    FP8_CASES(cast_fp8_loop64)
}

AVX2 static uint32_t cast_fp8_avx2(uint8_t *dst, ampc_dtype fmt, const void *src,
                                   ampc_dtype st, float s, int64_t n, int stream)
{
    FP8_CASES(cast_fp8_loop32)
}

/* dst[0..n) = codes of src[0..n) (none when dst is NULL); returns the max of their |x|
 * bits. A NaN scale goes to the scalar loop, which picks the NaN (Note [NaN times a NaN
 * scale]). With `stream`, whole lines of dst go out through streaming stores (Note
 * [streaming stores]). */
static uint32_t cast_fp8_block(uint8_t *dst, ampc_dtype fmt, const void *src, ampc_dtype st,
                               float s, int64_t n, int stream)
{
    switch (s == s ? ampc_cpu_isa() : ISA_SCALAR) {
    case ISA_AVX512: return cast_fp8_avx512(dst, fmt, src, st, s, n, stream);
    case ISA_AVX2: return cast_fp8_avx2(dst, fmt, src, st, s, n, stream);
    default: return cast_fp8_scalar(dst, src, st, s, ampc_fp8_format_of(fmt), 0, n);
    }
}

// ---- cast_fp8 and fp8_amax: the walk over the list ----

struct cast_fp8_job {
    const struct ampc_list *dst;    /* NULL for fp8_amax */
    const struct ampc_list *src;
    const struct ampc_list *scale;  /* NULL for fp8_amax */
    uint32_t *chunk_max;            /* per chunk, the max of its |x| bits */
    int stream;                     /* Note [streaming stores] */
};

static void cast_fp8_span(void *ctx, const struct ampc_span *s)
{
    const struct cast_fp8_job *job = ctx;
    ampc_dtype st = job->src->dtype;
    const char *src = (const char *)job->src->ptr[s->tensor] + s->begin * ampc_dtype_size(st);
    uint8_t *dst = job->dst ? (uint8_t *)job->dst->ptr[s->tensor] + s->begin : NULL;
    float scale = job->scale ? *(const float *)job->scale->ptr[s->tensor] : 1.0f;
    ampc_dtype fmt = job->dst ? job->dst->dtype : AMPC_F8E4M3;
    job->chunk_max[s->chunk] = cast_fp8_block(dst, fmt, src, st, scale, s->end - s->begin,
                                              job->stream);
}

static ampc_status cast_fp8_walk(const struct ampc_list *dst, const struct ampc_list *amax,
                                 const struct ampc_list *src, const struct ampc_list *scale)
{
    int64_t chunks = ampc_chunk_count(src);
    uint32_t *chunk_max = malloc(sizeof(*chunk_max) * (size_t)(chunks ? chunks : 1));
    if (!chunk_max)
        return AMPC_ERR_NOMEM;
    int64_t moved = 0;
    for (int64_t i = 0; dst && i < src->count; i++)
        moved += src->numel[i] * (ampc_dtype_size(src->dtype) + 1);
    struct cast_fp8_job job = { dst, src, scale, chunk_max, moved > ampc_cache_bytes() };
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
        ampc_store(dst, dt, i, ampc_fp8_mul(table[src[i]], s));
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
        ampc_store(dst, dt, i, ampc_fp8_mul(table[src[i]], s));
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
            ampc_store(dst, dt, i, ampc_fp8_mul(job->table[src[i]], scale_inv));
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
