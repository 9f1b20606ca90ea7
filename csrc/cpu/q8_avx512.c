/*
 * q8_avx512.c: the codes of the 8-bit saved activations (q8.c) 16 at a time on AVX-512,
 * each narrowed to a byte in its register: left to the compiler, the codes went through a
 * buffer of 32-bit lanes and a loop of their own that packed them. The target comes before
 * every header, so that lean.h's inline math is compiled for it too.
 */
#pragma GCC target("avx512f,avx512bw")
#pragma GCC optimize("no-trapping-math")

#include "codes_avx512.h"
#include "q8_cpu.h"

int64_t ampc_q8_codes_avx512(uint8_t *q, const float *x, int64_t n, float factor)
{
    const __m512 f = _mm512_set1_ps(factor);
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
        _mm_storeu_si128((__m128i *)(q + i),
                         _mm512_cvtepi32_epi8(q8m_code16(_mm512_loadu_ps(x + i), f)));
    return i;
}
