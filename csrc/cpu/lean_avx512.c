/*
 * lean_avx512.c: the lean step's loops (lean_loops.h) for AVX-512 (F and BW, as simd.h's AVX512). The target comes before
 * every header, so that the inline math of adam.h and lean.h is compiled for it too.
 * Without trapping math the compiler may compute both sides of a select (flags known only
 * at run time) and keep one, which vectorizes; no value changes.
 *
 * The lean preset's layout (8-bit moments, bf16 params and grads, stochastic rounding,
 * plain AdamW) has its two loops written out by hand, 16 lanes at a time, as lean_avx2.c
 * does 8: left to the compiler they ran about 120 vector instructions per 16 parameters
 * (four passes of 16 unrolled into one loop that spilled, the random bits' index in 64-bit
 * lanes, every code decoded through its subnormal and normal paths); docs/internals.md
 * counts both. Masks replace the blends, vpternlogd joins the code's sign, and vpmovdw /
 * vpmovdb narrow in one instruction. Every operation is lean.h's, in its order, so the
 * bits are the scalar loop's.
 */
#pragma GCC target("avx512f,avx512bw")
/* no loop distribution: it split the random bits' store into a loop of its own, which
 * computed the hash a second time */
#pragma GCC optimize("no-trapping-math", "no-tree-loop-distribution")

#include "adam.h"
#include "codes_avx512.h"          // includes: lean.h, simd.h

AVX512 INLINE __m512i mix32_16(__m512i x)      /* cast.h's ampc_mix32, 16 lanes */
{
    x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
    x = _mm512_mullo_epi32(x, _mm512_set1_epi32(0x7feb352d));
    x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 15));
    x = _mm512_mullo_epi32(x, _mm512_set1_epi32((int)0x846ca68bu));
    return _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
}

/* 16 codes of exp_avg to fp32 without a table, as lean_avx2.c's decode_m8: the code moved
 * into an fp16's bit positions is its value times 2^-8, subnormal codes included, so times
 * factor * 2^8 it is lean.h's ampc_q8m_decode. */
AVX512 INLINE __m512 decode_m16(const uint8_t *q, __m512 f256)
{
    __m256i c = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)q));
    c = _mm256_and_si256(_mm256_slli_epi16(c, 7), _mm256_set1_epi16((short)0xbf80));
    return _mm512_mul_ps(_mm512_cvtph_ps(c), f256);
}

/* 16 codes of exp_avg_sq (4 exponent bits, 4 mantissa bits): sqrt(v), squared. */
AVX512 INLINE __m512 decode_v16(const uint8_t *q, __m512 f256)
{
    __m256i c = _mm256_slli_epi16(_mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)q)), 6);
    __m512 s = _mm512_mul_ps(_mm512_cvtph_ps(c), f256);
    return _mm512_mul_ps(s, s);
}

