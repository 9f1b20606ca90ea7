/*
 * lean.h: the per-element lean Adam step (adam_lean), ampc_lean_element, the one both
 * the CPU loops (cpu/lean_loops.h) and the CUDA kernel (cuda/lean.cu) run, and what it
 * is made of: the 8-bit block-wise moment codes, the Kahan-compensated bf16 weight, and
 * the random streams of the bf16 moments. The Adam arithmetic itself is adam.h's,
 * unchanged. What differs between the two callers is only how a block's absmax is found
 * before its 8-bit codes are written: a loop's running max on the CPU, a reduction in
 * shared memory on CUDA.
 *
 * Note [8-bit moments]: a tensor's moments are cut into blocks of AMPC_QBLOCK elements
 * (the last one shorter); each block stores one fp32 scale, the absmax of its values, and
 * one byte a value. The byte is a small float, so the map is dynamic (relative precision
 * kept over many binades) and costs no table:
 *   - exp_avg (signed): sign bit and 7 bits of magnitude, 4 exponent bits (bias 7, no
 *     inf or nan codes) and 3 mantissa bits, subnormals below 2^-6. Magnitudes run from
 *     2^-9 to AMPC_Q8M_MAX = 480; the block's absmax maps to 480. Round to nearest even.
 *   - exp_avg_sq (unsigned) is stored as sqrt(v), 4 exponent bits (bias 7) and 4 mantissa
 *     bits, 2^-10 to AMPC_Q8V_MAX = 496; the block's largest sqrt(v) maps to 496. On the
 *     square root the 19 binades of the code cover 38 of v, and a nonzero value never
 *     rounds to code 0 (it takes code 1 instead): a small second moment can only come
 *     back larger, which shrinks its update, never blows it up (sqrt(0) + eps would).
 *     Rounded stochastically, with 16 random bits (the low half of the element's random
 *     bits under the weight's key, whose high half rounds a bf16 weight): at beta2 = 0.999
 *     a value's own change in a step is about 0.05% of sqrt(v), far under half a code step
 *     (3% or more), so to nearest a value kept its code and moved only with its block's
 *     scale; over 2,000 steps of a small GPT its ratio to fp32's v spread to 0.30-4.3
 *     (1% to 99%), where stochastic codes stay at 0.6-1.7 around a median of 1
 *     (benchmarks/bench_lean_moment_drift.py). exp_avg, which moves 1 - beta1 = 10% of
 *     its distance to the gradient a step, rounds to nearest.
 * Value = code's value * (absmax / MAX), the factor computed once per block in fp32.
 * Quantizing multiplies |x| by MAX / absmax, computed once per block in fp32: a divide by
 * the absmax for every value bound the CPU loops (the divider is their slowest unit), and
 * the product is as near |x| * MAX / absmax as the quotient times MAX was (two roundings
 * either way; about 4 codes in 10^7 differ by one step from |x| / absmax * MAX). The
 * product never passes the code's range (|x| <= absmax: at most MAX times 1 + 2^-23).
 * Under AMPC_Q8_MUL_MIN (2^-100) the absmax's reciprocal could overflow: such a block
 * divides first (|x| / absmax <= 1). A block whose absmax is not finite stores it with
 * all codes 0: every value comes back nan (0 * inf), as a nan moment would have poisoned
 * them in fp32 anyway.
 */
#ifndef AMPC_LEAN_H
#define AMPC_LEAN_H

#include <math.h>

#include "adam.h"          // includes: cast.h, dtype.h

#define AMPC_QBLOCK 256
#define AMPC_Q8M_MAX 480.0f
#define AMPC_Q8V_MAX 496.0f
#define AMPC_Q8_MUL_MIN 0x1p-100f        /* Note [8-bit moments] */

/* Kinds of moments (struct ampc_lean_args.moments). */
enum { AMPC_MOMENTS_F32 = 0, AMPC_MOMENTS_BF16 = 1, AMPC_MOMENTS_Q8 = 2 };

/* Selects are written as masks (all ones or zero) rather than ?:, so that the compiler
 * vectorizes the CPU loops for AVX2 as well as AVX-512. */
AMPC_HD uint32_t ampc_select(int cond, uint32_t yes, uint32_t no)
{
    uint32_t mask = 0u - (uint32_t)(cond != 0);
    return (yes & mask) | (no & ~mask);
}

