/*
 * common.cuh: what every CUDA file of ampc shares.
 *
 * - error handling: a launcher turns a cudaError_t into an ampc_status with
 *   ampc_cuda_status(), which also keeps the error's text for last_error() (per thread,
 *   since two threads may drive two devices at once);
 * - element access: fp32 is stored as float, fp16 and bf16 as uint16_t. Kernels move raw
 *   bits (uint32_t, a 16-bit value in the low half) so that a same-dtype cast is a plain
 *   copy, and convert with the functions of dtype.h, so the GPU computes bit for bit what
 *   the CPU computes;
 * - vector loads and stores of W elements (8: one uint4 of a 16-bit type, two of fp32,
 *   a uint2 of an fp8 type);
 * - a deterministic block sum;
 * - the launchers of each op (defined in cast.cu, unscale_check.cu, check_norm.cu,
 *   update_scale.cu, adam.cu, fp8.cu, fp8_scaling.cu, fp8_gemm.cu) and the few torch
 *   functions they call.
 */
#ifndef AMPC_CUDA_COMMON_CUH
#define AMPC_CUDA_COMMON_CUH

#include <cuda_runtime.h>
#include <stdint.h>

#include "ampc.h"
#include "dtype.h"
#include "torch_shim.h"     // defines: AOTITorchError, aoti_torch_get_current_cuda_stream

#define CEIL_DIV(a, b) (((a) + (b) - 1) / (b))

/* kernel<<<grid, block, shared, stream>>>(args): every launch site writes
 * AMPC_LAUNCH(kernel, grid, block, shared, stream)(args), which the host build of the
 * CUDA emulation (csrc/cuda/emu, AMPC_CUDA_EMULATION) turns into its own launch. */
#ifdef AMPC_CUDA_EMULATION
#define AMPC_LAUNCH(kernel, grid, block, shared, stream) \
    SIMT_LAUNCH(kernel, grid, block, shared, stream)
#else
#define AMPC_LAUNCH(kernel, grid, block, shared, stream) kernel<<<grid, block, shared, stream>>>
#endif

// ---- errors (api.cu) ----

/* AMPC_OK for cudaSuccess; otherwise keeps the error's text and returns AMPC_ERR_CUDA. */
ampc_status ampc_cuda_status(cudaError_t err);
/* Keeps `msg` as the last error text and returns `st`, for failures that are not CUDA's. */
ampc_status ampc_cuda_fail(ampc_status st, const char *msg);
const char *ampc_cuda_last_error(void);

// ---- launchers (same contracts as the _cpu functions of ampc.h, plus the stream; one per
//      kernel of ampc_ops.h) ----

extern "C" {
#define AMPC_KERNEL(name, ...) ampc_status ampc_##name##_cuda_impl(__VA_ARGS__, void *stream);
#define AMPC_CUDA_KERNEL(name, ...) AMPC_KERNEL(name, __VA_ARGS__)
#include "ampc_ops.h"
}

/* The 3 x 3 table of a kernel template on two dtypes and the kernel parameter space P
 * (multi_tensor.cuh), [first][second] in ampc_dtype order. */
#define DTYPE_PAIRS(k, P)                                                                 \
    {                                                                                     \
        {k<AMPC_F32, AMPC_F32, P>, k<AMPC_F32, AMPC_F16, P>, k<AMPC_F32, AMPC_BF16, P>},  \
        {k<AMPC_F16, AMPC_F32, P>, k<AMPC_F16, AMPC_F16, P>, k<AMPC_F16, AMPC_BF16, P>},  \
        {k<AMPC_BF16, AMPC_F32, P>, k<AMPC_BF16, AMPC_F16, P>, k<AMPC_BF16, AMPC_BF16, P>}, \
    }

// ---- element access ----

/* Bytes of one element of dtype DT, at compile time (dtype.h's ampc_dtype_size is not). */
template <ampc_dtype DT>
__host__ __device__ constexpr int elem_bytes()
{
    return DT == AMPC_F32 ? 4 : DT == AMPC_F16 || DT == AMPC_BF16 ? 2 : 1;
}

/* The value of raw bits x of dtype DT, exactly. */
template <ampc_dtype DT>
__device__ __forceinline__ float to_f32(uint32_t x)
{
    if (DT == AMPC_F32)
        return ampc_bits_f32(x);
    if (DT == AMPC_F16)
        return ampc_f16_to_f32((uint16_t)x);
    return ampc_bf16_to_f32((uint16_t)x);
}

/* The raw bits of f rounded to dtype DT, to nearest even. */
template <ampc_dtype DT>
__device__ __forceinline__ uint32_t from_f32(float f)
{
    if (DT == AMPC_F32)
        return ampc_f32_bits(f);
    if (DT == AMPC_F16)
        return ampc_f32_to_f16(f);
    return ampc_f32_to_bf16(f);
}

