/*
 * fp8.h: the two fp8 formats and the per-element math of the fp8 casts, shared by the CPU
 * loops (fp8.c) and the CUDA kernels (cuda/fp8.cu), so both compute the same bits.
 *
 *   format   bits       bias  largest finite  smallest normal  subnormal step  NaN codes
 *   e4m3fn   s eeee mmm    7  448             2^-6             2^-9            0x7f, 0xff
 *   e5m2     s eeeee mm   15  57344           2^-14            2^-16           0x7d-0x7f (+sign)
 *
 * cast_fp8:      q = encode(clamp(x * scale, -fmax, fmax)), the sequence of torch's
 *                (x.float() * scale).clamp(-fmax, fmax).to(fp8): one fp32 multiply rounded to
 *                nearest even, a clamp that lets NaN through (so inf saturates to +-fmax and
 *                e5m2 never produces its inf), then round to nearest even into the format.
 * cast_from_fp8: y = decode(q) * scale_inv in fp32 (decode is exact), then rounded to the
 *                output dtype as Tensor.to() does (dtype.h).
 * amax:          max |x| over a tensor, kept as the bits of |x| (Note [amax as bits]).
 *
 * A NaN keeps its sign through the multiply on the CPU (x86 returns the NaN operand), so
 * -NaN encodes to 0xff as torch's CPU cast does; CUDA's multiply returns the canonical
 * +NaN, as torch's CUDA cast sees it too.
 */
#ifndef AMPC_FP8_H
#define AMPC_FP8_H

#include "dtype.h"

/* The parameters of one fp8 format, as fp32 bit patterns and shifts. */
struct ampc_fp8_format {
    uint32_t fmax;          /* largest finite value */
    uint32_t min_normal;    /* below it, the subnormal path */
    uint32_t magic;         /* 2^k whose fp32 ulp is the format's subnormal step */
    uint32_t rebias;        /* (127 - bias) << 23 */
    int shift;              /* 23 - mantissa bits */
};

#define AMPC_E4M3_FMAX 448.0f
#define AMPC_E5M2_FMAX 57344.0f

AMPC_HD struct ampc_fp8_format ampc_fp8_format_of(ampc_dtype dt)
{
    struct ampc_fp8_format e4m3 = { 0x43e00000u, 0x3c800000u, 0x46800000u, 120u << 23, 20 };
    struct ampc_fp8_format e5m2 = { 0x47600000u, 0x38800000u, 0x43000000u, 112u << 23, 21 };
    return dt == AMPC_F8E4M3 ? e4m3 : e5m2;
}

/* The value torch's clamp(-fmax, fmax) leaves: NaN passes, everything else is bounded. */
AMPC_HD float ampc_fp8_saturate(float y, float fmax)
{
    y = y > fmax ? fmax : y;
    return y < -fmax ? -fmax : y;
}

/*
 * Round-to-nearest-even encoding of y, |y| <= fmax or NaN. Branch-free, so the same
 * steps also work lane by lane:
 * - below the smallest normal, adding 2^k (k chosen so that fp32's ulp at 2^k is the
 *   subnormal step) lets the fp32 adder round to the step, ties to even; the low bits of
 *   the sum are then the code (a sum that reaches the smallest normal gives its code);
 * - otherwise the exponent is rebiased and the dropped mantissa bits are rounded with
 *   "add half an ulp minus one, plus the kept bit's parity", whose carry may run into the
 *   exponent, which is the right code too;
 * - NaN takes the normal path, whose result for any pattern above inf is above 0x7f, so
 *   capping the code at 0x7f gives 0x7f with the NaN's sign (|y| <= fmax is below 0x7f).
 */
AMPC_HD uint8_t ampc_fp8_encode(float y, struct ampc_fp8_format f)
{
    uint32_t u = ampc_f32_bits(y);
    uint32_t sign = (u >> 24) & 0x80u;
    uint32_t a = u & 0x7fffffffu;
    uint32_t sub = ampc_f32_bits(ampc_bits_f32(a) + ampc_bits_f32(f.magic)) - f.magic;
    uint32_t half = (1u << (f.shift - 1)) - 1u;
    uint32_t norm = (a - f.rebias + half + ((a >> f.shift) & 1u)) >> f.shift;
    uint32_t code = a < f.min_normal ? sub : norm;
    code = code < 0x7fu ? code : 0x7fu;
    return (uint8_t)(code | sign);
}

/* The fp32 value of code q, exactly; NaN codes give torch's NaN (quiet, the code's
 * mantissa as payload, the code's sign). */
AMPC_HD float ampc_fp8_decode(uint8_t q, ampc_dtype dt)
{
    uint32_t sign = (uint32_t)(q & 0x80u) << 24;
    uint32_t a = q & 0x7fu;
    int man_bits = dt == AMPC_F8E4M3 ? 3 : 2;
    uint32_t exp = a >> man_bits;
    uint32_t man = a & ((1u << man_bits) - 1u);
    uint32_t shift = 23u - (uint32_t)man_bits;
    int nan = dt == AMPC_F8E4M3 ? a == 0x7fu : exp == 31u && man != 0u;
    if (nan)
        return ampc_bits_f32(sign | 0x7fc00000u | (man << shift));
    if (dt == AMPC_F8E5M2 && exp == 31u)    /* e5m2's inf */
        return ampc_bits_f32(sign | 0x7f800000u);
    if (exp == 0) {                         /* zero or subnormal: man * step, exact */
        float step = dt == AMPC_F8E4M3 ? 0.001953125f : 1.52587890625e-05f;
        return ampc_bits_f32(sign | ampc_f32_bits((float)man * step));
    }
    uint32_t rebias = dt == AMPC_F8E4M3 ? 120u : 112u;
    return ampc_bits_f32(sign | ((exp + rebias) << 23) | (man << shift));
}

/* The max of ampc_abs_bits (Note [amax as bits], dtype.h) as a value; a NaN made the
 * canonical quiet NaN (0x7fc00000). */
AMPC_HD float ampc_amax_value(uint32_t bits)
{
    return ampc_bits_f32(bits > 0x7f800000u ? 0x7fc00000u : bits);
}

/*
 * Note [NaN times a NaN scale]: x * scale rounds once, and when only one operand is NaN the
 * product is that NaN on every path. When both are, x86 returns whichever the compiler
 * made the first operand; torch's CPU loops return the scale's NaN (its scalar tail of
 * tensors under one vector, x's), so on the CPU a NaN scale is the product of every
 * element, and the vector loops leave such a call to the scalar one. CUDA's multiply
 * returns its canonical NaN whatever the operands, as torch's CUDA kernels see it too.
 */
AMPC_HD float ampc_fp8_mul(float x, float scale)
{
#ifndef __CUDA_ARCH__
    if (scale != scale)
        return scale;
#endif
    return x * scale;
}

/* One element of cast_fp8. */
AMPC_HD uint8_t ampc_cast_fp8_element(float x, float scale, float fmax, struct ampc_fp8_format f)
{
    return ampc_fp8_encode(ampc_fp8_saturate(ampc_fp8_mul(x, scale), fmax), f);
}

#endif /* AMPC_FP8_H */
