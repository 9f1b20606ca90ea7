/*
 * cast.h: the per-element math of cast, shared by the CPU loops (cast.c) and the CUDA
 * kernel (cuda/cast.cu), and by Adam, which writes 16-bit params the same way.
 *
 * An element goes through fp32, which holds fp16 and bf16 exactly, and is rounded once:
 * to nearest even (dtype.h, bit-identical to Tensor.to()) or stochastically (Note
 * [stochastic rounding] in ampc.h) with the random bits defined here. The CPU's SIMD
 * loops compute the same bits lane by lane; tests/test_stochastic_bits.py checks them
 * against an independent transcription of these functions.
 */
#ifndef AMPC_CAST_H
#define AMPC_CAST_H

#include "dtype.h"

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
 * (at most 13 bits fall below an fp16 ulp there), a hair high for tinier ones.
 * The result is still an fp32 value, exact in fp16 (or 65536, which is inf there), so the
 * store that follows only packs it; written without branches so that a CPU loop over it
 * vectorizes. For |f| of fp32 exponent e the fp16 ulp is 2^(max(e, 113) - 137) (113 is
 * fp16's smallest normal exponent, 2^-14), lo = trunc(|f| / ulp) * ulp (|f| / ulp < 2^11,
 * so an int32 truncates it), every step exact in fp32. inf and nan pass through. */
AMPC_HD float ampc_f16_sr_value(float f, uint32_t rnd)
{
    uint32_t u = ampc_f32_bits(f);
    uint32_t a = u & 0x7fffffffu;
    uint32_t e = a >> 23 < 113 ? 113 : a >> 23;
    float ulp = ampc_bits_f32((e - 10) << 23);
    float inv_ulp = ampc_bits_f32((264 - e) << 23);
    float x = ampc_bits_f32(a);
    float lo = (float)(int32_t)(x * inv_ulp) * ulp;
    float u01 = (float)(rnd >> 8) * 5.9604644775390625e-8f;
    float r = (x - lo) > u01 * ulp ? lo + ulp : lo;
    r = a >= 0x7f800000u ? x : r;
    return ampc_bits_f32(ampc_f32_bits(r) | (u & 0x80000000u));
}

AMPC_HD uint16_t ampc_f32_to_f16_sr(float f, uint32_t rnd)
{
    return ampc_f32_to_f16(ampc_f16_sr_value(f, rnd));
}

/* The raw bits of f rounded to dtype dt (fp32 kept as is): to nearest even, or with
 * `stochastic` by the random bits of list element k. */
AMPC_HD uint32_t ampc_round_bits(float f, ampc_dtype dt, int stochastic, uint64_t seed,
                                 uint64_t k)
{
    if (dt == AMPC_F32)
        return ampc_f32_bits(f);
    if (!stochastic)
        return dt == AMPC_F16 ? ampc_f32_to_f16(f) : ampc_f32_to_bf16(f);
    uint32_t rnd = ampc_random_bits(seed, k);
    return dt == AMPC_F16 ? ampc_f32_to_f16_sr(f, rnd) : ampc_f32_to_bf16_sr(f, rnd);
}

#endif /* AMPC_CAST_H */
