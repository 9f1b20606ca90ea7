/*
 * adam.cu: the fused Adam/AdamW step over lists of tensors, the CUDA twin of ampc_adam_cpu
 * (m = exp_avg, v = exp_avg_sq, vmax = max_exp_avg_sq, w = the fp32 weight: the master, or
 * the param itself without masters). Per element it runs adam.h's ampc_adam_element, and
 * the build keeps every operation rounded on its own (--fmad=false, IEEE sqrt and division),
 * so the bits equal the CPU's; the new weight is written to the param rounded to its dtype
 * (to nearest even, or stochastically with the random bits of its list index). With masters
 * the param is only written, never read: 2 + 8 + 16 + 2 = 28 bytes a bf16 parameter.
 *
 * Launch shape: multi_tensor.cuh's walk (one block per chunk of 4,096 to 65,536 elements,
 * Note [chunk per call], all chunks of up to 50 tensors in one launch, 427 with 32 KB of
 * kernel parameters: Note [kernel parameter space]) with a 7-list table. Blocks of 256
 * threads, two per SM at most 128 registers a thread (the kernel needs 70-112): 16 warps
 * an SM as with one 512-thread block, but one block's start overlaps the other's work.
 * At the start, five lanes of warp 0 read found_inf, lr,
 * inv_scale, clip_coef and the tensor's step at once (one round trip), and lane 0 computes
 * the tensor's constants (in double, as adam.h does) for the whole block, while every
 * thread's first loads are already in flight. Each thread moves 8 elements at a time with
 * 16-byte accesses, 7 independent loads in flight, when every chunk start is aligned; one
 * element a thread otherwise.
 *
 * Steps: every block of a tensor reads its step, so no block may advance it. After all the
 * update launches, a one-block launch on the same stream adds 1 to every step count (empty
 * tensors included, as the CPU). found_inf != 0 makes every launch a no-op: nothing moves.
 */
#include "adam.h"
#include "common.cuh"
#include "multi_tensor.cuh"
#include "steps.cuh"

/* The lists of the table, one pointer each per tensor; params first, for the numbering of
 * Note [stochastic rounding]. */
enum {
    ADAM_PARAM,
    ADAM_GRAD,
    ADAM_MASTER,
    ADAM_EXP_AVG,
    ADAM_EXP_AVG_SQ,
    ADAM_MAX_EXP_AVG_SQ,
    ADAM_STEP,
    ADAM_LISTS,
};

#define ADAM_THREADS 256

template <int P>
using adam_table = mt_table_of<ADAM_LISTS, P>;

static_assert(MT_PARAMS_OTHER >= sizeof(struct ampc_adam_control) + sizeof(struct ampc_adam_args),
              "adam's kernel arguments do not fit beside its table");

// ---- W elements: one (the fallback) or 8 (one 16-byte vector of 16-bit values) ----

/* The raw bits of elements [W u, W u + W) of a chunk, as loaded. */
template <int W>
struct adam_regs {
    uint32_t g[W], w[W], m[W], v[W], vmax[W];
};

/* Issues every load of elements [W u, W u + W), so that they are in flight together. */
template <ampc_dtype PD, ampc_dtype GD, int W>
__device__ __forceinline__ void adam_load(const struct ampc_adam_ptrs *q, int u,
                                          struct adam_regs<W> *r)
{
    loadw<GD, W>(r->g, q->grad, u);
    if (q->master)
        loadw<AMPC_F32, W>(r->w, q->master, u);
    else
        loadw<PD, W>(r->w, q->param, u);
    loadw<AMPC_F32, W>(r->m, q->m, u);
    loadw<AMPC_F32, W>(r->v, q->v, u);
    if (q->vmax)
        loadw<AMPC_F32, W>(r->vmax, q->vmax, u);
}

/* Updates and stores elements [W u, W u + W) from their loaded bits; k is the list index
 * of the chunk's element 0. */
