/*
 * fp8_scaling.c: the delayed-scaling update of n fp8 tensors on the CPU; the rule lives in
 * fp8_scaling.h. Column j of the [H, n] history belongs to tensor j.
 */
#include "ampc.h"
#include "fp8_scaling.h"

ampc_status ampc_fp8_update_scales_cpu(float *amax_history, float *scale, float *scale_inv,
                                       const float *amax,
                                       const struct ampc_fp8_scaling_args *args)
{
    for (int64_t j = 0; j < args->count; j++)
        ampc_fp8_update_scale(amax_history + j, args->rows, args->count, amax[j], scale + j,
                              scale_inv + j, args->scaled_max, args->most_recent);
    return AMPC_OK;
}
