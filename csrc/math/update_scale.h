/*
 * update_scale.h: one step of dynamic loss scaling, shared by the CPU and the CUDA code.
 *
 * With hysteresis = 1, min_scale = 0 and max_scale = inf this is exactly torch's
 * _amp_update_scale_ (aten/src/ATen/native/cpu/AmpGradScalerKernels.cpp):
 *   non-finite step (found_inf != 0): scale *= backoff_factor, growth_tracker = 0;
 *   clean step: growth_tracker += 1, and when it reaches growth_interval:
 *               scale *= growth_factor if the result is finite, growth_tracker = 0.
 * The products are taken in double and rounded once to float, as torch does.
 *
 * Hysteresis (Megatron/apex style): a non-finite step first decrements
 * hysteresis_tracker; the scale backs off only once it reaches 0. A clean step
 * resets it to `hysteresis`. min_scale and max_scale bound the scale whenever it
 * changes (a growth that would pass max_scale lands on it, as long as that is finite
 * in fp32; a backoff below min_scale lands on min_scale).
 */
#ifndef AMPC_UPDATE_SCALE_H
#define AMPC_UPDATE_SCALE_H

#include "ampc.h"
#include "dtype.h"

AMPC_HD void ampc_update_scale_step(float *scale, int32_t *growth_tracker,
                                    int32_t *hysteresis_tracker, float found_inf,
                                    const struct ampc_scale_args *a)
{
    if (found_inf != 0.0f) {
        if (a->hysteresis > 1) {
            *hysteresis_tracker -= 1;
            if (*hysteresis_tracker > 0) {
                *growth_tracker = 0;
                return;
            }
        }
        double shrunk = (double)*scale * a->backoff_factor;
        if (a->min_scale > 0 && shrunk < a->min_scale)
            shrunk = a->min_scale;
        *scale = (float)shrunk;
        *growth_tracker = 0;
        return;
    }
    int32_t successful = *growth_tracker + 1;
    if (successful == a->growth_interval) {
        double grown = (double)*scale * a->growth_factor;
        if (grown > a->max_scale)
            grown = a->max_scale;
        float s = (float)grown;
        if (!ampc_non_finite(s))
            *scale = s;
        *growth_tracker = 0;
    } else {
        *growth_tracker = successful;
    }
    if (a->hysteresis > 1)
        *hysteresis_tracker = (int32_t)a->hysteresis;
}

#endif /* AMPC_UPDATE_SCALE_H */
