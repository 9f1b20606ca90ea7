/*
 * check_norm.cu: the read-only twin of unscale_check (the CUDA twin of
 * ampc_check_norm_cpu): *found_inf = 1 when a grad element is inf or nan (Note [found_inf
 * is sticky]) and norm = |inv_scale| * sqrt(sum g^2), the L2 norm of the unscaled grads,
 * all on the device.
 *
 * Launch shape: multi_tensor.cuh (one 512-thread block per chunk of 4,096 to 65,536
 * elements, Note [chunk per call], walked by mt_visit). Each thread sums its squares in
 * fp32 and tracks its largest |g| (Note [fp32 squares when safe] in check_norm.h: one FMA
 * per element, not three fp64 operations); a thread whose run is not safe reads its
 * elements again and sums them in double. Each
 * block writes the double sum of its chunk (a fixed tree) to slot (launch offset + block)
 * of a scratch array from torch's caching allocator, and one 512-thread block adds the
 * slots in a fixed order and writes the norm: the result depends on the inputs only.
 */
#include "check_norm.h"
#include "common.cuh"
#include "multi_tensor.cuh"

template <ampc_dtype DT, int P>
__global__ void __launch_bounds__(MT_THREADS)
check_norm_kernel(const __grid_constant__ mt_table<P> tab, double *partial,
                  float *found_inf)
{
    int64_t start;
    int len;
    int t = mt_chunk(&tab, &start, &len);
    const char *g = elem_ptr<DT>(tab.ptr[0][t], start);
    float sum32 = 0.0f;
    uint32_t top = 0;       /* largest |g| of this thread, as fp32 bits */
    int bad = 0;

    mt_visit<DT, DT, false>(g, NULL, len, [&](uint32_t x, int) {
        float f = to_f32<DT>(x);
        uint32_t a = ampc_f32_bits(f) & 0x7fffffffu;
        bad |= ampc_non_finite(f);
        top = a > top ? a : top;
        sum32 = fmaf(f, f, sum32);
        return x;
    });
    double sum = sum32;
    if (!ampc_squares_safe_in_f32(top)) {   /* rare: this thread's run again, in double */
        sum = 0.0;
        mt_visit<DT, DT, false>(g, NULL, len, [&](uint32_t x, int) {
            sum += ampc_square(to_f32<DT>(x));
            return x;
        });
    }
    if (bad)
        *found_inf = 1.0f;
    sum = block_sum(sum);
    if (threadIdx.x == 0)
        partial[tab.block_offset + blockIdx.x] = sum;
}

__global__ void __launch_bounds__(MT_THREADS)
check_norm_finish_kernel(float *norm, const double *partial, int64_t n, const float *inv_scale)
{
    double sum = 0.0;

    for (int64_t i = threadIdx.x; i < n; i += MT_THREADS)
        sum += partial[i];
    sum = block_sum(sum);
    if (threadIdx.x == 0)       /* in double and rounded once, as the CPU path */
        *norm = (float)(fabs((double)*inv_scale) * sqrt(sum));
}

/*
 * The scratch array lives in torch's caching allocator on the current device, which
 * begin() made the grads' device through torch's guard, and is tied to the current
 * stream, so freeing it right after the launches is safe: the allocator hands the block
 * out again only to later work on the same stream.
 */
template <int P>
static ampc_status check_norm_apply(const struct ampc_list *grads, float *found_inf,
                                    float *norm, const float *inv_scale, cudaStream_t stream)
{
    typedef struct mt_launch2<P, double *, float *> launch;
    static const decltype(launch::kernel) kernels[3] = {
        check_norm_kernel<AMPC_F32, P>, check_norm_kernel<AMPC_F16, P>,
        check_norm_kernel<AMPC_BF16, P>,
    };
    launch c = {kernels[grads->dtype], NULL, found_inf, stream};
    int64_t chunk = mt_chunk_size(grads);
    int64_t nchunks = mt_list_chunks(grads, chunk);
    void *scratch = NULL;
    ampc_status st;

    if (nchunks == 0)       /* nothing to read: the norm of an empty list is 0 */
        return ampc_cuda_status(cudaMemsetAsync(norm, 0, sizeof(*norm), stream));
    if (aoti_torch_cuda_caching_allocator_raw_alloc(nchunks * sizeof(double), &scratch) != 0)
        return ampc_cuda_fail(AMPC_ERR_NOMEM, "out of memory for the check_norm scratch");
    c.a = (double *)scratch;            /* the kernel's partial sums, one per block */
    st = mt_apply<P>(grads, NULL, chunk, mt_launch2_fn<P, double *, float *>, &c);
    if (st == AMPC_OK) {
        AMPC_LAUNCH(check_norm_finish_kernel, 1, MT_THREADS, 0, stream)(norm, c.a, nchunks,
                                                                        inv_scale);
        st = ampc_cuda_status(cudaGetLastError());
    }
    aoti_torch_cuda_caching_allocator_raw_delete(scratch);
    return st;
}

extern "C" ampc_status ampc_check_norm_cuda_impl(const struct ampc_list *grads,
                                                 float *found_inf, float *norm,
                                                 const float *inv_scale, void *stream)
{
    if (mt_large_params(grads->count, 2))
        return check_norm_apply<MT_PARAMS_LARGE>(grads, found_inf, norm, inv_scale,
                                                 (cudaStream_t)stream);
    return check_norm_apply<MT_PARAMS_SMALL>(grads, found_inf, norm, inv_scale,
                                             (cudaStream_t)stream);
}
