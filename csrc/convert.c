/*
 * convert.c: widen and narrow blocks of fp16/bf16 <-> fp32 with the best SIMD the
 * CPU has, picked once at run time (the build uses no -march flag).
 *
 * fp16 uses the hardware conversions (vcvtph2ps / vcvtps2ph with round to nearest
 * even). bf16 uses integer arithmetic: the AVX-512 BF16 instruction vcvtneps2bf16
 * flushes subnormals to zero, which Tensor.to() does not. Tails and old CPUs use the
 * scalar functions of dtype.h, which give the same bits for every non-NaN value.
 */
#include <immintrin.h>
#include <stdlib.h>
#include <string.h>

#include "cpu.h"
#include "dtype.h"

#define AVX512 __attribute__((target("avx512f")))
#define AVX2 __attribute__((target("avx2,f16c")))

enum isa { ISA_UNKNOWN, ISA_SCALAR, ISA_AVX2, ISA_AVX512 };

/* The best the CPU has; AMPC_CPU_ISA=avx2 or =scalar caps it, so the tests can check
 * every path on one machine. */
static enum isa cpu_isa(void)
{
    static enum isa isa = ISA_UNKNOWN;      /* benign race: every thread computes the same */
    if (isa == ISA_UNKNOWN) {
        const char *cap = getenv("AMPC_CPU_ISA");
        enum isa best = ISA_SCALAR;
        __builtin_cpu_init();
        if (__builtin_cpu_supports("avx512f"))
            best = ISA_AVX512;
        else if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c"))
            best = ISA_AVX2;
        if (cap && strcmp(cap, "scalar") == 0)
            best = ISA_SCALAR;
        else if (cap && strcmp(cap, "avx2") == 0 && best > ISA_AVX2)
            best = ISA_AVX2;
        isa = best;
    }
    return isa;
}

// ---- scalar ----

static void load_scalar(float *dst, const uint16_t *src, ampc_dtype dtype, int64_t n)
{
    for (int64_t i = 0; i < n; i++)
        dst[i] = dtype == AMPC_F16 ? ampc_f16_to_f32(src[i]) : ampc_bf16_to_f32(src[i]);
}

static void store_scalar(uint16_t *dst, ampc_dtype dtype, const float *src, int64_t n)
{
    for (int64_t i = 0; i < n; i++)
        dst[i] = dtype == AMPC_F16 ? ampc_f32_to_f16(src[i]) : ampc_f32_to_bf16(src[i]);
}

// ---- AVX-512: 16 lanes ----

AVX512 static void load_avx512(float *dst, const uint16_t *src, ampc_dtype dtype, int64_t n)
{
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m256i h = _mm256_loadu_si256((const __m256i *)(src + i));
        __m512 f = dtype == AMPC_F16
                       ? _mm512_cvtph_ps(h)
                       : _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
        _mm512_storeu_ps(dst + i, f);
    }
    load_scalar(dst + i, src + i, dtype, n - i);
}

/* bf16 round to nearest even: add 0x7fff plus the lowest kept bit, keep the top half.
 * NaNs get their quiet bit set instead, so no NaN can round into an inf. */
AVX512 static __m256i bf16_from_avx512(__m512 f)
{
    __m512i u = _mm512_castps_si512(f);
    __m512i top = _mm512_srli_epi32(u, 16);
    __m512i odd = _mm512_and_si512(top, _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff))), 16);
    __mmask16 nan = _mm512_cmp_ps_mask(f, f, _CMP_UNORD_Q);
    r = _mm512_mask_mov_epi32(r, nan, _mm512_or_si512(top, _mm512_set1_epi32(0x40)));
    return _mm512_cvtepi32_epi16(r);
}

AVX512 static void store_avx512(uint16_t *dst, ampc_dtype dtype, const float *src, int64_t n)
{
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m512 f = _mm512_loadu_ps(src + i);
        __m256i h = dtype == AMPC_F16
                        ? _mm512_cvtps_ph(f, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
                        : bf16_from_avx512(f);
        _mm256_storeu_si256((__m256i *)(dst + i), h);
    }
    store_scalar(dst + i, dtype, src + i, n - i);
}

// ---- AVX2 + F16C: 8 lanes ----

AVX2 static void load_avx2(float *dst, const uint16_t *src, ampc_dtype dtype, int64_t n)
{
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m128i h = _mm_loadu_si128((const __m128i *)(src + i));
        __m256 f = dtype == AMPC_F16
                       ? _mm256_cvtph_ps(h)
                       : _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
        _mm256_storeu_ps(dst + i, f);
    }
    load_scalar(dst + i, src + i, dtype, n - i);
}

AVX2 static __m128i bf16_from_avx2(__m256 f)
{
    __m256i u = _mm256_castps_si256(f);
    __m256i top = _mm256_srli_epi32(u, 16);
    __m256i odd = _mm256_and_si256(top, _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff))), 16);
    __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(f, f, _CMP_UNORD_Q));
    r = _mm256_blendv_epi8(r, _mm256_or_si256(top, _mm256_set1_epi32(0x40)), nan);
    /* pack 8 x 32 -> 8 x 16: values are < 2^16, so unsigned saturation keeps them */
    return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}

AVX2 static void store_avx2(uint16_t *dst, ampc_dtype dtype, const float *src, int64_t n)
{
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 f = _mm256_loadu_ps(src + i);
        __m128i h = dtype == AMPC_F16
                        ? _mm256_cvtps_ph(f, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
                        : bf16_from_avx2(f);
        _mm_storeu_si128((__m128i *)(dst + i), h);
    }
    store_scalar(dst + i, dtype, src + i, n - i);
}

// ---- dispatch ----

const float *ampc_load_block(float *buf, const void *src, ampc_dtype dtype, int64_t n)
{
    if (dtype == AMPC_F32)
        return src;
    switch (cpu_isa()) {
    case ISA_AVX512:
        load_avx512(buf, src, dtype, n);
        break;
    case ISA_AVX2:
        load_avx2(buf, src, dtype, n);
        break;
    default:
        load_scalar(buf, src, dtype, n);
    }
    return buf;
}

void ampc_store_block(void *dst, ampc_dtype dtype, const float *src, int64_t n)
{
    if (dtype == AMPC_F32) {
        if (dst != src)
            memcpy(dst, src, sizeof(float) * (size_t)n);
        return;
    }
    switch (cpu_isa()) {
    case ISA_AVX512:
        store_avx512(dst, dtype, src, n);
        break;
    case ISA_AVX2:
        store_avx2(dst, dtype, src, n);
        break;
    default:
        store_scalar(dst, dtype, src, n);
    }
}
