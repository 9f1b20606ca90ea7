/*
 * simd.h: the building blocks of the CPU inner loops (cast.c, unscale_check.c,
 * check_norm.c, adam.c): the choice of SIMD path at run time, and loads and stores that
 * widen fp16/bf16 to fp32 and narrow back in registers, for 16 lanes (AVX-512), 8 lanes
 * (AVX2 + F16C) and one (scalar).
 *
 * fp16 uses the hardware conversions (vcvtph2ps, vcvtps2ph with round to nearest even).
 * bf16 uses integer arithmetic: the AVX-512 BF16 instruction vcvtneps2bf16 flushes
 * subnormals to zero, which Tensor.to() does not. The scalar functions of dtype.h give
 * the same bits for every non-NaN value.
 *
 * Everything here is always inlined, so a loop that takes the dtype as a constant
 * argument gets branch-free code for it.
 */
#ifndef AMPC_SIMD_H
#define AMPC_SIMD_H

#include <immintrin.h>

#include "cpu.h"
#include "dtype.h"

#define AVX512 __attribute__((target("avx512f,avx512bw")))
#define AVX2 __attribute__((target("avx2,fma,f16c")))
#define INLINE static inline __attribute__((always_inline))

enum ampc_isa { ISA_UNKNOWN, ISA_SCALAR, ISA_AVX2, ISA_AVX512 };

/* The best path the CPU has; AMPC_CPU_ISA=avx2 or =scalar caps it (cpu.c). */
enum ampc_isa ampc_cpu_isa(void);

// ---- AVX-512: 16 lanes (one element at a time: dtype.h's ampc_load, ampc_store) ----

AVX512 INLINE __m512 load16(const void *p, ampc_dtype t, int64_t i)
{
    if (t == AMPC_F32)
        return _mm512_loadu_ps((const float *)p + i);
    __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)p + i));
    if (t == AMPC_F16)
        return _mm512_cvtph_ps(h);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* bf16 round to nearest even: add 0x7fff plus the lowest kept bit, keep the top half.
 * NaNs get their quiet bit set instead, so no NaN can round into an inf. */
AVX512 INLINE __m256i bf16_from16(__m512 f)
{
    __m512i u = _mm512_castps_si512(f);
    __m512i top = _mm512_srli_epi32(u, 16);
    __m512i odd = _mm512_and_si512(top, _mm512_set1_epi32(1));
    __m512i bias = _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, bias), 16);
    __mmask16 nan = _mm512_cmp_ps_mask(f, f, _CMP_UNORD_Q);
    r = _mm512_mask_mov_epi32(r, nan, _mm512_or_si512(top, _mm512_set1_epi32(0x40)));
    return _mm512_cvtepi32_epi16(r);
}

/* Stores 16 values at element i of p. A streaming store (p 64-byte aligned) skips
 * reading the line first and keeps it out of the caches: see Note [streaming stores]. */
AVX512 INLINE void store16_to(void *p, ampc_dtype t, int64_t i, __m512 f, int stream)
{
    if (t == AMPC_F32) {
        if (stream)
            _mm512_stream_ps((float *)p + i, f);
        else
            _mm512_storeu_ps((float *)p + i, f);
        return;
    }
    __m256i h = t == AMPC_F16 ? _mm512_cvtps_ph(f, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
                              : bf16_from16(f);
    if (stream)
        _mm256_stream_si256((__m256i *)((uint16_t *)p + i), h);
    else
        _mm256_storeu_si256((__m256i *)((uint16_t *)p + i), h);
}

AVX512 INLINE void store16(void *p, ampc_dtype t, int64_t i, __m512 f)
{
    store16_to(p, t, i, f, 0);
}

AVX512 INLINE __mmask16 nonfinite16(__m512 f)
{
    __m512i e = _mm512_set1_epi32((int)AMPC_EXP_BITS);
    return _mm512_cmpeq_epi32_mask(_mm512_and_si512(_mm512_castps_si512(f), e), e);
}

// ---- AVX2 + F16C: 8 lanes ----

AVX2 INLINE __m256 load8(const void *p, ampc_dtype t, int64_t i)
{
    if (t == AMPC_F32)
        return _mm256_loadu_ps((const float *)p + i);
    __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)p + i));
    if (t == AMPC_F16)
        return _mm256_cvtph_ps(h);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

AVX2 INLINE __m128i bf16_from8(__m256 f)
{
    __m256i u = _mm256_castps_si256(f);
    __m256i top = _mm256_srli_epi32(u, 16);
    __m256i odd = _mm256_and_si256(top, _mm256_set1_epi32(1));
    __m256i bias = _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, bias), 16);
    __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(f, f, _CMP_UNORD_Q));
    r = _mm256_blendv_epi8(r, _mm256_or_si256(top, _mm256_set1_epi32(0x40)), nan);
    /* pack 8 x 32 -> 8 x 16: values are < 2^16, so unsigned saturation keeps them */
    return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}

/* As store16_to, 8 values (p 32-byte aligned for a streaming store). */
AVX2 INLINE void store8_to(void *p, ampc_dtype t, int64_t i, __m256 f, int stream)
{
    if (t == AMPC_F32) {
        if (stream)
            _mm256_stream_ps((float *)p + i, f);
        else
            _mm256_storeu_ps((float *)p + i, f);
        return;
    }
    __m128i h = t == AMPC_F16 ? _mm256_cvtps_ph(f, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
                              : bf16_from8(f);
    if (stream)
        _mm_stream_si128((__m128i *)((uint16_t *)p + i), h);
    else
        _mm_storeu_si128((__m128i *)((uint16_t *)p + i), h);
}

AVX2 INLINE void store8(void *p, ampc_dtype t, int64_t i, __m256 f)
{
    store8_to(p, t, i, f, 0);
}

AVX2 INLINE int nonfinite8(__m256 f)
{
    __m256i e = _mm256_set1_epi32((int)AMPC_EXP_BITS);
    __m256i hit = _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_castps_si256(f), e), e);
    return _mm256_movemask_epi8(hit);
}

#endif /* AMPC_SIMD_H */