template <ampc_dtype PD, ampc_dtype GD, int W>
__device__ __forceinline__ void adam_update(const struct ampc_adam_ptrs *q, int u, uint64_t k,
                                            const struct ampc_adam_coef *c,
                                            const struct ampc_adam_args *args,
                                            struct adam_regs<W> *r)
{
    uint32_t *g = r->g, *w = r->w, *m = r->m, *v = r->v, *vmax = r->vmax;
    uint32_t p[W];

#pragma unroll
    for (int e = 0; e < W; e++) {
        float wf = q->master ? ampc_bits_f32(w[e]) : to_f32<PD>(w[e]);
        float mf = ampc_bits_f32(m[e]);
        float vf = ampc_bits_f32(v[e]);
        float vmaxf = q->vmax ? ampc_bits_f32(vmax[e]) : 0.0f;
        ampc_adam_element(to_f32<GD>(g[e]), &wf, &mf, &vf, &vmaxf, c);
        w[e] = ampc_f32_bits(wf);
        m[e] = ampc_f32_bits(mf);
        v[e] = ampc_f32_bits(vf);
        vmax[e] = ampc_f32_bits(vmaxf);
        p[e] = ampc_round_bits(wf, PD, args->stochastic, c->seed, k + (uint64_t)(W * u + e));
    }
    storew<AMPC_F32, W>(q->m, u, m);
    storew<AMPC_F32, W>(q->v, u, v);
    if (q->vmax)
        storew<AMPC_F32, W>(q->vmax, u, vmax);
    if (q->master)
        storew<AMPC_F32, W>(q->master, u, w);
    storew<PD, W>(q->param, u, p);
}

template <ampc_dtype PD, ampc_dtype GD, int W>
__device__ __forceinline__ void adam_elements(const struct ampc_adam_ptrs *q, int u, uint64_t k,
                                              const struct ampc_adam_coef *c,
                                              const struct ampc_adam_args *args)
{
    struct adam_regs<W> r;

    adam_load<PD, GD, W>(q, u, &r);
    adam_update<PD, GD, W>(q, u, k, c, args, &r);
}

// ---- kernels ----

template <int P>
static __device__ struct ampc_adam_ptrs chunk_at(const adam_table<P> *tab, int t,
                                                 int64_t start, ampc_dtype pd, ampc_dtype gd)
{
    return ampc_adam_ptrs_at(tab->ptr[ADAM_PARAM][t], pd, tab->ptr[ADAM_GRAD][t], gd,
                             tab->ptr[ADAM_MASTER][t], tab->ptr[ADAM_EXP_AVG][t],
                             tab->ptr[ADAM_EXP_AVG_SQ][t], tab->ptr[ADAM_MAX_EXP_AVG_SQ][t], start);
}

static __device__ bool chunk_vec_ok(const struct ampc_adam_ptrs *q)
{
    return vec_ok(q->param) && vec_ok(q->grad) && (!q->master || vec_ok(q->master)) &&
           vec_ok(q->m) && vec_ok(q->v) && (!q->vmax || vec_ok(q->vmax));
}

/* The block's constants, or *skip: lanes 0-4 of warp 0 each read one device value, so
 * the five reads are in flight together; lane 0 computes from them. */
template <int P>
static __device__ void block_start(const adam_table<P> *tab, int t,
                                   const struct ampc_adam_control *control,
                                   const struct ampc_adam_args *args,
                                   struct ampc_adam_coef *coef, bool *skip)
{
    const unsigned all = 0xffffffffu;
    int lane = threadIdx.x;
    const float *from = lane == 0 ? control->found_inf
                      : lane == 1 ? control->lr
                      : lane == 2 ? control->inv_scale
                      : lane == 3 ? control->clip_coef
                      : lane == 4 ? (const float *)tab->ptr[ADAM_STEP][t] : NULL;
    float x = from ? *from : 0.0f;
    float found = __shfl_sync(all, x, 0);
    float lr = __shfl_sync(all, x, 1);
    float inv_scale = __shfl_sync(all, x, 2);
    float clip = __shfl_sync(all, x, 3);
    float step = __shfl_sync(all, x, 4);

    if (lane != 0)
        return;
    *skip = found != 0.0f;          /* a NULL found_inf reads as 0: never skipped */
    if (*skip)
        return;
    struct ampc_adam_control read = {control->lr ? &lr : NULL,
                                     control->inv_scale ? &inv_scale : NULL,
                                     control->clip_coef ? &clip : NULL, NULL};
    *coef = ampc_adam_tensor_coef(args, &read, step, tab->ptr[ADAM_MAX_EXP_AVG_SQ][t] != NULL);
}

