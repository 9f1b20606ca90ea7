/*
 * lean_avx2.c: the lean step's loops (lean_loops.h) for AVX2 with FMA and F16C (as simd.h's AVX2). The target comes before
 * every header, so that the inline math of adam.h and lean.h is compiled for it too.
 * Without trapping math the compiler may compute both sides of a select (flags known only
 * at run time) and keep one, which vectorizes; no value changes.
 *
 * The lean preset's layout (8-bit moments, bf16 params and grads, stochastic rounding,
 * plain AdamW) has its two loops written out by hand, 8 lanes at a time: left to the
 * compiler they ran about 146 vector instructions per 8 parameters (the 8-bit codes
 * widened 32 lanes at a time, which spilled, and the random bits' index in 64-bit lanes);
 * docs/internals.md counts both. Every operation is lean.h's, in its order, so the bits
 * are the scalar loop's.
 */
#pragma GCC target("avx2,fma,f16c")
/* no loop distribution: it split the random bits' store into a loop of its own, which
 * computed the hash a second time */
#pragma GCC optimize("no-trapping-math", "no-tree-loop-distribution")

#include "adam.h"
#include "codes_avx2.h"          // includes: lean.h, simd.h

AVX2 INLINE __m256i mix32_8(__m256i x)         /* cast.h's ampc_mix32, 8 lanes */
{
    x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
    x = _mm256_mullo_epi32(x, _mm256_set1_epi32(0x7feb352d));
    x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 15));
    x = _mm256_mullo_epi32(x, _mm256_set1_epi32((int)0x846ca68bu));
    return _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
}

AVX2 INLINE uint32_t hmax_epu32(__m256i x, uint32_t init)
{
    uint32_t a[8], r = init;
    _mm256_storeu_si256((__m256i *)a, x);
    for (int j = 0; j < 8; j++)
        r = a[j] > r ? a[j] : r;
    return r;
}

/* 8 codes of exp_avg to fp32 without a table: the code (sign, 4 exponent bits, 3 mantissa
 * bits) moved into an fp16's bit positions reads as the code's value times 2^-8,
 * subnormal codes included (fp16 subnormals widen exactly to normal fp32), so times
 * factor * 2^8 it is lean.h's ampc_q8m_decode: value * factor, rounded once. The sign
 * extension puts the sign at bit 15 and a copy at bit 14, which the mask clears. */
AVX2 INLINE __m256 decode_m8(const uint8_t *q, __m256 f256)
{
    __m128i c = _mm_cvtepi8_epi16(_mm_loadl_epi64((const __m128i *)q));
    c = _mm_and_si128(_mm_slli_epi16(c, 7), _mm_set1_epi16((short)0xbf80));
    return _mm256_mul_ps(_mm256_cvtph_ps(c), f256);
}

/* 8 codes of exp_avg_sq (4 exponent bits, 4 mantissa bits) the same way: sqrt(v), squared. */
AVX2 INLINE __m256 decode_v8(const uint8_t *q, __m256 f256)
{
    __m128i c = _mm_slli_epi16(_mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)q)), 6);
    __m256 s = _mm256_mul_ps(_mm256_cvtph_ps(c), f256);
    return _mm256_mul_ps(s, s);
}

/* Elements [lo, hi) of the preset's block, 8 at a time: lean.h's ampc_lean_element with
 * the layout and AdamW's flags fixed, m, sqrt(v) and the random bits left in mb, sb and
 * rb, the absmax bits folded into *mx and *vx. Returns where it stopped (the rest goes to the generic loop). */
