/*
 * api.cu: the one exported symbol of the CUDA library, ampc_cuda_get_api(), which hands
 * the torch glue a table of the launchers (struct ampc_cuda_api in ampc.h), plus the version
 * probe, device selection and the per-thread text of the last error.
 *
 * The library is loaded at run time and only when torch has CUDA, so the CPU build never
 * depends on it; everything but the table getter is hidden. No launcher synchronizes with
 * the host or calls cudaMalloc, so all of them can run inside CUDA graph capture.
 */
#include <stdio.h>

#include "common.cuh"

// ---- errors ----

/* Per thread: two threads may run ops on two devices at once. */
static thread_local char last_error[256] = "no error";

ampc_status ampc_cuda_status(cudaError_t err)
{
    if (err == cudaSuccess)
        return AMPC_OK;
    snprintf(last_error, sizeof(last_error), "%s (%s)", cudaGetErrorString(err),
             cudaGetErrorName(err));
    return AMPC_ERR_CUDA;
}

ampc_status ampc_cuda_fail(ampc_status st, const char *msg)
{
    snprintf(last_error, sizeof(last_error), "%s", msg);
    return st;
}

const char *ampc_cuda_last_error(void)
{
    return last_error;
}

// ---- versions ----

static void probe(int *driver_version, int *runtime_version)
{
    *driver_version = 0;
    *runtime_version = CUDART_VERSION;
    if (cudaDriverGetVersion(driver_version) != cudaSuccess)
        *driver_version = 0;
    cudaRuntimeGetVersion(runtime_version);
}

// ---- device and stream ----

/*
 * torch's CUDAGuard (through the stable ABI) switches devices as torch does: it leaves a
 * thread's device alone when it already is the one asked for, so no context is created on
 * GPU 0 by a thread that never uses it, and deleting it restores the previous device. Our
 * static runtime launches into whatever context the guard made current.
 */
static ampc_status begin(int device, void **guard, void **stream)
{
    CUDAGuardHandle g = NULL;
    ampc_status st;

    *guard = NULL;
    cudaGetLastError();         /* an error of earlier work is not this op's */
    st = ampc_cuda_status(cudaPeekAtLastError());   /* a sticky one: the context is broken */
    if (st != AMPC_OK)
        return st;
    if (aoti_torch_create_cuda_guard(device, &g) != 0) {
        char msg[64];
        snprintf(msg, sizeof(msg), "torch could not make cuda:%d current", device);
        return ampc_cuda_fail(AMPC_ERR_CUDA, msg);
    }
    if (aoti_torch_get_current_cuda_stream(device, stream) != 0) {
        aoti_torch_delete_cuda_guard(g);
        return ampc_cuda_fail(AMPC_ERR_CUDA, "could not get torch's current CUDA stream");
    }
    *guard = g;
    return AMPC_OK;
}

static void end(void *guard)
{
    if (guard)
        aoti_torch_delete_cuda_guard((CUDAGuardHandle)guard);
}

// ---- the table ----

/* Filled slot by slot by name from the list of kernels, so the order of the struct's
 * members can never put a launcher in another's slot. */
static struct ampc_cuda_api make_api(void)
{
    struct ampc_cuda_api a = {};
    a.probe = probe;
    a.begin = begin;
    a.end = end;
    a.last_error = ampc_cuda_last_error;
#define AMPC_KERNEL(name, ...) a.name = ampc_##name##_cuda_impl;
#define AMPC_CUDA_KERNEL(name, ...) AMPC_KERNEL(name, __VA_ARGS__)
#include "ampc_ops.h"
    return a;
}

static const struct ampc_cuda_api api = make_api();

extern "C" __attribute__((visibility("default"))) const struct ampc_cuda_api *
ampc_cuda_get_api(void)
{
    return &api;
}
