/*
 * update_scale.cu: one dynamic loss-scale step on the device (the CUDA twin of
 * ampc_update_scale_cpu; the rule is ampc_update_scale_step in update_scale.h, shared
 * with the CPU).
 *
 * Launch shape: a single thread (<<<1, 1>>>), as torch's _amp_update_scale_: the state is
 * three scalars, and keeping the step on the device means found_inf never travels to the
 * host, so a training step needs no sync and can be captured in a CUDA graph.
 */
#include "common.cuh"
#include "update_scale.h"

__global__ void update_scale_kernel(float *scale, int32_t *growth_tracker,
                                    int32_t *hysteresis_tracker, const float *found_inf,
                                    struct ampc_scale_args args)
{
    ampc_update_scale_step(scale, growth_tracker, hysteresis_tracker, *found_inf, &args);
}

extern "C" ampc_status ampc_update_scale_cuda_impl(float *scale, int32_t *growth_tracker,
                                                   int32_t *hysteresis_tracker,
                                                   const float *found_inf,
                                                   const struct ampc_scale_args *args,
                                                   void *stream)
{
    AMPC_LAUNCH(update_scale_kernel, 1, 1, 0, (cudaStream_t)stream)(scale, growth_tracker,
                                                                  hysteresis_tracker, found_inf,
                                                                  *args);
    return ampc_cuda_status(cudaGetLastError());
}
