/*
 * steps.cuh: the Adam ops' step counts, shared by adam.cu and lean.cu. Every block of a
 * tensor reads its step count for the bias corrections, so no block may advance it: after
 * all the update launches of a call, a one-block launch on the same stream adds 1 to every
 * count. found_inf != 0 makes it a no-op, like the updates.
 */
#ifndef AMPC_CUDA_STEPS_CUH
#define AMPC_CUDA_STEPS_CUH

#include "common.cuh"

/* The step counts one launch advances: as many as fit the kernel parameter space P. */
template <int P>
struct adam_steps {
    float *ptr[(P - 16) / sizeof(float *) - 1];
    int32_t count;
};

__device__ __forceinline__ bool skipped(const float *found_inf)
{
    return found_inf && *found_inf != 0.0f;
}

/* One block over the step counts; runs after every update launch of the call. */
template <int P>
__global__ void adam_steps_kernel(const __grid_constant__ struct adam_steps<P> steps,
                                  const float *found_inf)
{
    if (skipped(found_inf))
        return;
    for (int i = threadIdx.x; i < steps.count; i += blockDim.x)
        *steps.ptr[i] += 1.0f;
}

/* Adds 1 to every step count of the list, as many a launch as adam_steps<P> holds. */
template <int P>
static ampc_status advance_steps(const struct ampc_list *list, const float *found_inf,
                                 cudaStream_t stream)
{
    static_assert(sizeof(struct adam_steps<P>) + sizeof(float *) <= P,
                  "adam step arguments over the kernel parameter space");
    const int max_steps = (int)(sizeof(adam_steps<P>::ptr) / sizeof(float *));
    struct adam_steps<P> steps;

    for (int64_t i = 0; i < list->count; i += max_steps) {
        int64_t left = list->count - i;
        steps.count = left < max_steps ? (int32_t)left : max_steps;
        for (int j = 0; j < steps.count; j++)
            steps.ptr[j] = (float *)list->ptr[i + j];
        int threads = CEIL_DIV(steps.count < 1024 ? steps.count : 1024, 32) * 32;
        AMPC_LAUNCH(adam_steps_kernel<P>, 1, threads, 0, stream)(steps, found_inf);
        ampc_status st = ampc_cuda_status(cudaGetLastError());
        if (st != AMPC_OK)
            return st;
    }
    return AMPC_OK;
}

#endif /* AMPC_CUDA_STEPS_CUH */
