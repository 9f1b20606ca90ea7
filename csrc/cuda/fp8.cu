/*
 * fp8.cu: the fp8 casts on CUDA, twins of fp8.c: cast_fp8 (fp32/fp16/bf16 -> e4m3fn or
 * e5m2 with a per-tensor scale read on the device, and the amax of the input from the same
 * read), fp8_amax (the amax alone) and cast_from_fp8 (fp8 -> fp32/fp16/bf16 with the
 * inverse scale). The per-element math is fp8.h's, so a value gets the same code as on the
 * CPU (a NaN made by the multiply is CUDA's canonical +NaN, as torch's CUDA cast sees it).
 *
 * Launch shape: multi_tensor.cuh (one 512-thread block per chunk of 4,096 to 65,536
 * elements, Note [chunk per call], walked by mt_visit: 16-byte vectors of the wide dtype,
 * 8 bytes of fp8 a vector). The table carries four pointers per tensor: the output, the
 * input, its scale and its amax.
 *
 * amax: each block reduces the bits of |x| (Note [amax as bits]) and one atomicMax per
 * block merges them into the tensor's amax, which a first launch sets to 0 for every
 * tensor of the list (empty ones included, which get no block). Integer max is order
 * independent, so the result is exact and deterministic.
 */
#include <cuda_fp16.h>

#include "common.cuh"
#include "fp8.h"
#include "multi_tensor.cuh"

/* [0]: output (unused by fp8_amax), [1]: input, [2]: its scale, [3]: its amax; the 4 KB
 * table (73 tensors a launch) */
struct fp8_table : mt_table_of<4, MT_PARAMS_SMALL> {};

/* The max of v over the block, valid in thread 0 (one call per kernel: shared scratch). */
__device__ uint32_t block_max(uint32_t v)
{
    __shared__ uint32_t warp_max[MT_THREADS / 32];
    v = __reduce_max_sync(0xffffffffu, v);
    if (threadIdx.x % 32 == 0)
        warp_max[threadIdx.x / 32] = v;
    __syncthreads();
    if (threadIdx.x >= 32)
        return 0;
    v = threadIdx.x < MT_THREADS / 32 ? warp_max[threadIdx.x] : 0u;
    return __reduce_max_sync(0xffffffffu, v);
}

/* The value of raw bits x of dtype S, exactly; fp16 through the hardware conversion (a NaN
 * may come out with another payload, which the multiply and the amax make canonical). */
template <ampc_dtype S>
__device__ __forceinline__ float wide_value(uint32_t x)
{
    if (S == AMPC_F16)
        return __half2float(__ushort_as_half((unsigned short)x));
    return to_f32<S>(x);
}

/* Writes q = fp8 codes of format F when WRITE (cast_fp8), and merges max |x| into amax. */
template <ampc_dtype S, ampc_dtype F, bool WRITE>
__global__ void __launch_bounds__(MT_THREADS)
cast_fp8_kernel(const __grid_constant__ struct fp8_table tab)
{
    int64_t start;
    int len;
    int t = mt_chunk(&tab, &start, &len);
    const char *src = elem_ptr<S>(tab.ptr[1][t], start);
    char *dst = WRITE ? elem_ptr<F>(tab.ptr[0][t], start) : NULL;
    float scale = WRITE ? *(const float *)tab.ptr[2][t] : 1.0f;
    struct ampc_fp8_format f = ampc_fp8_format_of(F);
    float fmax = ampc_bits_f32(f.fmax);
    uint32_t m = 0;

    /* fp8_amax writes nothing: the offsets of a lone source never differ */
    mt_visit<S, F, WRITE>(src, dst, len, [&](uint32_t x, int) {
        float v = wide_value<S>(x);
        uint32_t b = ampc_abs_bits(v);
        m = b > m ? b : m;
        return WRITE ? (uint32_t)ampc_cast_fp8_element(v, scale, fmax, f) : x;
    });
    m = block_max(m > AMPC_EXP_BITS ? 0x7fc00000u : m);     /* every NaN: the one NaN */
    if (threadIdx.x == 0)
        atomicMax((unsigned int *)tab.ptr[3][t], m);
}

template <ampc_dtype F, ampc_dtype D>
__global__ void __launch_bounds__(MT_THREADS)
cast_from_fp8_kernel(const __grid_constant__ struct fp8_table tab)
{
    int64_t start;
    int len;
    int t = mt_chunk(&tab, &start, &len);
    char *dst = elem_ptr<D>(tab.ptr[0][t], start);
    const char *src = elem_ptr<F>(tab.ptr[1][t], start);
    float scale_inv = *(const float *)tab.ptr[2][t];

    mt_visit<F, D>(src, dst, len, [&](uint32_t q, int) {
        return from_f32<D>(ampc_fp8_mul(ampc_fp8_decode((uint8_t)q, F), scale_inv));
    });
}

// ---- zeroing the amax of every tensor ----

#define ZERO_BATCH 480          /* pointers a launch: 3,840 bytes of arguments */

