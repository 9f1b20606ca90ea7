/*
 * dtype.h: per-element conversions between fp32, fp16 and bf16, shared by the CPU
 * and the CUDA code (AMPC_HD marks them __host__ __device__ under nvcc).
 *
 * Down-conversions round to nearest, ties to even (IEEE 754 default), so the results
 * are bit-identical to torch's Tensor.to() for every non-NaN input; a NaN stays a NaN
 * (its payload bits may differ from torch's, which itself differs between its scalar
 * and vector paths). fp16 overflow goes to inf, fp16 subnormals are produced exactly.
 * Up-conversions are exact. Also here: the size of an element and the non-finite test,
 * the one definition of each for C and CUDA, and reading or writing element i of a
 * float tensor of any of the three dtypes. Stochastic rounding is cast's (cast.h).
 */
#ifndef AMPC_DTYPE_H
#define AMPC_DTYPE_H

#include <stdint.h>
#include <string.h>

#include "ampc.h"       // defines: ampc_dtype

#ifdef __CUDACC__
#define AMPC_HD __host__ __device__ __forceinline__
#else
#define AMPC_HD static inline __attribute__((always_inline))
#endif

AMPC_HD uint32_t ampc_f32_bits(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof(u));
    return u;
}

AMPC_HD float ampc_bits_f32(uint32_t u)
{
    float f;
    memcpy(&f, &u, sizeof(f));
    return f;
}

/* Bytes per element: fp32 is stored as float, fp16 and bf16 as uint16_t, fp8 as uint8_t. */
AMPC_HD int64_t ampc_dtype_size(ampc_dtype dtype)
{
    return dtype == AMPC_F32 ? 4 : dtype <= AMPC_BF16 ? 2 : 1;
}

#define AMPC_EXP_BITS 0x7f800000u

/* True for inf and nan: all exponent bits set. */
AMPC_HD int ampc_non_finite(float f)
{
    return (ampc_f32_bits(f) & AMPC_EXP_BITS) == AMPC_EXP_BITS;
}

/*
 * Note [amax as bits]: with the sign bit cleared, the order of fp32 bit patterns read as
 * unsigned integers is the order of the values, and every NaN pattern lies above inf. So
 * max |x| is an integer max of the patterns: exact, independent of the order of the
 * reduction (and it vectorizes), and a NaN anywhere makes the result a NaN without a
 * compare that a NaN would fail.
 */
AMPC_HD uint32_t ampc_abs_bits(float x)
{
    return ampc_f32_bits(x) & 0x7fffffffu;
}

// ---- up-conversions (exact) ----

AMPC_HD float ampc_bf16_to_f32(uint16_t h)
{
    return ampc_bits_f32((uint32_t)h << 16);
}

AMPC_HD float ampc_f16_to_f32(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000) << 16;
    uint32_t exp = (h >> 10) & 0x1f;
    uint32_t man = h & 0x3ff;
    if (exp == 0x1f)                        /* inf or nan: widen the payload */
        return ampc_bits_f32(sign | 0x7f800000u | (man << 13));
    if (exp == 0) {                         /* zero or subnormal: man * 2^-24, exact */
        float f = (float)man * 5.9604644775390625e-8f;
        return sign ? -f : f;
    }
    return ampc_bits_f32(sign | ((exp + 112) << 23) | (man << 13));
}

// ---- down-conversions, round to nearest even ----

AMPC_HD uint16_t ampc_f32_to_bf16(float f)
{
    uint32_t u = ampc_f32_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u)    /* nan: keep it a quiet nan */
        return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1);         /* ties go to the even neighbour */
    return (uint16_t)(u >> 16);
}

AMPC_HD uint16_t ampc_f32_to_f16(float f)
{
    uint32_t u = ampc_f32_bits(f);
    uint16_t sign = (uint16_t)((u >> 16) & 0x8000);
    uint32_t a = u & 0x7fffffffu;
    if (a > 0x7f800000u)                    /* nan */
        return (uint16_t)(sign | 0x7e00 | ((a >> 13) & 0x3ff));
    if (a >= 0x477ff000u)                   /* rounds past 65504: inf */
        return (uint16_t)(sign | 0x7c00);
    if (a < 0x38800000u) {                  /* below 2^-14: subnormal or zero */
        /* Adding 0.5 moves the value's bits to where fp32 rounding (to nearest even)
         * leaves exactly the fp16 subnormal mantissa in the low bits. */
        float r = ampc_bits_f32(a) + 0.5f;
        return (uint16_t)(sign | (uint16_t)(ampc_f32_bits(r) - 0x3f000000u));
    }
    uint32_t odd = (a >> 13) & 1;
    a += 0xc8000fffu + odd;                 /* rebias exponent (-112 << 23) and round */
    return (uint16_t)(sign | (uint16_t)(a >> 13));
}

// ---- element i of a tensor of dtype t, widened or rounded to nearest ----

AMPC_HD float ampc_load(const void *p, ampc_dtype t, int64_t i)
{
    if (t == AMPC_F32)
        return ((const float *)p)[i];
    uint16_t h = ((const uint16_t *)p)[i];
    return t == AMPC_F16 ? ampc_f16_to_f32(h) : ampc_bf16_to_f32(h);
}

AMPC_HD void ampc_store(void *p, ampc_dtype t, int64_t i, float f)
{
    if (t == AMPC_F32)
        ((float *)p)[i] = f;
    else
        ((uint16_t *)p)[i] = t == AMPC_F16 ? ampc_f32_to_f16(f) : ampc_f32_to_bf16(f);
}

#endif /* AMPC_DTYPE_H */
