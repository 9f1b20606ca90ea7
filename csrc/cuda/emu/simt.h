/*
 * simt.h: the CUDA execution model on the CPU, so that the csrc/cuda sources build as
 * host C++ (g++ -include simt.h, with the cuda_*.h redirects of this folder first on the
 * include path) and every kernel and launch plan runs without a GPU.
 *
 * - A launch runs its blocks one after another on the calling thread, each block as
 *   blockDim fibers (simt.cpp). A fiber runs until it meets __syncthreads() or a warp
 *   collective, then waits there; once every fiber has arrived, all go on. Between two
 *   such points the fibers of a block run in forward, reversed or shuffled order
 *   (AMPC_EMU_ORDER), so a missing barrier shows as a result that depends on the order.
 * - __shared__ is `static`: one copy, and one block at a time uses it; it starts each
 *   block as 0xff bytes (outside templates), so a read before any write of the block
 *   gives NaN or ~0.
 * - Warp collectives: the 32 lanes of a warp meet, exchange, go on; a lane that exited, a
 *   partial mask or lanes of one warp in different collectives stop the run with a message.
 * - The device is an H200 (132 SMs, compute capability 9.0, a driver for CUDA 13.0:
 *   32 KB kernel parameters) or, with AMPC_EMU_DEVICE=sm80, an A100 on a CUDA 12.0
 *   driver (108 SMs, 8.0, 4 KB parameters). A launch whose arguments exceed what the
 *   device takes fails as on a GPU.
 * - Every launch is recorded (where, grid, block, argument bytes) for the tests.
 */
#ifndef AMPC_CUDA_EMU_SIMT_H
#define AMPC_CUDA_EMU_SIMT_H

#include <math.h>         /* the math functions nvcc gives device code */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include <tuple>
#include <type_traits>

/* The runtime the emulation stands for: 12.8, so that the sm80 device's 12.0 driver is
 * one the runtime's minor-version compatibility accepts. */
#define CUDART_VERSION 12080

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __grid_constant__
/* one copy, in a section of its own so that each block starts with it filled with 0xff
 * bytes (NaN as a float, the largest unsigned): a read before the block's own write
 * shows, instead of the last block's value. g++ ignores the section of a static in a
 * template (it goes to a COMDAT group): those keep the last block's values. */
#define __shared__ static __attribute__((section("simt_shared")))

// ---- vector types ----

struct uint3 {
    unsigned int x, y, z;
};

struct dim3 {
    unsigned int x, y, z;
    dim3(unsigned int x_ = 1, unsigned int y_ = 1, unsigned int z_ = 1) : x(x_), y(y_), z(z_) {}
};

/* aligned as on the GPU, so a misaligned vector access is UBSan's "misaligned address" */
struct alignas(8) uint2 {
    unsigned int x, y;
};

struct alignas(16) uint4 {
    unsigned int x, y, z, w;
};

// ---- runtime API (the calls ampc makes) ----

enum cudaError {
    cudaSuccess = 0,
    cudaErrorInvalidValue = 1,
    cudaErrorInvalidConfiguration = 9,
    cudaErrorInvalidDevice = 101,
};
typedef enum cudaError cudaError_t;

enum cudaDeviceAttr {
    cudaDevAttrMaxThreadsPerBlock = 1,
    cudaDevAttrMultiProcessorCount = 16,
    cudaDevAttrComputeCapabilityMajor = 75,
    cudaDevAttrComputeCapabilityMinor = 76,
};

typedef struct simt_stream *cudaStream_t;

cudaError_t cudaGetLastError(void);
cudaError_t cudaPeekAtLastError(void);
const char *cudaGetErrorString(cudaError_t err);
const char *cudaGetErrorName(cudaError_t err);
cudaError_t cudaDriverGetVersion(int *version);
cudaError_t cudaRuntimeGetVersion(int *version);
cudaError_t cudaGetDevice(int *device);
cudaError_t cudaDeviceGetAttribute(int *value, enum cudaDeviceAttr attr, int device);
cudaError_t cudaMemsetAsync(void *ptr, int value, size_t bytes, cudaStream_t stream);

// ---- the execution model (simt.cpp) ----

