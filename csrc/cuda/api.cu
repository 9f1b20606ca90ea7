/*
 * api.cu: the one exported symbol of the CUDA library, ampc_cuda_get_api(), which hands
 * the binding a table of the launchers (struct ampc_cuda_api in ampc.h), plus device
 * selection and the per-thread text of the last error.
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

// ---- device and stream ----

/* Makes `device` current and returns the previous one and torch's current stream on it. */
static ampc_status begin(int device, int *prev_device, void **stream)
{
    ampc_status st = ampc_cuda_status(cudaGetDevice(prev_device));
    if (st != AMPC_OK)
        return st;
    if (*prev_device != device) {
        st = ampc_cuda_status(cudaSetDevice(device));
        if (st != AMPC_OK)
            return st;
    }
    if (aoti_torch_get_current_cuda_stream(device, stream) != 0) {
        if (*prev_device != device)
            cudaSetDevice(*prev_device);
        return ampc_cuda_fail(AMPC_ERR_CUDA, "could not get torch's current CUDA stream");
    }
    return AMPC_OK;
}

static void end(int prev_device)
{
    int device = prev_device;
    cudaGetDevice(&device);
    if (device != prev_device)
        cudaSetDevice(prev_device);
}

// ---- the table ----

static const struct ampc_cuda_api api = {
    begin,
    end,
    ampc_cast_cuda_impl,
    ampc_unscale_check_cuda_impl,
    ampc_check_norm_cuda_impl,
    ampc_update_scale_cuda_impl,
    ampc_adam_cuda_impl,
    ampc_cuda_last_error,
};

extern "C" __attribute__((visibility("default"))) const struct ampc_cuda_api *
ampc_cuda_get_api(void)
{
    return &api;
}
