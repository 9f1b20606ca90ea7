/*
 * unscale.cu: the non-finite check of scaled gradients, in two flavours (the CUDA twins of
 * ampc_unscale_check_cpu and ampc_check_norm_cpu):
 *   unscale_check: g *= inv_scale in place (fp32 math, 16-bit results rounded to nearest
 *                  even), as torch._amp_foreach_non_finite_check_and_unscale_;
 *   check_norm:    read-only, norm = |inv_scale| * sqrt(sum g^2) of the unscaled grads.
 * Both set *found_inf = 1 when an input element is inf or nan (checked before the multiply;
 * Note [found_inf is sticky]). inv_scale and found_inf are read on the device: no host sync.
 *
 * Launch shape: multi_tensor.cuh (one 512-thread block per 65536-element chunk, walked by
 * mt_visit). check_norm is deterministic: each block writes the double sum of its chunk's
 * squares (per-thread sums, then a fixed tree) to slot (launch offset + block) of a scratch
 * array from torch's caching allocator, then one 512-thread block adds the slots in a
 * fixed order and writes the norm.
 */
#include "common.cuh"
#include "multi_tensor.cuh"

/* One gradient element: flags it, then unscales it as torch does (g * 1 is g, even nan). */
template <ampc_dtype DT>
__device__ __forceinline__ uint32_t unscale1(uint32_t x, float inv, bool *bad)
{
    float g = to_f32<DT>(x);
    *bad |= ampc_non_finite(g);
    return from_f32<DT>(inv == 1.0f ? g : g * inv);
}

template <ampc_dtype DT>
__global__ void __launch_bounds__(MT_THREADS)
unscale_kernel(const __grid_constant__ struct mt_table tab, float *found_inf,
               const float *inv_scale)
{
    int64_t start;
    int len;
    int t = mt_chunk(&tab, &start, &len);
    char *g = elem_ptr<DT>(tab.ptr[0][t], start);
    float inv = *inv_scale;
    bool bad = false;

    mt_visit<DT, DT>(g, g, len, [&](uint32_t x, int) { return unscale1<DT>(x, inv, &bad); });
    /* Racing threads all store the same 1.0f, so the race is harmless. */
    if (bad)
        *found_inf = 1.0f;
}

template <ampc_dtype DT>
__global__ void __launch_bounds__(MT_THREADS)
norm_kernel(const __grid_constant__ struct mt_table tab, double *partial, float *found_inf)
{
    int64_t start;
    int len;
    int t = mt_chunk(&tab, &start, &len);
    const char *g = elem_ptr<DT>(tab.ptr[0][t], start);
    double sum = 0.0;     /* squares of large or tiny fp32 values fit only a double */
    bool bad = false;

    mt_visit<DT, DT>(g, NULL, len, [&](uint32_t x, int) {
        float f = to_f32<DT>(x);
        bad |= ampc_non_finite(f);
        sum += (double)f * f;
        return x;
    });
    if (bad)
        *found_inf = 1.0f;
    sum = block_sum(sum);
    if (threadIdx.x == 0)
        partial[tab.block_offset + blockIdx.x] = sum;
}

__global__ void __launch_bounds__(MT_THREADS)
norm_finish_kernel(float *norm, const double *partial, int64_t n, const float *inv_scale)
{
    double sum = 0.0;

    for (int64_t i = threadIdx.x; i < n; i += MT_THREADS)
        sum += partial[i];
    sum = block_sum(sum);
    if (threadIdx.x == 0)       /* in double and rounded once, as the CPU path */
        *norm = (float)(fabs((double)*inv_scale) * sqrt(sum));
}

// ---- launchers ----

typedef void (*grads_kernel_fn)(const struct mt_table, float *, const float *);
typedef void (*norm_kernel_fn)(const struct mt_table, double *, float *);

static const grads_kernel_fn unscale_kernels[3] = {
    unscale_kernel<AMPC_F32>, unscale_kernel<AMPC_F16>, unscale_kernel<AMPC_BF16>,
};
static const norm_kernel_fn norm_kernels[3] = {
    norm_kernel<AMPC_F32>, norm_kernel<AMPC_F16>, norm_kernel<AMPC_BF16>,
};

struct grads_ctx {
    ampc_dtype dtype;
    float *found_inf;
    const float *inv_scale;     /* unscale_check */
    double *partial;            /* check_norm */
    cudaStream_t stream;
};

static ampc_status unscale_launch(const struct mt_table *tab, int nblocks, void *ctx)
{
    const struct grads_ctx *c = (const struct grads_ctx *)ctx;
    unscale_kernels[c->dtype]<<<nblocks, MT_THREADS, 0, c->stream>>>(*tab, c->found_inf,
                                                                     c->inv_scale);
    return ampc_cuda_status(cudaGetLastError());
}

static ampc_status norm_launch(const struct mt_table *tab, int nblocks, void *ctx)
{
    const struct grads_ctx *c = (const struct grads_ctx *)ctx;
    norm_kernels[c->dtype]<<<nblocks, MT_THREADS, 0, c->stream>>>(*tab, c->partial,
                                                                  c->found_inf);
    return ampc_cuda_status(cudaGetLastError());
}

extern "C" ampc_status ampc_unscale_check_cuda_impl(const struct ampc_list *grads,
                                                    float *found_inf, const float *inv_scale,
                                                    void *stream)
{
    struct grads_ctx c = {grads->dtype, found_inf, inv_scale, NULL, (cudaStream_t)stream};
    return mt_apply(grads, NULL, unscale_launch, &c);
}

/*
 * The scratch array lives in torch's caching allocator on the current device and stream
 * (begin() made them ours), so freeing it right after the launches is safe: the allocator
 * hands the block out again only to later work on the same stream.
 */
extern "C" ampc_status ampc_check_norm_cuda_impl(const struct ampc_list *grads,
                                                 float *found_inf, float *norm,
                                                 const float *inv_scale, void *stream)
{
    struct grads_ctx c = {grads->dtype, found_inf, inv_scale, NULL, (cudaStream_t)stream};
    int64_t nchunks = mt_list_chunks(grads);
    void *scratch = NULL;
    ampc_status st;

    if (nchunks == 0)       /* nothing to read: the norm of an empty list is 0 */
        return ampc_cuda_status(cudaMemsetAsync(norm, 0, sizeof(*norm), c.stream));
    if (aoti_torch_cuda_caching_allocator_raw_alloc(nchunks * sizeof(double), &scratch) != 0)
        return ampc_cuda_fail(AMPC_ERR_NOMEM, "out of memory for the check_norm scratch");
    c.partial = (double *)scratch;
    st = mt_apply(grads, NULL, norm_launch, &c);
    if (st == AMPC_OK) {
        norm_finish_kernel<<<1, MT_THREADS, 0, c.stream>>>(norm, c.partial, nchunks, inv_scale);
        st = ampc_cuda_status(cudaGetLastError());
    }
    aoti_torch_cuda_caching_allocator_raw_delete(scratch);
    return st;
}