/* p advanced by i elements of dtype DT. */
template <ampc_dtype DT>
__device__ __forceinline__ char *elem_ptr(void *p, int64_t i)
{
    return (char *)p + i * ampc_dtype_size(DT);
}

template <ampc_dtype DT>
__device__ __forceinline__ uint32_t load1(const void *p, int i)
{
    if (DT == AMPC_F32)
        return ((const uint32_t *)p)[i];
    if (elem_bytes<DT>() == 1)
        return ((const uint8_t *)p)[i];
    return ((const uint16_t *)p)[i];
}

template <ampc_dtype DT>
__device__ __forceinline__ void store1(void *p, int i, uint32_t x)
{
    if (DT == AMPC_F32)
        ((uint32_t *)p)[i] = x;
    else if (elem_bytes<DT>() == 1)
        ((uint8_t *)p)[i] = (uint8_t)x;
    else
        ((uint16_t *)p)[i] = (uint16_t)x;
}

/* True when p can move as 16-byte vectors (loadw, storew of 8 elements). */
__device__ __forceinline__ bool vec_ok(const void *p)
{
    return ((uintptr_t)p & 15) == 0;
}

/* The unsigned type of one access of BYTES (1 to 16) bytes. */
template <int BYTES> struct access_of;
template <> struct access_of<1> { typedef uint8_t type; };
template <> struct access_of<2> { typedef uint16_t type; };
template <> struct access_of<4> { typedef uint32_t type; };
template <> struct access_of<8> { typedef uint2 type; };
template <> struct access_of<16> { typedef uint4 type; };

/* W elements of dtype DT, seen as accesses of up to 16 bytes or as elements. */
template <ampc_dtype DT, int W>
union elems_of {
    static constexpr int bytes = W * elem_bytes<DT>();
    static constexpr int accesses = bytes <= 16 ? 1 : bytes / 16;
    typedef typename access_of<bytes / accesses>::type access;
    access a[accesses];
    uint32_t f32[W];
    uint16_t f16[W];
    uint8_t f8[W];
};

/* v[0..W) = raw bits of elements [W u, W u + W) of p; p aligned to W elements (to 16
 * bytes when that is less). */
template <ampc_dtype DT, int W>
__device__ __forceinline__ void loadw(uint32_t v[W], const void *p, int u)
{
    typedef elems_of<DT, W> E;
    const typename E::access *q = (const typename E::access *)p + (size_t)u * E::accesses;
    E x;
#pragma unroll
    for (int k = 0; k < E::accesses; k++)
        x.a[k] = q[k];
#pragma unroll
    for (int e = 0; e < W; e++)
        v[e] = DT == AMPC_F32 ? x.f32[e] : elem_bytes<DT>() == 1 ? x.f8[e] : x.f16[e];
}

/* Elements [W u, W u + W) of p = raw bits v[0..W); p aligned as for loadw. */
template <ampc_dtype DT, int W>
__device__ __forceinline__ void storew(void *p, int u, const uint32_t v[W])
{
    typedef elems_of<DT, W> E;
    typename E::access *q = (typename E::access *)p + (size_t)u * E::accesses;
    E x;
#pragma unroll
    for (int e = 0; e < W; e++) {
        if (DT == AMPC_F32)
            x.f32[e] = v[e];
        else if (elem_bytes<DT>() == 1)
            x.f8[e] = (uint8_t)v[e];
        else
            x.f16[e] = (uint16_t)v[e];
    }
#pragma unroll
    for (int k = 0; k < E::accesses; k++)
        q[k] = x.a[k];
}

// ---- reductions ----

/*
 * Sum of v over the block, valid in thread 0. The tree (warp shuffles, then one warp over
 * the warp sums) is fixed, so the result depends only on the inputs of each thread.
 * blockDim.x must be a multiple of 32; call at most once per kernel (shared scratch).
 */
template <typename T>
__device__ T block_sum(T v)
{
    __shared__ T warp_sums[32];
    int lane = threadIdx.x % 32;
    int warp = threadIdx.x / 32;

    for (int o = 16; o > 0; o /= 2)
        v += __shfl_down_sync(0xffffffffu, v, o);
    if (lane == 0)
        warp_sums[warp] = v;
    __syncthreads();
    if (warp != 0)
        return 0;
    v = lane < (int)blockDim.x / 32 ? warp_sums[lane] : (T)0;
    for (int o = 16; o > 0; o /= 2)
        v += __shfl_down_sync(0xffffffffu, v, o);
    return v;
}

#endif /* AMPC_CUDA_COMMON_CUH */
