/*
 * cuda_lib.c: the CUDA library's table of launchers (ampc_cuda_get_api in cuda/api.cu) as
 * the torch glue holds it, handed over by ampc/_lib.py once loaded, or the reason why CUDA
 * calls are refused.
 */
#include <stdio.h>

#include "call.h"

#define EXPORT __attribute__((visibility("default")))

const struct ampc_cuda_api *g_cuda;
char g_cuda_refusal[512] = "this build of ampc has no CUDA kernels (nvcc was not found when "
                           "it was built)";

/* CUDA calls are refused with this reason (the loader could not load the CUDA library). */
EXPORT void ampc_refuse_cuda(const char *why)
{
    g_cuda = NULL;
    g_cuda_emulation = 0;
    snprintf(g_cuda_refusal, sizeof(g_cuda_refusal), "%s", why);
}

/* The reason CUDA calls are refused, or NULL when they run. */
EXPORT const char *ampc_cuda_refusal(void)
{
    return g_cuda ? NULL : g_cuda_refusal;
}

/*
 * Hands over the CUDA library's launchers (cuda/api.cu) once its probe says they can
 * run: the library links its CUDA runtime statically, and a runtime newer than the driver
 * fails every call ("CUDA driver version is insufficient") while torch, built for another
 * CUDA, works. Returns 0 when handed over (also without a driver: no CUDA tensor can
 * exist then), 1 when the driver is too old for the runtime (the loader warns once).
 */
EXPORT int ampc_set_cuda_api(const struct ampc_cuda_api *api)
{
    int driver = 0;
    int runtime = 0;
    api->probe(&driver, &runtime);
    if (driver > 0 && driver / 1000 < runtime / 1000) {
        snprintf(g_cuda_refusal, sizeof(g_cuda_refusal),
                 "ampc's CUDA kernels cannot run: they were built with CUDA runtime %d.%d, "
                 "which needs a driver for CUDA %d.0 or newer, and the NVIDIA driver supports "
                 "CUDA %d.%d; update the driver, or rebuild ampc with a CUDA toolkit of major "
                 "version %d", runtime / 1000, runtime % 1000 / 10, runtime / 1000,
                 driver / 1000, driver % 1000 / 10, driver / 1000);
        g_cuda = NULL;
        g_cuda_emulation = 0;
        return 1;
    }
    g_cuda = api;
    return 0;
}

// ---- CUDA emulation (tests only; docs/cuda-emulation.md) ----
/* With the emulated CUDA library loaded as the CUDA library (AMPC_CUDA_EMU), set to 1:
 * calls on CPU tensors run the CUDA launchers, which the emulation runs on the CPU. */
int g_cuda_emulation;

/* 0 when set; -1 when on is asked and no CUDA library is loaded. */
EXPORT int ampc_set_cuda_emulation(int on)
{
    if (on && !g_cuda)
        return -1;
    g_cuda_emulation = on != 0;
    return 0;
}
