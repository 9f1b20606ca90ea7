/*
 * codes_avx512.h: lean.h's 8-bit codes (Note [8-bit moments]) 16 lanes at a time, for the
 * files compiled for AVX-512 (the lean step's loops, lean_avx512.c, and the 8-bit saved
 * activations', q8_avx512.c): included after their `#pragma GCC target`. Every operation
 * is lean.h's, in its order, so the bits are the scalar code's.
 */
#ifndef AMPC_CODES_AVX512_H
#define AMPC_CODES_AVX512_H

#include "lean.h"
#include "simd.h"

/* lean.h's ampc_q8_e4m3 on 16 magnitudes a. */
AVX512 INLINE __m512i e4m3_code16(__m512 a)
{
    __m512i u = _mm512_castps_si512(a);
    __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 20), _mm512_set1_epi32(1));
    __m512i bias = _mm512_set1_epi32((int)(0x7ffffu - (120u << 23)));
    __m512i normal = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, bias), odd), 20);
    __m512i sub = _mm512_sub_epi32(_mm512_castps_si512(_mm512_add_ps(a, _mm512_set1_ps(16384.0f))),
                                   _mm512_set1_epi32(0x46800000));      /* bits of 2^14 */
    __mmask16 small = _mm512_cmp_ps_mask(a, _mm512_set1_ps(0.015625f), _CMP_LT_OQ);
    return _mm512_mask_mov_epi32(normal, small, sub);
}

/* lean.h's ampc_q8_e4m4_sr on 16 magnitudes a with their random bits r, code 1 at least
 * for a nonzero a: a is +0 or positive (a sqrt of a sum of squares, never -0 or nan in a
 * block of finite absmax), so min(bits, 1) is a > 0. */
AVX512 INLINE __m512i e4m4_sr_code16(__m512 a, __m512i r)
{
    const __m512 two_m6 = _mm512_set1_ps(0.015625f);
    __m512i u = _mm512_castps_si512(a);
    /* bits(a) - (120 << 23), or below 2^-6 bits(a + 2^-6) - (121 << 23) */
    __m512i x = _mm512_sub_epi32(u, _mm512_set1_epi32(120 << 23));
    __mmask16 small = _mm512_cmp_ps_mask(a, two_m6, _CMP_LT_OQ);
    x = _mm512_mask_sub_epi32(x, small, _mm512_castps_si512(_mm512_add_ps(a, two_m6)),
                              _mm512_set1_epi32(121 << 23));
    /* (r & 0xffff) << 3: r's low half at the top of the 19 bits under the code */
    __m512i add = _mm512_srli_epi32(_mm512_slli_epi32(r, 16), 13);
    __m512i c = _mm512_srli_epi32(_mm512_add_epi32(x, add), 19);
    return _mm512_max_epu32(c, _mm512_min_epu32(u, _mm512_set1_epi32(1)));
}

/* lean.h's ampc_q8m_code_by on 16 values m with their block's factor (not 0): the code in a
 * 32-bit lane, its sign at bit 7. */
AVX512 INLINE __m512i q8m_code16(__m512 m, __m512 factor)
{
    __m512i c = e4m3_code16(_mm512_mul_ps(_mm512_abs_ps(m), factor));
    /* c | ((bits(m) >> 24) & 0x80): the sign at the code's top bit */
    return _mm512_ternarylogic_epi32(c, _mm512_srli_epi32(_mm512_castps_si512(m), 24),
                                     _mm512_set1_epi32(0x80), 0xf8);
}

#endif /* AMPC_CODES_AVX512_H */
