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
 * starts are aligned, one element a thread when a storage offset breaks the alignment.
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

template <ampc_dtype S, ampc_dtype D>
__global__ void __launch_bounds__(MT_THREADS)
cast_kernel(const __grid_constant__ struct mt_table tab, int stochastic, uint64_t seed,
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

typedef void (*cast_kernel_fn)(const struct mt_table, int, uint64_t, const int64_t *);

/* [src dtype][dst dtype], in ampc_dtype order */
static const cast_kernel_fn cast_kernels[3][3] = DTYPE_PAIRS(cast_kernel);

struct cast_ctx {
    cast_kernel_fn kernel;
    int stochastic;
    uint64_t seed;
    const int64_t *seed_tensor;
    cudaStream_t stream;
};

static ampc_status cast_launch(const struct mt_table *tab, int nblocks, void *ctx)
{
    const struct cast_ctx *c = (const struct cast_ctx *)ctx;
    c->kernel<<<nblocks, MT_THREADS, 0, c->stream>>>(*tab, c->stochastic, c->seed,
                                                     c->seed_tensor);
    return ampc_cuda_status(cudaGetLastError());
}

extern "C" ampc_status ampc_cast_cuda_impl(const struct ampc_list *dst,
                                           const struct ampc_list *src,
                                           const struct ampc_cast_args *args, void *stream)
{
    struct cast_ctx c;

    c.kernel = cast_kernels[src->dtype][dst->dtype];
    c.stochastic = args->stochastic;
    c.seed = args->seed;
    c.seed_tensor = args->seed_tensor;
    c.stream = (cudaStream_t)stream;
    return mt_apply(dst, src, mt_chunk_size(src), cast_launch, &c);
}
