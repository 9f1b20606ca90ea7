/*
 * q8_avx2.c: the codes of the 8-bit saved activations (q8.c) 16 at a time on AVX2, packed
 * to bytes in registers: left to the compiler, the codes went through a buffer of 32-bit
 * lanes and a loop of their own that packed them. The target comes before every header,
 * so that lean.h's inline math is compiled for it too.
 */
#pragma GCC target("avx2,fma,f16c")
#pragma GCC optimize("no-trapping-math")

#include "codes_avx2.h"
#include "q8_cpu.h"

int64_t ampc_q8_codes_avx2(uint8_t *q, const float *x, int64_t n, float factor)
{
    const __m256 f = _mm256_set1_ps(factor);
    /* words [a0-3 b0-3 | a4-7 b4-7], bytes likewise twice over, then a0-7 b0-7 */
    const __m256i gather = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m256i a = q8m_code8(_mm256_loadu_ps(x + i), f);
        __m256i b = q8m_code8(_mm256_loadu_ps(x + i + 8), f);
        __m256i w = _mm256_packus_epi32(a, b);
        __m256i by = _mm256_permutevar8x32_epi32(_mm256_packus_epi16(w, w), gather);
        _mm_storeu_si128((__m128i *)(q + i), _mm256_castsi256_si128(by));
    }
    return i;
}