/* The code of magnitude a in [0, 480] with 3 mantissa bits (Note [8-bit moments]).
 * Normal: a's bits rounded to 3 mantissa bits (to nearest even), exponent rebased from
 * 127 to 7 (120 << 3 taken off before the shift; a smaller a wraps, and is not selected).
 * Subnormal: a + 2^14 rounds a to a multiple of 2^-9, ulp(2^14), to nearest even, and
 * its low bits count the steps. Both are exact fp32 and integer operations. */
AMPC_HD uint32_t ampc_q8_e4m3(float a)
{
    uint32_t u = ampc_f32_bits(a);
    uint32_t normal = (u + (0x7ffffu - (120u << 23)) + ((u >> 20) & 1u)) >> 20;
    uint32_t sub = ampc_f32_bits(a + 16384.0f) - 0x46800000u;          /* bits of 2^14 */
    return ampc_select(a < 0.015625f, sub, normal);
}

/* The code of magnitude a in [0, 496] with 4 mantissa bits, rounded stochastically:
 * up with probability (a's distance past the code below) / (the code's step), to 16 bits
 * (rnd's low half; Note [8-bit moments]); code 1 at least when a > 0. Normal (a >= 2^-6):
 * the 19 bits under the 4 kept, plus rnd's 16 bits shifted to their top, carry into the
 * code; exponent rebased from 127 to 7. Subnormal: a + 2^-6 (an fp32 sum, a rounded to a
 * multiple of 2^-29) holds a * 2^10 in the same 4 + 19 bit positions, under 2^-6's
 * exponent, which is code 16's (so its exponent is taken one lower): 2^-10 steps. */
AMPC_HD uint32_t ampc_q8_e4m4_sr(float a, uint32_t rnd)
{
    uint32_t sub = ampc_f32_bits(a + 0.015625f) - (1u << 23);
    uint32_t x = ampc_select(a < 0.015625f, sub, ampc_f32_bits(a));
    uint32_t c = (x - (120u << 23) + ((rnd & 0xffffu) << 3)) >> 19;
    uint32_t least = (uint32_t)(a > 0.0f);
    return c > least ? c : least;
}

/* A code's value; c < 8 (16) is subnormal, c * 2^-9 (2^-10), exact. c is compared as a
 * signed int: AVX2 has a signed compare, not an unsigned one. */
AMPC_HD float ampc_q8_e4m3_value(uint32_t c)   /* c: 7 bits */
{
    float sub = (float)(int32_t)c * 0.001953125f;
    uint32_t normal = (c + (120u << 3)) << 20;
    return ampc_bits_f32(ampc_select((int32_t)c < 8, ampc_f32_bits(sub), normal));
}

AMPC_HD float ampc_q8_e4m4_value(uint32_t c)   /* c: 8 bits */
{
    float sub = (float)(int32_t)c * 0.0009765625f;
    uint32_t normal = (c + (120u << 4)) << 19;
    return ampc_bits_f32(ampc_select((int32_t)c < 16, ampc_f32_bits(sub), normal));
}

/* The factor that turns a code's value back into the moment's value. */
AMPC_HD float ampc_q8m_factor(float absmax)
{
    return absmax / AMPC_Q8M_MAX;
}

AMPC_HD float ampc_q8v_factor(float absmax)
{
    return absmax / AMPC_Q8V_MAX;
}

/* exp_avg's code for m in a block of absmax `absmax` (finite and > 0, >= |m|: a block
 * whose absmax is 0 or not finite stores code 0 everywhere, ampc_q8_codes_zero), in a
 * 32-bit lane: a CPU loop that narrowed it to a byte at once would do all its arithmetic
 * in bytes, with a pack for every step. */
AMPC_HD uint32_t ampc_q8m_code_of(float m, float a)     /* a: m's magnitude in code units */
{
    return ((ampc_f32_bits(m) >> 31) << 7) | ampc_q8_e4m3(a);
}

/* A block's factor, most / absmax, where its codes multiply; 0 where they divide (an absmax
 * under AMPC_Q8_MUL_MIN, not finite or 0): a loop over a block takes it once, so that no
 * divide stands beside the multiply. */
AMPC_HD float ampc_q8_code_factor(float most, float absmax)
{
    return absmax >= AMPC_Q8_MUL_MIN && !ampc_non_finite(absmax) ? most / absmax : 0.0f;
}

/* The code of m with its block's factor given (ampc_q8_code_factor, not 0). */
AMPC_HD uint32_t ampc_q8m_code_by(float m, float factor)
{
    return ampc_q8m_code_of(m, fabsf(m) * factor);
}

