/*
 * lean.cu: the lean Adam/AdamW step, the CUDA twin of ampc_adam_lean_cpu (ampc.h's
 * struct ampc_lean_lists). Per element it runs lean.h's ampc_lean_element, as the CPU's
 * loops do, so the bits equal the CPU's (--fmad=false, IEEE sqrt and division).
 *
 * Launch shape: multi_tensor.cuh's walk with a chunk of AMPC_QBLOCK elements, one block of
 * AMPC_QBLOCK threads a chunk (one element a thread), so a chunk is one block of the 8-bit
 * moments and its absmax one reduction in shared memory. All the chunks of up to 41
 * tensors go in one launch (353 with 32 KB of kernel parameters: Note [kernel parameter
 * space]). Thread 0 computes its tensor's constants (in double, as adam.h does) for the
 * block. found_inf != 0 makes every launch a no-op. The step counts advance after all the
 * update launches (steps.cuh).
 */
#include "adam.h"
#include "common.cuh"
#include "lean.h"
#include "multi_tensor.cuh"
#include "steps.cuh"

/* The lists of the table, one pointer each per tensor; params first, for the numbering of
 * Note [stochastic rounding]. */
enum {
    LEAN_PARAM,
    LEAN_GRAD,
    LEAN_MASTER,
    LEAN_COMP,
    LEAN_EXP_AVG,
    LEAN_EXP_AVG_SQ,
    LEAN_EXP_AVG_SCALE,
    LEAN_EXP_AVG_SQ_SCALE,
    LEAN_STEP,
    LEAN_LISTS,
};

template <int P>
using lean_table = mt_table_of<LEAN_LISTS, P>;

/* What every block of a call shares besides its table. */
struct lean_launch {
    struct ampc_adam_control control;
    struct ampc_lean_args args;
    ampc_dtype pd;
    ampc_dtype gd;
    int weight;             /* AMPC_WEIGHT_* (lean.h) */
    int write;              /* AMPC_WRITE_NEAREST or _SR */
};

static_assert(MT_PARAMS_OTHER >= sizeof(struct lean_launch),
              "lean's kernel arguments do not fit beside its table");

template <int P>
__global__ void __launch_bounds__(AMPC_QBLOCK)
lean_kernel(const __grid_constant__ lean_table<P> tab, const __grid_constant__ struct lean_launch c)
{
    __shared__ struct ampc_adam_coef coef;
    __shared__ uint32_t red_m[AMPC_QBLOCK];
    __shared__ uint32_t red_v[AMPC_QBLOCK];
    if (skipped(c.control.found_inf))
        return;                                 /* the same for the whole grid */
    int64_t start;
    int len;
    const int t = mt_chunk(&tab, &start, &len);
    if (threadIdx.x == 0)
        coef = ampc_adam_tensor_coef(&c.args.adam, &c.control,
                                     *(const float *)tab.ptr[LEAN_STEP][t], 0);
    __syncthreads();
    const int tid = threadIdx.x;
    const int64_t block = start / AMPC_QBLOCK;  /* the block of the 8-bit moments */
    const bool live = tid < len;
    const int64_t i = start + tid;
    const uint64_t k = (uint64_t)(tab.first[t] + i);
    float *const m_scale = (float *)tab.ptr[LEAN_EXP_AVG_SCALE][t];
    float *const v_scale = (float *)tab.ptr[LEAN_EXP_AVG_SQ_SCALE][t];
    struct ampc_lean_at at;
    at.param = tab.ptr[LEAN_PARAM][t];
    at.grad = tab.ptr[LEAN_GRAD][t];
    at.master = (float *)tab.ptr[LEAN_MASTER][t];
    at.comp = (uint16_t *)tab.ptr[LEAN_COMP][t];
    at.m = tab.ptr[LEAN_EXP_AVG][t];
    at.v = tab.ptr[LEAN_EXP_AVG_SQ][t];
    float m = 0.0f, v = 0.0f, w;
    const struct ampc_lean_keys keys = ampc_lean_keys(coef.seed, (uint32_t)(k >> 32));
    if (live) {
        float fm = 0.0f, fv = 0.0f;
        if (c.args.moments == AMPC_MOMENTS_Q8) {
            fm = ampc_q8m_factor(m_scale[block]);
            fv = ampc_q8v_factor(v_scale[block]);
        }
        ampc_lean_element(&at, i, (uint32_t)k, &keys, &coef, coef.flags, coef.w1 < 0.5f,
                          c.args.moments, c.weight, c.write, c.pd, c.gd, fm, fv, &m, &v, &w);
    }
    if (c.args.moments != AMPC_MOMENTS_Q8)
        return;
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
    const float mmax = ampc_bits_f32(red_m[0]);
    const float smax = sqrtf(ampc_bits_f32(red_v[0]));
    if (tid == 0) {
        m_scale[block] = mmax;
        v_scale[block] = smax;
    }
    if (live) {
        ((uint8_t *)at.m)[i] = ampc_q8_codes_zero(mmax) ? (uint8_t)0 : ampc_q8m_encode(m, mmax);
        /* v's code rounds with the low half of the weight's random bits (lean.h) */
        const uint32_t rnd = ampc_random_bits_keyed(keys.w, (uint32_t)k);
        ((uint8_t *)at.v)[i] =
            ampc_q8_codes_zero(smax) ? (uint8_t)0 : ampc_q8v_encode(sqrtf(v), smax, rnd);
    }
}