struct value_batch {
    float *p[ZERO_BATCH];
    int count;
};

__global__ void zero_values_kernel(const __grid_constant__ struct value_batch b)
{
    if ((int)threadIdx.x < b.count)
        *b.p[threadIdx.x] = 0.0f;
}

static ampc_status zero_values(const struct ampc_list *values, cudaStream_t stream)
{
    struct value_batch b;
    for (int64_t i = 0; i < values->count; i += ZERO_BATCH) {
        b.count = (int)(values->count - i < ZERO_BATCH ? values->count - i : ZERO_BATCH);
        for (int k = 0; k < b.count; k++)
            b.p[k] = (float *)values->ptr[i + k];
        AMPC_LAUNCH(zero_values_kernel, 1, ZERO_BATCH, 0, stream)(b);
        ampc_status st = ampc_cuda_status(cudaGetLastError());
        if (st != AMPC_OK)
            return st;
    }
    return AMPC_OK;
}

// ---- launchers ----

typedef void (*fp8_kernel_fn)(const struct fp8_table);

struct fp8_launch {
    fp8_kernel_fn kernel;
    cudaStream_t stream;
};

static ampc_status fp8_launch_fn(const struct fp8_table *tab, int nblocks, void *ctx)
{
    const struct fp8_launch *c = (const struct fp8_launch *)ctx;
    AMPC_LAUNCH(c->kernel, nblocks, MT_THREADS, 0, c->stream)(*tab);
    return ampc_cuda_status(cudaGetLastError());
}

/* [source dtype][0: e4m3, 1: e5m2] */
#define FP8_KERNELS(W)                                                                     \
    {                                                                                      \
        {cast_fp8_kernel<AMPC_F32, AMPC_F8E4M3, W>, cast_fp8_kernel<AMPC_F32, AMPC_F8E5M2, W>},   \
        {cast_fp8_kernel<AMPC_F16, AMPC_F8E4M3, W>, cast_fp8_kernel<AMPC_F16, AMPC_F8E5M2, W>},   \
        {cast_fp8_kernel<AMPC_BF16, AMPC_F8E4M3, W>, cast_fp8_kernel<AMPC_BF16, AMPC_F8E5M2, W>}, \
    }

static const fp8_kernel_fn cast_fp8_kernels[3][2] = FP8_KERNELS(true);
static const fp8_kernel_fn fp8_amax_kernels[3][2] = FP8_KERNELS(false);

/* [0: e4m3, 1: e5m2][output dtype] */
static const fp8_kernel_fn cast_from_fp8_kernels[2][3] = {
    {cast_from_fp8_kernel<AMPC_F8E4M3, AMPC_F32>, cast_from_fp8_kernel<AMPC_F8E4M3, AMPC_F16>,
     cast_from_fp8_kernel<AMPC_F8E4M3, AMPC_BF16>},
    {cast_from_fp8_kernel<AMPC_F8E5M2, AMPC_F32>, cast_from_fp8_kernel<AMPC_F8E5M2, AMPC_F16>,
     cast_from_fp8_kernel<AMPC_F8E5M2, AMPC_BF16>},
};

static ampc_status fp8_apply(fp8_kernel_fn kernel, const struct ampc_list *const lists[4],
                             const struct ampc_list *src, void *stream)
{
    struct fp8_launch c = {kernel, (cudaStream_t)stream};
    return mt_apply_lists<struct fp8_table>(lists, mt_chunk_size(src), fp8_launch_fn, &c);
}

extern "C" ampc_status ampc_cast_fp8_cuda_impl(const struct ampc_list *dst,
                                               const struct ampc_list *amax,
                                               const struct ampc_list *src,
                                               const struct ampc_list *scale, void *stream)
{
    const struct ampc_list *lists[4] = {dst, src, scale, amax};
    ampc_status st = zero_values(amax, (cudaStream_t)stream);
    if (st != AMPC_OK)
        return st;
    return fp8_apply(cast_fp8_kernels[src->dtype][dst->dtype == AMPC_F8E5M2], lists, src, stream);
}

extern "C" ampc_status ampc_fp8_amax_cuda_impl(const struct ampc_list *amax,
                                               const struct ampc_list *src, void *stream)
{
    const struct ampc_list *lists[4] = {src, src, NULL, amax};
    ampc_status st = zero_values(amax, (cudaStream_t)stream);
    if (st != AMPC_OK)
        return st;
    return fp8_apply(fp8_amax_kernels[src->dtype][0], lists, src, stream);
}

extern "C" ampc_status ampc_cast_from_fp8_cuda_impl(const struct ampc_list *dst,
                                                    const struct ampc_list *src,
                                                    const struct ampc_list *scale_inv,
                                                    void *stream)
{
    const struct ampc_list *lists[4] = {dst, src, scale_inv, NULL};
    return fp8_apply(cast_from_fp8_kernels[src->dtype == AMPC_F8E5M2][dst->dtype], lists, src,
                     stream);
}