AMPC_HD uint32_t ampc_q8m_code(float m, float absmax)
{
    float f = ampc_q8_code_factor(AMPC_Q8M_MAX, absmax);
    return f != 0.0f ? ampc_q8m_code_by(m, f)
                     : ampc_q8m_code_of(m, fabsf(m) / absmax * AMPC_Q8M_MAX);
}

AMPC_HD uint8_t ampc_q8m_encode(float m, float absmax)
{
    return (uint8_t)ampc_q8m_code(m, absmax);
}

AMPC_HD float ampc_q8m_decode(uint8_t c, float factor)
{
    float a = ampc_q8_e4m3_value(c & 0x7fu) * factor;
    return ampc_bits_f32(ampc_f32_bits(a) | ((uint32_t)(c & 0x80u) << 24));    /* -a */
}

/* exp_avg_sq's code for s = sqrt(v) in a block whose largest sqrt(v) is `absmax`, rounded
 * with the element's random bits rnd. */
AMPC_HD uint32_t ampc_q8v_code_by(float s, float factor, uint32_t rnd)   /* factor: not 0 */
{
    return ampc_q8_e4m4_sr(s * factor, rnd);
}

AMPC_HD uint32_t ampc_q8v_code(float s, float absmax, uint32_t rnd)
{
    float f = ampc_q8_code_factor(AMPC_Q8V_MAX, absmax);
    return f != 0.0f ? ampc_q8v_code_by(s, f, rnd)
                     : ampc_q8_e4m4_sr(s / absmax * AMPC_Q8V_MAX, rnd);
}

AMPC_HD uint8_t ampc_q8v_encode(float s, float absmax, uint32_t rnd)
{
    return (uint8_t)ampc_q8v_code(s, absmax, rnd);
}

/* Whether a block of this absmax stores code 0 everywhere (0, inf or nan). */
AMPC_HD int ampc_q8_codes_zero(float absmax)
{
    return !(absmax > 0.0f) || ampc_non_finite(absmax);
}

AMPC_HD float ampc_q8v_decode(uint8_t c, float factor)
{
    float s = ampc_q8_e4m4_value(c) * factor;
    return s * s;
}

/* Note [Kahan-compensated bf16 weights]: without an fp32 master, the weight is the pair
 * (p, c) of bf16 values, worth p + c. The step updates w = p + c in fp32 (adam.h), then
 * stores p = bf16(w) and c = bf16(w - p), both to nearest even: w - p is exact in fp32,
 * so the pair holds w to about 16 bits, and updates too small for p's ulp accumulate in c
 * until they move p. */
AMPC_HD float ampc_kahan_weight(uint16_t p, uint16_t c)
{
    return ampc_bf16_to_f32(p) + ampc_bf16_to_f32(c);
}

AMPC_HD void ampc_kahan_store(float w, uint16_t *p, uint16_t *c)
{
    uint16_t hi = ampc_f32_to_bf16(w);
    float rest = w - ampc_bf16_to_f32(hi);
    /* an inf or nan weight (or one past bf16's range): rest is not finite; keep the
     * compensation 0 so the pair is worth what p is */
    *p = hi;
    *c = ampc_non_finite(ampc_bf16_to_f32(hi)) ? (uint16_t)0 : ampc_f32_to_bf16(rest);
}

/* The random streams of bf16 moments (stochastic rounding, Note [stochastic rounding]):
 * the weight's seed for the step, with these constants mixed in, so the three streams of
 * one element are independent. Round to nearest would stall v: beta2 * v rounds back to v
 * when 1 - beta2 is under half a bf16 ulp (2^-9), as it is for beta2 = 0.999. */
#define AMPC_SEED_EXP_AVG 0x243F6A8885A308D3ull
#define AMPC_SEED_EXP_AVG_SQ 0x13198A2E03707344ull

/* How the weight is kept: where the step reads it and writes it back. */
enum {
    AMPC_WEIGHT_PARAM,      /* the param itself (fp32, or 16-bit without a master) */
    AMPC_WEIGHT_MASTER,     /* the fp32 master; the param is written from it */
    AMPC_WEIGHT_KAHAN,      /* the bf16 param plus its bf16 compensation */
};

/* How a 16-bit param is written from the fp32 weight (AMPC_WEIGHT_PARAM, _MASTER). */
enum {
    AMPC_WRITE_NEAREST,
    AMPC_WRITE_SR,          /* stochastic rounding, element by element */
    AMPC_WRITE_LATER,       /* left to the caller (the CPU rounds fp16 in cast.c's loop) */
};