namespace simt {

/* The calling fiber's thread index; blockIdx, blockDim, gridDim of the running block. */
extern const uint3 *self_idx;
extern uint3 block_idx;
extern uint3 block_dim;
extern uint3 grid_dim;

/* `site`: where the thread waits; all threads of a block must wait at the same one. */
void syncthreads(const char *site);

enum collective { SHFL_IDX, SHFL_DOWN, REDUCE_MAX };

/* The warp collective `kind` of the calling lane: its value's bits and argument in, the
 * bits it receives out, once every lane of its warp has called it. */
uint64_t warp_collective(unsigned mask, enum collective kind, uint64_t bits, int arg);

/* Runs body(ctx) as every thread of a grid x block launch, from `site` (the launching
 * function) with `param_bytes` of kernel arguments; records the launch. */
cudaError_t launch(const char *site, dim3 grid, dim3 block, size_t shared_bytes,
                   cudaStream_t stream, size_t param_bytes, void (*body)(void *), void *ctx);

/* Bytes of kernel arguments P..., each aligned to its type as in the parameter space. */
template <typename... P>
constexpr size_t param_bytes()
{
    size_t n = 0;
    ((n = (n + alignof(P) - 1) / alignof(P) * alignof(P) + sizeof(P)), ...);
    return n;
}

/* kernel<<<grid, block, shared, stream>>>(args...) as launcher(...)(args...): the
 * arguments are converted to the kernel's parameter types once, as the launch does, and
 * every thread receives a copy of them. */
template <typename... P>
struct launcher {
    void (*kernel)(P...);
    const char *site;
    dim3 grid, block;
    size_t shared_bytes;
    cudaStream_t stream;

    struct call {
        void (*kernel)(P...);
        std::tuple<std::decay_t<P>...> args;
    };

    static void run(void *ctx)
    {
        call *c = (call *)ctx;
        std::apply(c->kernel, c->args);
    }

    template <typename... A>
    void operator()(A &&...args) const
    {
        call c{kernel, std::tuple<std::decay_t<P>...>(std::forward<A>(args)...)};
        launch(site, grid, block, shared_bytes, stream, param_bytes<std::decay_t<P>...>(), run, &c);
    }
};

template <typename... P>
launcher<P...> make_launcher(void (*kernel)(P...), const char *site, dim3 grid, dim3 block,
                             size_t shared_bytes, cudaStream_t stream)
{
    return launcher<P...>{kernel, site, grid, block, shared_bytes, stream};
}

template <typename T>
T shuffle(unsigned mask, enum collective kind, T v, int arg)
{
    static_assert(sizeof(T) <= 8, "a shuffle moves at most 8 bytes");
    uint64_t bits = 0;
    memcpy(&bits, &v, sizeof(v));
    bits = warp_collective(mask, kind, bits, arg);
    memcpy(&v, &bits, sizeof(v));
    return v;
}

}  // namespace simt

#define threadIdx (*::simt::self_idx)
#define blockIdx (::simt::block_idx)
#define blockDim (::simt::block_dim)
#define gridDim (::simt::grid_dim)

/* The launch of common.cuh's AMPC_LAUNCH; the launching function names the site. */
#define SIMT_LAUNCH(kernel, grid, block, shared, stream) \
    ::simt::make_launcher(kernel, __func__, grid, block, shared, stream)

// ---- device functions ----

/* a macro, so that each barrier is named by its place in the source */
#define SIMT_STR2(x) #x
#define SIMT_STR(x) SIMT_STR2(x)
#define __syncthreads() ::simt::syncthreads(__FILE__ ":" SIMT_STR(__LINE__))

template <typename T>
T __shfl_sync(unsigned mask, T v, int src_lane)
{
    return simt::shuffle(mask, simt::SHFL_IDX, v, src_lane);
}

template <typename T>
T __shfl_down_sync(unsigned mask, T v, unsigned delta)
{
    return simt::shuffle(mask, simt::SHFL_DOWN, v, (int)delta);
}

inline unsigned __reduce_max_sync(unsigned mask, unsigned v)
{
    return (unsigned)simt::warp_collective(mask, simt::REDUCE_MAX, v, 0);
}

/* Fibers switch only at barriers and collectives, so a read-modify-write is atomic. */
inline unsigned int atomicMax(unsigned int *p, unsigned int v)
{
    unsigned int old = *p;
    if (v > old)
        *p = v;
    return old;
}

#endif /* AMPC_CUDA_EMU_SIMT_H */