template <ampc_dtype PD, ampc_dtype GD, int P>
__global__ void __launch_bounds__(ADAM_THREADS, 2)
adam_kernel(const __grid_constant__ adam_table<P> tab,
            const __grid_constant__ struct ampc_adam_control control,
            const __grid_constant__ struct ampc_adam_args args)
{
    __shared__ struct ampc_adam_coef block_coef;
    __shared__ bool skip;
    int64_t start;
    int len;
    int t = mt_chunk(&tab, &start, &len);
    struct ampc_adam_ptrs q = chunk_at(&tab, t, start, PD, GD);
    int nvec = chunk_vec_ok(&q) ? len / 8 : 0;
    int u = threadIdx.x;
    struct adam_regs<8> first;

    if (u < nvec)       /* in flight while warp 0 reads the controls and computes */
        adam_load<PD, GD, 8>(&q, u, &first);
    if (threadIdx.x < 32)
        block_start(&tab, t, &control, &args, &block_coef, &skip);
    __syncthreads();
    if (skip)           /* the loads were reads only: nothing moves */
        return;
    struct ampc_adam_coef c = block_coef;
    uint64_t k = (uint64_t)(tab.first[t] + start);

    if (u < nvec) {
        adam_update<PD, GD, 8>(&q, u, k, &c, &args, &first);
        for (u += ADAM_THREADS; u < nvec; u += ADAM_THREADS)
            adam_elements<PD, GD, 8>(&q, u, k, &c, &args);
    }
    for (int i = nvec * 8 + threadIdx.x; i < len; i += ADAM_THREADS)
        adam_elements<PD, GD, 1>(&q, i, k, &c, &args);
}

// ---- launchers ----

template <int P>
struct adam_ctx {
    void (*kernel)(const adam_table<P>, const struct ampc_adam_control,
                   const struct ampc_adam_args);
    struct ampc_adam_control control;
    struct ampc_adam_args args;
    cudaStream_t stream;
};

template <int P>
static ampc_status adam_launch(const adam_table<P> *tab, int nblocks, void *ctx)
{
    const struct adam_ctx<P> *c = (const struct adam_ctx<P> *)ctx;
    AMPC_LAUNCH(c->kernel, nblocks, ADAM_THREADS, 0, c->stream)(*tab, c->control, c->args);
    return ampc_cuda_status(cudaGetLastError());
}

template <int P>
static ampc_status adam_apply(const struct ampc_adam_lists *lists,
                              const struct ampc_adam_control *control,
                              const struct ampc_adam_args *args, cudaStream_t stream)
{
    /* [param dtype][grad dtype], in ampc_dtype order */
    static const decltype(adam_ctx<P>::kernel) kernels[3][3] = DTYPE_PAIRS(adam_kernel, P);
    const struct ampc_list *table_lists[ADAM_LISTS] = {
        &lists->params, &lists->grads, &lists->masters, &lists->exp_avgs,
        &lists->exp_avg_sqs, &lists->max_exp_avg_sqs, &lists->steps,
    };
    struct adam_ctx<P> c = {kernels[lists->params.dtype][lists->grads.dtype], *control, *args,
                            stream};

    ampc_status st = mt_apply_lists<adam_table<P>>(table_lists, mt_chunk_size(&lists->params),
                                                   adam_launch<P>, &c);
    if (st != AMPC_OK)
        return st;
    return advance_steps<P>(&lists->steps, control->found_inf, stream);
}

extern "C" ampc_status ampc_adam_cuda_impl(const struct ampc_adam_lists *lists,
                                           const struct ampc_adam_control *control,
                                           const struct ampc_adam_args *args, void *stream)
{
    if (mt_large_params(lists->params.count, ADAM_LISTS))
        return adam_apply<MT_PARAMS_LARGE>(lists, control, args, (cudaStream_t)stream);
    return adam_apply<MT_PARAMS_SMALL>(lists, control, args, (cudaStream_t)stream);
}
