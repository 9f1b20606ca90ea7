/*
 * dtype.h: per-element conversions between fp32, fp16 and bf16, shared by the CPU
 * and the CUDA code (AMPC_HD marks them __host__ __device__ under nvcc).
 *
 * Down-conversions round to nearest, ties to even (IEEE 754 default), so the results
 * are bit-identical to torch's Tensor.to() for every non-NaN input; a NaN stays a NaN
 * (its payload bits may differ from torch's, which itself differs between its scalar
 * and vector paths). fp16 overflow goes to inf, fp16 subnormals are produced exactly.
 * Up-conversions are exact.
 *
 * Stochastic rounding follows Note [stochastic rounding] in ampc.h.
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

/* Bytes per element: fp32 is stored as float, fp16 and bf16 as uint16_t. */
AMPC_HD int64_t ampc_dtype_size(ampc_dtype dtype)
{
    return dtype == AMPC_F32 ? 4 : 2;
}

#define AMPC_EXP_BITS 0x7f800000u

/* True for inf and nan: all exponent bits set. */
AMPC_HD int ampc_non_finite(float f)
{
    return (ampc_f32_bits(f) & AMPC_EXP_BITS) == AMPC_EXP_BITS;
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

// ---- stochastic rounding ----

/* A 32-bit integer mixer (good avalanche, cheap, vectorizes). */
AMPC_HD uint32_t ampc_mix32(uint32_t x)
{
    x ^= x >> 16;
    x *= 0x7feb352du;
    x ^= x >> 15;
    x *= 0x846ca68bu;
    x ^= x >> 16;
    return x;
}

/* The random bits for element `index` of a list, see Note [stochastic rounding], in two
 * steps: a key from the seed and the index's high half, then 32-bit work per element
 * (so a loop over consecutive indices vectorizes). */
AMPC_HD uint32_t ampc_random_key(uint64_t seed, uint32_t index_hi)
{
    uint32_t key = ampc_mix32((uint32_t)(seed >> 32) ^ ampc_mix32(index_hi));
    return ampc_mix32(key ^ (uint32_t)seed);
}

AMPC_HD uint32_t ampc_random_bits_keyed(uint32_t key, uint32_t index_lo)
{
    return ampc_mix32(index_lo ^ key);
}

AMPC_HD uint32_t ampc_random_bits(uint64_t seed, uint64_t index)
{
    return ampc_random_bits_keyed(ampc_random_key(seed, (uint32_t)(index >> 32)),
                                  (uint32_t)index);
}

/* Note [random bits that advance on the device]: a seed passed by value is frozen into a
 * captured CUDA graph, so every replay would draw the same bits. The ops mix in a value
 * that the device advances instead: Adam the step count it is taking (stored + 1, as
 * fp32, which it already reads for the bias corrections), cast an optional int64 seed
 * tensor read at run time. The step's seed is seed + bits(step) * the golden-ratio odd
 * constant (mod 2^64): distinct steps give distinct seeds. */
#define AMPC_SEED_STRIDE 0x9E3779B97F4A7C15ull

AMPC_HD uint64_t ampc_step_seed(uint64_t seed, float step)
{
    return seed + (uint64_t)ampc_f32_bits(step) * AMPC_SEED_STRIDE;
}

/* bf16 keeps the top 16 bits: adding 16 random bits below them carries into the kept
 * part with probability (dropped bits) / 2^16, which is the distance ratio. */
AMPC_HD uint16_t ampc_f32_to_bf16_sr(float f, uint32_t rnd)
{
    uint32_t u = ampc_f32_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u)
        return (uint16_t)((u >> 16) | 0x40);
    return (uint16_t)((u + (rnd >> 16)) >> 16);
}

/* fp16: take the neighbour toward zero (lo) and the next one away (lo + 1 ulp), and go
 * away when the distance past lo exceeds u * ulp, u = 24 random bits / 2^24 in [0, 1).
 * Both sides of the comparison are exact in fp32, so the probability is distance / ulp
 * rounded up to a multiple of 2^-24: exact for fp32 inputs of magnitude 2^-14 and up
 * (at most 13 bits fall below an fp16 ulp there), a hair high for tinier ones. */
AMPC_HD uint16_t ampc_f32_to_f16_sr(float f, uint32_t rnd)
{
    uint32_t u = ampc_f32_bits(f);
    uint16_t sign = (uint16_t)((u >> 16) & 0x8000);
    float a = ampc_bits_f32(u & 0x7fffffffu);
    if (!(a < ampc_bits_f32(0x7f800000u)))  /* inf or nan: as round to nearest */
        return ampc_f32_to_f16(f);
    uint16_t lo = (uint16_t)(ampc_f32_to_f16(a) & 0x7fff);
    if (ampc_f16_to_f32(lo) > a)            /* rounded up: step back toward zero */
        lo = (uint16_t)(lo - 1);
    float lo_f = ampc_f16_to_f32(lo);
    /* the step past 65504 is 32 (to 65536, which is inf in fp16) */
    float ulp = lo == 0x7bff ? 32.0f : ampc_f16_to_f32((uint16_t)(lo + 1)) - lo_f;
    float u01 = (float)(rnd >> 8) * 5.9604644775390625e-8f;  /* 24 random bits / 2^24 */
    uint16_t away = (a - lo_f) > u01 * ulp;
    return (uint16_t)(sign | (uint16_t)(lo + away));
}

#endif /* AMPC_DTYPE_H */