AVX2 INLINE int64_t lean_step_preset(const struct ampc_lean_at *at, const struct ampc_adam_coef *c,
                                     uint32_t key_w, uint32_t base, int64_t lo, int64_t hi,
                                     float fm, float fv, float *mb, float *sb, uint32_t *rb,
                                     uint32_t *mx, uint32_t *vx)
{
    const uint16_t *gp = (const uint16_t *)at->grad;
    uint16_t *pp = (uint16_t *)at->param;
    const uint8_t *qm = (const uint8_t *)at->m, *qv = (const uint8_t *)at->v;
    /* 2^8: the fp16 codes' offset (decode_m8); exact, and under fp32's max since the
     * factor is at most FLT_MAX / 480 */
    const __m256 fm256 = _mm256_set1_ps(fm * 256.0f), fv256 = _mm256_set1_ps(fv * 256.0f);
    const __m256 inv_scale = _mm256_set1_ps(c->inv_scale), clip = _mm256_set1_ps(c->clip_coef);
    /* a scale and a clip of 1 change no value (adam.h): skip both multiplies then */
    const int scaled = c->inv_scale != 1.0f || c->clip_coef != 1.0f;
    const __m256 decay = _mm256_set1_ps(c->decay), w1 = _mm256_set1_ps(c->w1);
    const __m256 w2 = _mm256_set1_ps(c->w2), beta2 = _mm256_set1_ps(c->beta2);
    const __m256 bc2 = _mm256_set1_ps(c->bc2_sqrt), eps = _mm256_set1_ps(c->eps);
    const __m256 nss = _mm256_set1_ps(c->neg_step_size);
    const __m256i abs_mask = _mm256_set1_epi32(0x7fffffff), quiet = _mm256_set1_epi32(0x40);
    const __m256i key = _mm256_set1_epi32((int)key_w), eight = _mm256_set1_epi32(8);
    /* index_lo of lanes i..i+7, kept in 32-bit lanes as the scalar loop's wraps */
    __m256i idx = _mm256_add_epi32(_mm256_set1_epi32((int)(base + (uint32_t)lo)),
                                   _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    __m256i mmax = _mm256_setzero_si256(), vmax = _mm256_setzero_si256();
    int64_t i = lo;
    for (; i + 8 <= hi; i += 8) {
        __m256 g = _mm256_castsi256_ps(_mm256_slli_epi32(
            _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(gp + i))), 16));
        __m256 w = _mm256_castsi256_ps(_mm256_slli_epi32(
            _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(pp + i))), 16));
        __m256 m = decode_m8(qm + i, fm256), v = decode_v8(qv + i, fv256);
        if (scaled)
            g = _mm256_mul_ps(_mm256_mul_ps(g, inv_scale), clip);
        /* adam.h's ampc_adam_element_as for AdamW, beta1 > 0.5, not maximizing */
        w = _mm256_mul_ps(w, decay);
        m = _mm256_fmadd_ps(w1, _mm256_sub_ps(g, m), m);
        v = _mm256_fmadd_ps(_mm256_mul_ps(w2, g), g, _mm256_mul_ps(v, beta2));
        __m256 s = _mm256_sqrt_ps(v);
        __m256 d = _mm256_add_ps(_mm256_div_ps(s, bc2), eps);
        w = _mm256_add_ps(w, _mm256_div_ps(_mm256_mul_ps(nss, m), d));
        /* cast.h's ampc_f32_to_bf16_sr with ampc_random_bits_keyed(key_w, index_lo) */
        __m256i u = _mm256_castps_si256(w);
        __m256i h = mix32_8(_mm256_xor_si256(idx, key));
        _mm256_storeu_si256((__m256i *)(rb + i), h);
        __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_srli_epi32(h, 16)), 16);
        __m256i nan = _mm256_or_si256(_mm256_srli_epi32(u, 16), quiet);
        __m256i b = _mm256_blendv_epi8(rounded, nan, _mm256_castps_si256(_mm256_cmp_ps(w, w, _CMP_UNORD_Q)));
        _mm_storeu_si128((__m128i *)(pp + i),
                         _mm_packus_epi32(_mm256_castsi256_si128(b), _mm256_extracti128_si256(b, 1)));
        _mm256_storeu_ps(mb + i, m);
        _mm256_storeu_ps(sb + i, s);
        mmax = _mm256_max_epu32(mmax, _mm256_and_si256(_mm256_castps_si256(m), abs_mask));
        vmax = _mm256_max_epu32(vmax, _mm256_and_si256(_mm256_castps_si256(v), abs_mask));
        idx = _mm256_add_epi32(idx, eight);
    }
    *mx = hmax_epu32(mmax, *mx);
    *vx = hmax_epu32(vmax, *vx);
    return i;
}

/* A block's codes of both moments, 8 at a time: lean.h's ampc_q8m_code_by and
 * ampc_q8v_code_by with the block's factors fm and fv (ampc_q8_code_factor, not 0) and
 * v's random bits rb, packed to bytes in registers. Returns where it stopped. */
AVX2 INLINE int64_t lean_encode_both(uint8_t *qm, uint8_t *qv, const float *mb, const float *sb,
                                     const uint32_t *rb, int64_t n, float fm, float fv)
{
    const __m256 m_factor = _mm256_set1_ps(fm), v_factor = _mm256_set1_ps(fv);
    /* m's bytes to the low 8 bytes of each 128-bit half, v's to the next 8 */
    const __m256i gather = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256i cm = q8m_code8(_mm256_loadu_ps(mb + i), m_factor);
        __m256 av = _mm256_mul_ps(_mm256_loadu_ps(sb + i), v_factor);
        __m256i cv = e4m4_sr_code8(av, _mm256_loadu_si256((const __m256i *)(rb + i)));
        /* words [m0-3 v0-3 | m4-7 v4-7], bytes likewise twice over, then m0-7 and v0-7 */
        __m256i w = _mm256_packus_epi32(cm, cv);
        __m256i by = _mm256_permutevar8x32_epi32(_mm256_packus_epi16(w, w), gather);
        __m128i lo = _mm256_castsi256_si128(by);
        _mm_storel_epi64((__m128i *)(qm + i), lo);
        _mm_storeh_pd((double *)(qv + i), _mm_castsi128_pd(lo));
    }
    return i;
}

#define LEAN_STEP_PRESET lean_step_preset
#define LEAN_ENCODE_BOTH lean_encode_both
#define LEAN_CHUNK ampc_lean_chunk_avx2
#include "lean_loops.h"