/* One tensor's lean state from the element the caller counts from (the CPU: a block's
 * first; CUDA: the tensor's first); NULL where the layout keeps none. */
struct ampc_lean_at {
    void *param;
    const void *grad;
    float *master;
    uint16_t *comp;
    void *m;                /* exp_avg: fp32, bf16 or 8-bit codes */
    void *v;                /* exp_avg_sq */
};

/* The keys of an element's random streams (Note [stochastic rounding]) for the high half
 * of its list-wide index: the weight's, then the bf16 moments'. */
struct ampc_lean_keys {
    uint32_t w, m, v;
};

AMPC_HD struct ampc_lean_keys ampc_lean_keys(uint64_t seed, uint32_t index_hi)
{
    struct ampc_lean_keys k;
    k.w = ampc_random_key(seed, index_hi);
    k.m = ampc_random_key(seed ^ AMPC_SEED_EXP_AVG, index_hi);
    k.v = ampc_random_key(seed ^ AMPC_SEED_EXP_AVG_SQ, index_hi);
    return k;
}

/* Element i's lean step: reads the weight (master, param or Kahan pair) and the moments
 * (8-bit ones through their block's factors fm, fv), takes adam.h's step, writes the
 * weight (to nearest, stochastically or as the Kahan pair) and fp32 or bf16 moments.
 * 8-bit moments wait for their block's new absmax: the new m and v are left in *m_out
 * and *v_out for the caller to code; the new weight in *w_out (AMPC_WRITE_LATER).
 * index_lo is the low half of the element's list-wide index. The kinds are arguments, so
 * that a caller that knows them at compile time gets a loop with no test in it. */
AMPC_HD void ampc_lean_element(const struct ampc_lean_at *a, int64_t i, uint32_t index_lo,
                               const struct ampc_lean_keys *k,
                               const struct ampc_adam_coef *c, const int flags,
                               const int small_w1, const int moments, const int weight,
                               const int write, const ampc_dtype pt, const ampc_dtype gt,
                               float fm, float fv, float *m_out, float *v_out, float *w_out)
{
    uint16_t *const p16 = (uint16_t *)a->param;
    float w, m, v;
    if (weight == AMPC_WEIGHT_MASTER)
        w = a->master[i];
    else if (weight == AMPC_WEIGHT_KAHAN)
        w = ampc_kahan_weight(p16[i], a->comp[i]);
    else
        w = ampc_load(a->param, pt, i);
    if (moments == AMPC_MOMENTS_Q8) {
        m = ampc_q8m_decode(((const uint8_t *)a->m)[i], fm);
        v = ampc_q8v_decode(((const uint8_t *)a->v)[i], fv);
    } else if (moments == AMPC_MOMENTS_BF16) {
        m = ampc_bf16_to_f32(((const uint16_t *)a->m)[i]);
        v = ampc_bf16_to_f32(((const uint16_t *)a->v)[i]);
    } else {
        m = ((const float *)a->m)[i];
        v = ((const float *)a->v)[i];
    }
    ampc_adam_element_as(ampc_load(a->grad, gt, i), &w, &m, &v, NULL, c, flags, small_w1);
    if (moments == AMPC_MOMENTS_BF16) {
        ((uint16_t *)a->m)[i] = ampc_f32_to_bf16_sr(m, ampc_random_bits_keyed(k->m, index_lo));
        ((uint16_t *)a->v)[i] = ampc_f32_to_bf16_sr(v, ampc_random_bits_keyed(k->v, index_lo));
    } else if (moments == AMPC_MOMENTS_F32) {
        ((float *)a->m)[i] = m;
        ((float *)a->v)[i] = v;
    }
    if (weight == AMPC_WEIGHT_MASTER)
        a->master[i] = w;
    if (weight == AMPC_WEIGHT_KAHAN) {
        ampc_kahan_store(w, &p16[i], &a->comp[i]);
    } else if (pt == AMPC_F32) {
        ((float *)a->param)[i] = w;
    } else if (write == AMPC_WRITE_SR) {
        uint32_t r = ampc_random_bits_keyed(k->w, index_lo);
        p16[i] = pt == AMPC_BF16 ? ampc_f32_to_bf16_sr(w, r) : ampc_f32_to_f16_sr(w, r);
    } else if (write == AMPC_WRITE_NEAREST) {
        ampc_store(a->param, pt, i, w);
    }
    *m_out = m;
    *v_out = v;
    *w_out = w;
}

#endif /* AMPC_LEAN_H */
