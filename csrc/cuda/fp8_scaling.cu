/*
 * fp8_scaling.cu: the delayed-scaling update of n fp8 tensors on the device (the twin of
 * fp8_scaling.c; the rule is fp8_scaling.h's), so a training step needs no host sync.
 *
 * Launch shape: one thread per tensor (a column of the [H, n] history); the threads of a
 * warp walk their columns row by row, so each row is read and written in one coalesced
 * access. The update of a tensor is H loads and stores: too little work to split.
 */
#include "common.cuh"
#include "fp8_scaling.h"

#define SCALING_THREADS 256

__global__ void __launch_bounds__(SCALING_THREADS)
fp8_update_scales_kernel(float *amax_history, float *scale, float *scale_inv, const float *amax,
                         const struct ampc_fp8_scaling_args args)
{
    int64_t j = (int64_t)blockIdx.x * SCALING_THREADS + threadIdx.x;
    if (j >= args.count)
        return;
    ampc_fp8_update_scale(amax_history + j, args.rows, args.count, amax[j], scale + j,
                          scale_inv + j, args.scaled_max, args.most_recent);
}

extern "C" ampc_status ampc_fp8_update_scales_cuda_impl(float *amax_history, float *scale,
                                                        float *scale_inv, const float *amax,
                                                        const struct ampc_fp8_scaling_args *args,
                                                        void *stream)
{
    if (args->count == 0)
        return AMPC_OK;
    int64_t blocks = CEIL_DIV(args->count, SCALING_THREADS);
    AMPC_LAUNCH(fp8_update_scales_kernel, (unsigned)blocks, SCALING_THREADS, 0,
                (cudaStream_t)stream)(amax_history, scale, scale_inv, amax, *args);
    return ampc_cuda_status(cudaGetLastError());
}
