/*
 * codes_avx2.h: lean.h's 8-bit codes (Note [8-bit moments]) 8 lanes at a time, for the
 * files compiled for AVX2 (the lean step's loops, lean_avx2.c, and the 8-bit saved
 * activations', q8_avx2.c): included after their `#pragma GCC target`. Every operation is
 * lean.h's, in its order, so the bits are the scalar code's.
 */
#ifndef AMPC_CODES_AVX2_H
#define AMPC_CODES_AVX2_H

#include "lean.h"
#include "simd.h"

/* lean.h's ampc_q8_e4m3 on 8 magnitudes a. */
AVX2 INLINE __m256i e4m3_code8(__m256 a)
{
    __m256i u = _mm256_castps_si256(a);
    __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 20), _mm256_set1_epi32(1));
    __m256i bias = _mm256_set1_epi32((int)(0x7ffffu - (120u << 23)));
    __m256i normal = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, bias), odd), 20);
    __m256i sub = _mm256_sub_epi32(_mm256_castps_si256(_mm256_add_ps(a, _mm256_set1_ps(16384.0f))),
                                   _mm256_set1_epi32(0x46800000));      /* bits of 2^14 */
    __m256 small = _mm256_cmp_ps(a, _mm256_set1_ps(0.015625f), _CMP_LT_OQ);
    return _mm256_blendv_epi8(normal, sub, _mm256_castps_si256(small));
}

/* lean.h's ampc_q8_e4m4_sr on 8 magnitudes a with their random bits r, code 1 at least
 * for a nonzero a: a is +0 or positive (a sqrt of a sum of squares, never -0 or nan in a
 * block of finite absmax), so min(bits, 1) is a > 0. */
AVX2 INLINE __m256i e4m4_sr_code8(__m256 a, __m256i r)
{
    const __m256 two_m6 = _mm256_set1_ps(0.015625f);
    __m256i u = _mm256_castps_si256(a);
    /* bits(a), or below 2^-6 bits(a + 2^-6) - 2^23: then less 120 << 23 */
    __m256i sub = _mm256_sub_epi32(_mm256_castps_si256(_mm256_add_ps(a, two_m6)),
                                   _mm256_set1_epi32(1 << 23));
    __m256 small = _mm256_cmp_ps(a, two_m6, _CMP_LT_OQ);
    __m256i x = _mm256_blendv_epi8(u, sub, _mm256_castps_si256(small));
    /* (r & 0xffff) << 3 - (120 << 23): r's low half at the top of the 19 bits under the code */
    __m256i add = _mm256_sub_epi32(_mm256_srli_epi32(_mm256_slli_epi32(r, 16), 13),
                                   _mm256_set1_epi32(120 << 23));
    __m256i c = _mm256_srli_epi32(_mm256_add_epi32(x, add), 19);
    return _mm256_max_epu32(c, _mm256_min_epu32(u, _mm256_set1_epi32(1)));
}

/* lean.h's ampc_q8m_code_by on 8 values m with their block's factor (not 0): the code in a
 * 32-bit lane, its sign at bit 7. */
AVX2 INLINE __m256i q8m_code8(__m256 m, __m256 factor)
{
    const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    __m256i c = e4m3_code8(_mm256_mul_ps(_mm256_and_ps(m, abs_mask), factor));
    __m256i sign = _mm256_and_si256(_mm256_srli_epi32(_mm256_castps_si256(m), 24),
                                    _mm256_set1_epi32(0x80));
    return _mm256_or_si256(c, sign);
}

#endif /* AMPC_CODES_AVX2_H */