template <int P>
struct lean_ctx {
    struct lean_launch call;
    cudaStream_t stream;
};

template <int P>
static ampc_status lean_launch(const lean_table<P> *tab, int nblocks, void *ctx)
{
    const struct lean_ctx<P> *c = (const struct lean_ctx<P> *)ctx;
    AMPC_LAUNCH(lean_kernel<P>, nblocks, AMPC_QBLOCK, 0, c->stream)(*tab, c->call);
    return ampc_cuda_status(cudaGetLastError());
}

template <int P>
static ampc_status lean_apply(const struct ampc_lean_lists *lists,
                              const struct ampc_adam_control *control,
                              const struct ampc_lean_args *args, cudaStream_t stream)
{
    const struct ampc_list *table_lists[LEAN_LISTS] = {
        &lists->params, &lists->grads, &lists->masters, &lists->compensations,
        &lists->exp_avgs, &lists->exp_avg_sqs, &lists->exp_avg_scales,
        &lists->exp_avg_sq_scales, &lists->steps,
    };
    struct lean_ctx<P> c;
    c.call.control = *control;
    c.call.args = *args;
    c.call.pd = lists->params.dtype;
    c.call.gd = lists->grads.dtype;
    c.call.weight = lists->masters.count ? AMPC_WEIGHT_MASTER
                  : lists->compensations.count ? AMPC_WEIGHT_KAHAN : AMPC_WEIGHT_PARAM;
    c.call.write = args->adam.stochastic ? AMPC_WRITE_SR : AMPC_WRITE_NEAREST;
    c.stream = stream;
    ampc_status st = mt_apply_lists<lean_table<P>>(table_lists, AMPC_QBLOCK, lean_launch<P>, &c);
    if (st != AMPC_OK)
        return st;
    return advance_steps<P>(&lists->steps, control->found_inf, stream);
}

extern "C" ampc_status ampc_adam_lean_cuda_impl(const struct ampc_lean_lists *lists,
                                                const struct ampc_adam_control *control,
                                                const struct ampc_lean_args *args,
                                                void *stream)
{
    if (mt_large_params(lists->params.count, LEAN_LISTS))
        return lean_apply<MT_PARAMS_LARGE>(lists, control, args, (cudaStream_t)stream);
    return lean_apply<MT_PARAMS_SMALL>(lists, control, args, (cudaStream_t)stream);
}
