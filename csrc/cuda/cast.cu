/*
 * cast.cu: dst[i] = src[i] converted to dst's dtype, for every pair of fp32/fp16/bf16,
 * over whole tensor lists. The CUDA twin of ampc_cast_cpu: same dtype is a plain copy of
 * the bits, widening is exact, narrowing rounds to nearest even (bit-identical to
 * Tensor.to) or stochastically with the random bits ampc_random_bits(seed, k) of list
 * element k (Note [stochastic rounding] in ampc.h), so CPU and GPU results match exactly;
 * the seed may be a device tensor read at run time, so replays of a captured graph that
 * advance it draw new bits (Note [random bits that advance on the device] in dtype.h).
 *
 * Launch shape: multi_tensor.cuh (one 512-thread block per chunk of 4,096 to 65,536
 * elements, Note [chunk per call]), walked by mt_visit: 16-byte vectors when both chunk
 * starts are aligned or off by the same elements, narrower ones when storage offsets
 * break that (Note [misaligned views] in multi_tensor.cuh).
 */
#include "cast.h"
#include "common.cuh"
#include "multi_tensor.cuh"

/* Element k of the list, raw bits of dtype S to raw bits of dtype D. */
template <ampc_dtype S, ampc_dtype D>
__device__ __forceinline__ uint32_t cast1(uint32_t x, int stochastic, uint64_t seed, uint64_t k)
{
    if (S == D)
        return x;
    return ampc_round_bits(to_f32<S>(x), D, stochastic, seed, k);
}

/* Two blocks an SM (at most 64 registers), as before the narrower vectors' code. */
template <ampc_dtype S, ampc_dtype D, int P>
__global__ void __launch_bounds__(MT_THREADS, 2)
cast_kernel(const __grid_constant__ mt_table<P> tab, int stochastic, uint64_t seed,
            const int64_t *seed_tensor)
{
    int64_t start;
    int len;
    int t = mt_chunk(&tab, &start, &len);
    char *dst = elem_ptr<D>(tab.ptr[0][t], start);
    const char *src = elem_ptr<S>(tab.ptr[1][t], start);
    uint64_t k0 = (uint64_t)(tab.first[t] + start);   /* list index of the chunk's element 0 */

    if (stochastic && seed_tensor)      /* every thread reads the same word: one L2 line */
        seed = (uint64_t)*seed_tensor;

    mt_visit<S, D>(src, dst, len, [&](uint32_t x, int i) {
        return cast1<S, D>(x, stochastic, seed, k0 + i);
    });
}

template <int P>
struct cast_ctx {
    void (*kernel)(const mt_table<P>, int, uint64_t, const int64_t *);
    int stochastic;
    uint64_t seed;
    const int64_t *seed_tensor;
    cudaStream_t stream;
};

template <int P>
static ampc_status cast_launch(const mt_table<P> *tab, int nblocks, void *ctx)
{
    const struct cast_ctx<P> *c = (const struct cast_ctx<P> *)ctx;
    AMPC_LAUNCH(c->kernel, nblocks, MT_THREADS, 0, c->stream)(*tab, c->stochastic, c->seed,
                                                            c->seed_tensor);
    return ampc_cuda_status(cudaGetLastError());
}

template <int P>
static ampc_status cast_apply(const struct ampc_list *dst, const struct ampc_list *src,
                              const struct ampc_cast_args *args, cudaStream_t stream)
{
    /* [src dtype][dst dtype], in ampc_dtype order */
    static const decltype(cast_ctx<P>::kernel) kernels[3][3] = DTYPE_PAIRS(cast_kernel, P);
    struct cast_ctx<P> c = {kernels[src->dtype][dst->dtype], args->stochastic, args->seed,
                            args->seed_tensor, stream};

    return mt_apply<P>(dst, src, mt_chunk_size(src), cast_launch<P>, &c);
}

extern "C" ampc_status ampc_cast_cuda_impl(const struct ampc_list *dst,
                                           const struct ampc_list *src,
                                           const struct ampc_cast_args *args, void *stream)
{
    if (mt_large_params(src->count, 2))
        return cast_apply<MT_PARAMS_LARGE>(dst, src, args, (cudaStream_t)stream);
    return cast_apply<MT_PARAMS_SMALL>(dst, src, args, (cudaStream_t)stream);
}
