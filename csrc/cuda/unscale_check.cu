/*
 * unscale_check.cu: g *= inv_scale in place over a list of gradients, and *found_inf = 1
 * when an input element is inf or nan (the CUDA twin of ampc_unscale_check_cpu; the
 * per-element rule is unscale_check.h's, as torch._amp_foreach_non_finite_check_and_unscale_:
 * fp32 math, 16-bit results rounded to nearest even). inv_scale and found_inf are read and
 * written on the device: no host sync. Note [found_inf is sticky].
 *
 * Launch shape: multi_tensor.cuh (one 512-thread block per chunk of 4,096 to 65,536
 * elements, Note [chunk per call], walked by mt_visit).
 */
#include "common.cuh"
#include "multi_tensor.cuh"
#include "unscale_check.h"

template <ampc_dtype DT, int P>
__global__ void __launch_bounds__(MT_THREADS)
unscale_check_kernel(const __grid_constant__ mt_table<P> tab, float *found_inf,
                     const float *inv_scale)
{
    int64_t start;
    int len;
    int t = mt_chunk(&tab, &start, &len);
    char *g = elem_ptr<DT>(tab.ptr[0][t], start);
    float inv = *inv_scale;
    int bad = 0;

    mt_visit<DT, DT, false>(g, g, len, [&](uint32_t x, int) {
        return from_f32<DT>(ampc_unscale_element(to_f32<DT>(x), inv, &bad));
    });
    /* Racing threads all store the same 1.0f, so the race is harmless. */
    if (bad)
        *found_inf = 1.0f;
}

template <int P>
static ampc_status unscale_check_apply(const struct ampc_list *grads, float *found_inf,
                                       const float *inv_scale, cudaStream_t stream)
{
    typedef struct mt_launch2<P, float *, const float *> launch;
    static const decltype(launch::kernel) kernels[3] = {
        unscale_check_kernel<AMPC_F32, P>, unscale_check_kernel<AMPC_F16, P>,
        unscale_check_kernel<AMPC_BF16, P>,
    };
    launch c = {kernels[grads->dtype], found_inf, inv_scale, stream};

    return mt_apply<P>(grads, NULL, mt_chunk_size(grads),
                       mt_launch2_fn<P, float *, const float *>, &c);
}

extern "C" ampc_status ampc_unscale_check_cuda_impl(const struct ampc_list *grads,
                                                    float *found_inf, const float *inv_scale,
                                                    void *stream)
{
    if (mt_large_params(grads->count, 2))
        return unscale_check_apply<MT_PARAMS_LARGE>(grads, found_inf, inv_scale,
                                                    (cudaStream_t)stream);
    return unscale_check_apply<MT_PARAMS_SMALL>(grads, found_inf, inv_scale,
                                                (cudaStream_t)stream);
}