AVX512 INLINE __m512 load_bf16x16(const uint16_t *p)
{
    return _mm512_castsi512_ps(_mm512_slli_epi32(
        _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

/* Elements [lo, hi) of the preset's block, 16 at a time: lean.h's ampc_lean_element with
 * the layout and AdamW's flags fixed, m, sqrt(v) and the random bits left in mb, sb and
 * rb, the absmax bits folded into *mx and *vx. Returns where it stopped (the rest goes to the generic loop). */
AVX512 INLINE int64_t lean_step_preset(const struct ampc_lean_at *at,
                                       const struct ampc_adam_coef *c, uint32_t key_w,
                                       uint32_t base, int64_t lo, int64_t hi, float fm,
                                       float fv, float *mb, float *sb, uint32_t *rb,
                                       uint32_t *mx, uint32_t *vx)
{
    const uint16_t *gp = (const uint16_t *)at->grad;
    uint16_t *pp = (uint16_t *)at->param;
    const uint8_t *qm = (const uint8_t *)at->m, *qv = (const uint8_t *)at->v;
    /* 2^8: the fp16 codes' offset (decode_m16); exact, and under fp32's max since the
     * factor is at most FLT_MAX / 480 */
    const __m512 fm256 = _mm512_set1_ps(fm * 256.0f), fv256 = _mm512_set1_ps(fv * 256.0f);
    const __m512 inv_scale = _mm512_set1_ps(c->inv_scale), clip = _mm512_set1_ps(c->clip_coef);
    /* a scale and a clip of 1 change no value (adam.h): skip both multiplies then */
    const int scaled = c->inv_scale != 1.0f || c->clip_coef != 1.0f;
    const __m512 decay = _mm512_set1_ps(c->decay), w1 = _mm512_set1_ps(c->w1);
    const __m512 w2 = _mm512_set1_ps(c->w2), beta2 = _mm512_set1_ps(c->beta2);
    const __m512 bc2 = _mm512_set1_ps(c->bc2_sqrt), eps = _mm512_set1_ps(c->eps);
    const __m512 nss = _mm512_set1_ps(c->neg_step_size);
    const __m512i abs_mask = _mm512_set1_epi32(0x7fffffff), quiet = _mm512_set1_epi32(0x40);
    const __m512i key = _mm512_set1_epi32((int)key_w), sixteen = _mm512_set1_epi32(16);
    /* index_lo of lanes i..i+15, kept in 32-bit lanes as the scalar loop's wraps */
    __m512i idx = _mm512_add_epi32(_mm512_set1_epi32((int)(base + (uint32_t)lo)),
                                   _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11,
                                                     12, 13, 14, 15));
    __m512i mmax = _mm512_setzero_si512(), vmax = _mm512_setzero_si512();
    int64_t i = lo;
    for (; i + 16 <= hi; i += 16) {
        __m512 g = load_bf16x16(gp + i), w = load_bf16x16(pp + i);
        __m512 m = decode_m16(qm + i, fm256), v = decode_v16(qv + i, fv256);
        if (scaled)
            g = _mm512_mul_ps(_mm512_mul_ps(g, inv_scale), clip);
        /* adam.h's ampc_adam_element_as for AdamW, beta1 > 0.5, not maximizing */
        w = _mm512_mul_ps(w, decay);
        m = _mm512_fmadd_ps(w1, _mm512_sub_ps(g, m), m);
        v = _mm512_fmadd_ps(_mm512_mul_ps(w2, g), g, _mm512_mul_ps(v, beta2));
        __m512 s = _mm512_sqrt_ps(v);
        __m512 d = _mm512_add_ps(_mm512_div_ps(s, bc2), eps);
        w = _mm512_add_ps(w, _mm512_div_ps(_mm512_mul_ps(nss, m), d));
        /* cast.h's ampc_f32_to_bf16_sr with ampc_random_bits_keyed(key_w, index_lo); a NaN
         * keeps its top half with the quiet bit set */
        __m512i u = _mm512_castps_si512(w);
        __m512i h = mix32_16(_mm512_xor_si512(idx, key));
        _mm512_storeu_si512(rb + i, h);
        __m512i b = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_srli_epi32(h, 16)), 16);
        __mmask16 nan = _mm512_cmp_ps_mask(w, w, _CMP_UNORD_Q);
        b = _mm512_mask_or_epi32(b, nan, _mm512_srli_epi32(u, 16), quiet);
        _mm256_storeu_si256((__m256i *)(pp + i), _mm512_cvtepi32_epi16(b));
        _mm512_storeu_ps(mb + i, m);
        _mm512_storeu_ps(sb + i, s);
        mmax = _mm512_max_epu32(mmax, _mm512_and_si512(_mm512_castps_si512(m), abs_mask));
        vmax = _mm512_max_epu32(vmax, _mm512_and_si512(_mm512_castps_si512(v), abs_mask));
        idx = _mm512_add_epi32(idx, sixteen);
    }
    uint32_t a = _mm512_reduce_max_epu32(mmax), e = _mm512_reduce_max_epu32(vmax);
    *mx = a > *mx ? a : *mx;
    *vx = e > *vx ? e : *vx;
    return i;
}

/* A block's codes of both moments, 16 at a time: lean.h's ampc_q8m_code_by and
 * ampc_q8v_code_by with the block's factors fm and fv (ampc_q8_code_factor, not 0) and
 * v's random bits rb, narrowed to bytes in registers. Returns where it stopped. */
AVX512 INLINE int64_t lean_encode_both(uint8_t *qm, uint8_t *qv, const float *mb,
                                       const float *sb, const uint32_t *rb, int64_t n,
                                       float fm, float fv)
{
    const __m512 m_factor = _mm512_set1_ps(fm), v_factor = _mm512_set1_ps(fv);
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m512i cm = q8m_code16(_mm512_loadu_ps(mb + i), m_factor);
        __m512 av = _mm512_mul_ps(_mm512_loadu_ps(sb + i), v_factor);
        __m512i cv = e4m4_sr_code16(av, _mm512_loadu_si512(rb + i));
        _mm_storeu_si128((__m128i *)(qm + i), _mm512_cvtepi32_epi8(cm));
        _mm_storeu_si128((__m128i *)(qv + i), _mm512_cvtepi32_epi8(cv));
    }
    return i;
}

#define LEAN_STEP_PRESET lean_step_preset
#define LEAN_ENCODE_BOTH lean_encode_both
#define LEAN_CHUNK ampc_lean_chunk_avx512
#include "lean_loops.h"
