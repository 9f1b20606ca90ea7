/*
 * q8.cu: tensors kept in 8 bits (encode_q8, decode_q8), the CUDA twin of cpu/q8.c: lean.h's
 * exp_avg codes, one fp32 scale (the absmax) a block of AMPC_QBLOCK elements, the same bits
 * as the CPU (--fmad=false, IEEE division).
 *
 * Launch shape: multi_tensor.cuh's walk with a chunk of AMPC_QBLOCK elements and one block
 * of AMPC_QBLOCK threads a chunk (one element a thread), so a block's absmax is one
 * reduction in shared memory (Note [amax as bits]); all the chunks of up to 86 tensors go
 * in one launch (738 with 32 KB of kernel parameters: Note [kernel parameter space]).
 */
#include "common.cuh"
#include "lean.h"
#include "multi_tensor.cuh"

/* The lists of the table: the values first (they set the numbering), codes, scales. */
enum { Q8_VALUES, Q8_CODES, Q8_SCALES, Q8_LISTS };

template <int P>
using q8_table = mt_table_of<Q8_LISTS, P>;

template <int P>
__global__ void __launch_bounds__(AMPC_QBLOCK)
encode_q8_kernel(const __grid_constant__ q8_table<P> tab, ampc_dtype st)
{
    __shared__ uint32_t red[AMPC_QBLOCK];
    int64_t start;
    int len;
    const int t = mt_chunk(&tab, &start, &len);
    const int tid = threadIdx.x;
    const bool live = tid < len;
    const int64_t i = start + tid;
    const float x = live ? ampc_load(tab.ptr[Q8_VALUES][t], st, i) : 0.0f;
    red[tid] = ampc_abs_bits(x);
    __syncthreads();
    for (int s = AMPC_QBLOCK / 2; s > 0; s /= 2) {
        if (tid < s)
            red[tid] = red[tid] > red[tid + s] ? red[tid] : red[tid + s];
        __syncthreads();
    }
    const float absmax = ampc_bits_f32(red[0]);
    if (tid == 0)
        ((float *)tab.ptr[Q8_SCALES][t])[start / AMPC_QBLOCK] = absmax;
    if (live)
        ((uint8_t *)tab.ptr[Q8_CODES][t])[i] =
            ampc_q8_codes_zero(absmax) ? (uint8_t)0 : ampc_q8m_encode(x, absmax);
}

template <int P>
__global__ void __launch_bounds__(AMPC_QBLOCK)
decode_q8_kernel(const __grid_constant__ q8_table<P> tab, ampc_dtype dt)
{
    int64_t start;
    int len;
    const int t = mt_chunk(&tab, &start, &len);
    const int tid = threadIdx.x;
    if (tid >= len)
        return;
    const int64_t i = start + tid;
    const float scale = ((const float *)tab.ptr[Q8_SCALES][t])[start / AMPC_QBLOCK];
    const uint8_t c = ((const uint8_t *)tab.ptr[Q8_CODES][t])[i];
    ampc_store(tab.ptr[Q8_VALUES][t], dt, i, ampc_q8m_decode(c, ampc_q8m_factor(scale)));
}

template <int P>
struct q8_ctx {
    void (*kernel)(const q8_table<P>, ampc_dtype);
    ampc_dtype dtype;
    cudaStream_t stream;
};

template <int P>
static ampc_status q8_launch(const q8_table<P> *tab, int nblocks, void *ctx)
{
    const struct q8_ctx<P> *c = (const struct q8_ctx<P> *)ctx;
    AMPC_LAUNCH(c->kernel, nblocks, AMPC_QBLOCK, 0, c->stream)(*tab, c->dtype);
    return ampc_cuda_status(cudaGetLastError());
}

template <int P>
static ampc_status q8_apply(bool encode, const struct ampc_list *values,
                            const struct ampc_list *codes, const struct ampc_list *scales,
                            cudaStream_t stream)
{
    const struct ampc_list *lists[Q8_LISTS] = {values, codes, scales};
    struct q8_ctx<P> c = {encode ? encode_q8_kernel<P> : decode_q8_kernel<P>, values->dtype,
                          stream};
    return mt_apply_lists<q8_table<P>>(lists, AMPC_QBLOCK, q8_launch<P>, &c);
}

static ampc_status q8_call(bool encode, const struct ampc_list *values,
                           const struct ampc_list *codes, const struct ampc_list *scales,
                           void *stream)
{
    if (mt_large_params(values->count, Q8_LISTS))
        return q8_apply<MT_PARAMS_LARGE>(encode, values, codes, scales, (cudaStream_t)stream);
    return q8_apply<MT_PARAMS_SMALL>(encode, values, codes, scales, (cudaStream_t)stream);
}

extern "C" ampc_status ampc_encode_q8_cuda_impl(const struct ampc_list *codes,
                                                const struct ampc_list *scales,
                                                const struct ampc_list *src, void *stream)
{
    return q8_call(true, src, codes, scales, stream);
}

extern "C" ampc_status ampc_decode_q8_cuda_impl(const struct ampc_list *dst,
                                                const struct ampc_list *codes,
                                                const struct ampc_list *scales, void *stream)
{
    return q8_call(false, dst, codes, scales, stream);
}
