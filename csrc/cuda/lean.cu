/*
 * lean.cu: the lean Adam/AdamW step, the CUDA twin of ampc_adam_lean_cpu (ampc.h's
 * struct ampc_lean_lists). Per element it runs lean.h's ampc_lean_element, as the CPU's
 * loops do, so the bits equal the CPU's (--fmad=false, IEEE sqrt and division).
 *
 * Launch shape: one launch per tensor, one block of AMPC_QBLOCK threads per block of the
 * 8-bit moments (one element a thread), so a block's absmax is one reduction in shared
 * memory. Thread 0 computes the tensor's constants (in double, as adam.h does) for its
 * block. found_inf != 0 makes every launch a no-op. After all the update launches, one
 * launch a tensor adds 1 to its step count (every block reads it, so none may advance
 * it). Simple rather than fast: the per-tensor launches and one element a thread leave
 * bandwidth on the table for many small tensors; the multi-tensor walk of adam.cu is the
 * way to speed it up, without changing a bit.
 */
#include "adam.h"
#include "common.cuh"
#include "lean.h"

/* One tensor's pointers and kinds. */
struct lean_tensor {
    struct ampc_lean_at at;
    float *m_scale;
    float *v_scale;
    const float *step;
    int64_t numel;
    int64_t index;          /* list-wide index of element 0 (Note [stochastic rounding]) */
    ampc_dtype pd;
    ampc_dtype gd;
    int weight;             /* AMPC_WEIGHT_* (lean.h) */
    int write;              /* AMPC_WRITE_NEAREST or _SR */
};

__device__ __forceinline__ bool skipped(const float *found_inf)
{
    return found_inf && *found_inf != 0.0f;
}

__global__ void __launch_bounds__(AMPC_QBLOCK)
lean_kernel(const struct lean_tensor t, const struct ampc_adam_control ctl,
            const struct ampc_lean_args args)
{
    __shared__ struct ampc_adam_coef coef;
    __shared__ uint32_t red_m[AMPC_QBLOCK];
    __shared__ uint32_t red_v[AMPC_QBLOCK];
    if (skipped(ctl.found_inf))
        return;                                 /* the same for the whole block */
    if (threadIdx.x == 0)
        coef = ampc_adam_tensor_coef(&args.adam, &ctl, *t.step, 0);
    __syncthreads();
    const int tid = threadIdx.x;
    const int64_t block = blockIdx.x;
    const int64_t i = block * AMPC_QBLOCK + tid;
    const bool live = i < t.numel;
    const uint64_t k = (uint64_t)(t.index + i);
    float m = 0.0f, v = 0.0f, w;
    if (live) {
        const struct ampc_lean_keys keys = ampc_lean_keys(coef.seed, (uint32_t)(k >> 32));
        float fm = 0.0f, fv = 0.0f;
        if (args.moments == AMPC_MOMENTS_Q8) {
            fm = ampc_q8m_factor(t.m_scale[block]);
            fv = ampc_q8v_factor(t.v_scale[block]);
        }
        ampc_lean_element(&t.at, i, (uint32_t)k, &keys, &coef, coef.flags, coef.w1 < 0.5f,
                          args.moments, t.weight, t.write, t.pd, t.gd, fm, fv, &m, &v, &w);
    }
    if (args.moments == AMPC_MOMENTS_Q8) {
        /* every thread has read its block's scales above, before thread 0 rewrites them */
        red_m[tid] = live ? ampc_abs_bits(m) : 0u;
        red_v[tid] = live ? ampc_abs_bits(v) : 0u;
        __syncthreads();
        for (int s = AMPC_QBLOCK / 2; s > 0; s /= 2) {
            if (tid < s) {
                red_m[tid] = red_m[tid] > red_m[tid + s] ? red_m[tid] : red_m[tid + s];
                red_v[tid] = red_v[tid] > red_v[tid + s] ? red_v[tid] : red_v[tid + s];
            }
            __syncthreads();
        }
        float mmax = ampc_bits_f32(red_m[0]);
        float smax = sqrtf(ampc_bits_f32(red_v[0]));
        if (tid == 0) {
            t.m_scale[block] = mmax;
            t.v_scale[block] = smax;
        }
        if (live) {
            ((uint8_t *)t.at.m)[i] =
                ampc_q8_codes_zero(mmax) ? (uint8_t)0 : ampc_q8m_encode(m, mmax);
            ((uint8_t *)t.at.v)[i] =
                ampc_q8_codes_zero(smax) ? (uint8_t)0 : ampc_q8v_encode(sqrtf(v), smax);
        }
    }
}

__global__ void lean_step_kernel(float *step, const float *found_inf)
{
    if (threadIdx.x == 0 && !skipped(found_inf))
        *step += 1.0f;
}

static void *at_or_null(const struct ampc_list *l, int64_t t)
{
    return l->count ? l->ptr[t] : NULL;
}

extern "C" ampc_status ampc_adam_lean_cuda_impl(const struct ampc_lean_lists *lists,
                                                const struct ampc_adam_control *control,
                                                const struct ampc_lean_args *args,
                                                void *stream)
{
    cudaStream_t s = (cudaStream_t)stream;
    int64_t index = 0;
    for (int64_t i = 0; i < lists->params.count; i++) {
        struct lean_tensor t;
        t.at.param = lists->params.ptr[i];
        t.at.grad = lists->grads.ptr[i];
        t.at.master = (float *)at_or_null(&lists->masters, i);
        t.at.comp = (uint16_t *)at_or_null(&lists->compensations, i);
        t.at.m = lists->exp_avgs.ptr[i];
        t.at.v = lists->exp_avg_sqs.ptr[i];
        t.m_scale = (float *)at_or_null(&lists->exp_avg_scales, i);
        t.v_scale = (float *)at_or_null(&lists->exp_avg_sq_scales, i);
        t.step = (const float *)lists->steps.ptr[i];
        t.numel = lists->params.numel[i];
        t.index = index;
        t.pd = lists->params.dtype;
        t.gd = lists->grads.dtype;
        t.weight = t.at.master ? AMPC_WEIGHT_MASTER
                 : t.at.comp ? AMPC_WEIGHT_KAHAN : AMPC_WEIGHT_PARAM;
        t.write = args->adam.stochastic ? AMPC_WRITE_SR : AMPC_WRITE_NEAREST;
        index += t.numel;
        int64_t blocks = CEIL_DIV(t.numel, AMPC_QBLOCK);
        if (blocks == 0)
            continue;
        if (blocks > 0x7fffffff)
            return ampc_cuda_fail(AMPC_ERR_CUDA, "adam_lean: tensor too large for one launch");
        AMPC_LAUNCH(lean_kernel, (unsigned)blocks, AMPC_QBLOCK, 0, s)(t, *control, *args);
        ampc_status st = ampc_cuda_status(cudaGetLastError());
        if (st != AMPC_OK)
            return st;
    }
    for (int64_t i = 0; i < lists->steps.count; i++) {
        AMPC_LAUNCH(lean_step_kernel, 1, 32, 0, s)((float *)lists->steps.ptr[i],
                                                   control->found_inf);
        ampc_status st = ampc_cuda_status(cudaGetLastError());
        if (st != AMPC_OK)
            return st;
    }
    return AMPC_OK;
}
