/*
 * fp8_scaling.h: one step of delayed scaling for one fp8 tensor, shared by the CPU
 * (fp8_scaling.c) and the CUDA kernel (cuda/fp8_scaling.cu), so both give the same bits.
 *
 * The rules are TransformerEngine's delayed-scaling update as its PyTorch recipe runs it
 * (the bulk amax-and-scale kernel of transformer_engine/common/recipe/delayed_scaling.cu),
 * restated for a history whose row 0 is the newest amax:
 *  1. a = this step's amax. When a == 0 (the tensor saw no data, or only zeros) the
 *     history is left as it is, and the scale is kept (rule 4).
 *  2. Otherwise the history rolls by one: the oldest row is dropped, rows move down one,
 *     a becomes row 0. A NaN or inf a is stored like any other value.
 *  3. The amax used: "max" takes the largest of the H rows by `v > m` from m = 0, so NaN
 *     rows are skipped (TE folds with fmaxf from 0); "most_recent" takes a (a NaN stays NaN).
 *     After rule 1, "max" uses 0.
 *  4. scale = scaled_max / amax in fp32 when amax is finite and > 0, where scaled_max =
 *     fmax * 2^-margin rounded to fp32 once (TE multiplies fmax by pow(2, -margin) in
 *     fp32). Otherwise (0, negative, inf, NaN) the scale is kept.
 *  5. A scale that is inf (a tiny amax overflows the quotient, or a kept inf) becomes
 *     FLT_MAX.
 *  6. scale_inv = 1 / scale in fp32, written every step (also when the scale is kept).
 * H == 1 with "most_recent" is current scaling: the scale of this step's amax.
 */
#ifndef AMPC_FP8_SCALING_H
#define AMPC_FP8_SCALING_H

#include "dtype.h"

#define AMPC_FLT_MAX 3.40282346638528859812e+38f

/* history: column of one tensor in the [H, n] history, rows `stride` floats apart. */
AMPC_HD void ampc_fp8_update_scale(float *history, int64_t rows, int64_t stride, float amax,
                                   float *scale, float *scale_inv, float scaled_max,
                                   int most_recent)
{
    float used = 0.0f;
    if (amax != 0.0f) {
        for (int64_t k = rows - 1; k > 0; k--)
            history[k * stride] = history[(k - 1) * stride];
        history[0] = amax;
        for (int64_t k = 0; k < rows; k++) {
            float v = history[k * stride];
            used = v > used ? v : used;
        }
    }
    if (most_recent)
        used = amax;
    float s = *scale;
    if (used > 0.0f && used < ampc_bits_f32(AMPC_EXP_BITS))     /* finite and positive */
        s = scaled_max / used;
    if (s == ampc_bits_f32(AMPC_EXP_BITS) || s == -ampc_bits_f32(AMPC_EXP_BITS))
        s = AMPC_FLT_MAX;
    *scale = s;
    *scale_inv = 1.0f / s;
}

#endif /* AMPC_FP8_SCALING_H */
