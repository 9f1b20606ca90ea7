/*
 * fp8_gemm.cu: one FP8 GEMM through cuBLASLt (struct ampc_fp8_gemm_args in ampc.h).
 *
 * cuBLASLt is column-major and its FP8 kernels take only the "TN" layout (A transposed,
 * B not). Our row-major out[m, n] = a[m, k] @ b_t[n, k]^T is, read column-major, the
 * [n, m] matrix b_t^T-shaped: cuBLASLt's A is b_t (k x n, ld k, transposed), its B is a
 * (k x m, ld k), D is n x m with ld n. The dequantizing scales stay on the device
 * (A/B_SCALE_POINTER), so no value crosses to the host and the call can be captured in
 * a CUDA graph.
 *
 * The library is the libcublasLt torch already loaded (found by its soname), else the
 * one the dynamic loader finds; nothing of it is linked. One handle per device, made on
 * first use (so make the first call before a graph capture); the workspace comes from
 * the caller, one per device and stream.
 */
#include <dlfcn.h>
#include <library_types.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>

#include "common.cuh"
#include "cublaslt.cuh"

#define MAX_DEVICES 64

static pthread_once_t lt_once = PTHREAD_ONCE_INIT;   /* pthread, not std: no libstdc++ */
static struct ampc_lt_api lt;
static char lt_missing[512];

static void load_cublaslt(void)
{
    static const char *names[] = { "libcublasLt.so.13", "libcublasLt.so.12", "libcublasLt.so" };
    static const char *symbols[] = { AMPC_LT_SYMBOLS };
    const int n_names = (int)(sizeof(names) / sizeof(names[0]));
    void *lib = NULL;
    /* first the copy torch loaded (RTLD_NOLOAD: only if already in the process) */
    for (int pass = 0; pass < 2 && !lib; pass++)
        for (int i = 0; i < n_names && !lib; i++)
            lib = dlopen(names[i], RTLD_NOW | RTLD_LOCAL | (pass == 0 ? RTLD_NOLOAD : 0));
    if (!lib) {
        snprintf(lt_missing, sizeof(lt_missing), "cuBLASLt was not found: torch has not "
                 "loaded libcublasLt.so.13 or .12 and the loader cannot find it (%s)",
                 dlerror());
        return;
    }
    struct ampc_lt_api found;
    void **slot = (void **)&found;
    static_assert(sizeof(found) == sizeof(symbols) / sizeof(symbols[0]) * sizeof(void *),
                  "one symbol per function of struct ampc_lt_api");
    for (size_t i = 0; i < sizeof(symbols) / sizeof(symbols[0]); i++) {
        slot[i] = dlsym(lib, symbols[i]);
        if (!slot[i]) {
            snprintf(lt_missing, sizeof(lt_missing), "the cuBLASLt found has no %s; it "
                     "is too old for FP8 GEMMs", symbols[i]);
            return;
        }
    }
    lt = found;
}

static pthread_mutex_t devices_mutex = PTHREAD_MUTEX_INITIALIZER;
static ampc_lt_handle handles[MAX_DEVICES];
static int capability[MAX_DEVICES];     /* 10 * major + minor, 0 until asked */

static ampc_status lt_fail(const char *what, ampc_lt_status st)
{
    char msg[256];
    snprintf(msg, sizeof(msg), "cuBLASLt failed in %s: %s (status %d)", what,
             lt.status_string ? lt.status_string(st) : "?", st);
    return ampc_cuda_fail(AMPC_ERR_CUDA, msg);
}

/* The handle of device `dev` (made on first use), if it has FP8 tensor cores. */
static ampc_status device_handle_locked(int dev, ampc_lt_handle *out)
{
    ampc_status st = AMPC_OK;
    if (!capability[dev]) {
        int major = 0;
        int minor = 0;
        st = ampc_cuda_status(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
        if (st == AMPC_OK)
            st = ampc_cuda_status(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev));
        if (st != AMPC_OK)
            return st;
        capability[dev] = 10 * major + minor;
    }
    if (capability[dev] < 89) {
        char msg[256];
        snprintf(msg, sizeof(msg), "FP8 GEMMs need a GPU of compute capability 8.9 or newer "
                 "(Ada, Hopper, Blackwell); cuda:%d is sm_%d", dev, capability[dev]);
        return ampc_cuda_fail(AMPC_ERR_CUDA, msg);
    }
    if (!handles[dev]) {
        ampc_lt_status s = lt.create(&handles[dev]);
        if (s != AMPC_LT_SUCCESS) {
            handles[dev] = NULL;
            return lt_fail("cublasLtCreate", s);
        }
    }
    *out = handles[dev];
    return AMPC_OK;
}

/* The current device's handle. */
static ampc_status device_handle(ampc_lt_handle *out)
{
    int dev = 0;
    ampc_status st = ampc_cuda_status(cudaGetDevice(&dev));
    if (st != AMPC_OK)
        return st;
    if (dev < 0 || dev >= MAX_DEVICES)
        return ampc_cuda_fail(AMPC_ERR_CUDA, "more CUDA devices than ampc's FP8 GEMM keeps");
    pthread_mutex_lock(&devices_mutex);
    st = device_handle_locked(dev, out);
    pthread_mutex_unlock(&devices_mutex);
    return st;
}

/* Descriptors of one call, destroyed together. */
struct plan {
    ampc_lt_desc desc;
    ampc_lt_layout a, b, d;
    ampc_lt_pref pref;
};

static void plan_free(struct plan *p)
{
    if (p->desc)
        lt.desc_destroy(p->desc);
    if (p->a)
        lt.layout_destroy(p->a);
    if (p->b)
        lt.layout_destroy(p->b);
    if (p->d)
        lt.layout_destroy(p->d);
    if (p->pref)
        lt.pref_destroy(p->pref);
}

#define LT(call, what)                                                                    \
    do {                                                                                  \
        ampc_lt_status s_ = (call);                                                       \
        if (s_ != AMPC_LT_SUCCESS)                                                        \
            return lt_fail(what, s_);                                                     \
    } while (0)

static ampc_status plan_make(struct plan *p, const struct ampc_fp8_gemm_args *g)
{
    const int a_type = g->b_e5m2 ? CUDA_R_8F_E5M2 : CUDA_R_8F_E4M3;    /* cuBLASLt's A: b_t */
    const int b_type = g->a_e5m2 ? CUDA_R_8F_E5M2 : CUDA_R_8F_E4M3;    /* its B: a */
    const int d_type = g->out_dtype == AMPC_BF16 ? CUDA_R_16BF : CUDA_R_32F;
    const int32_t trans_a = AMPC_LT_OP_T;
    const int32_t trans_b = AMPC_LT_OP_N;
    const void *scale_a = g->scale_inv_b;
    const void *scale_b = g->scale_inv_a;
    const uint64_t workspace = (uint64_t)g->workspace_bytes;

    LT(lt.desc_create(&p->desc, AMPC_LT_COMPUTE_32F, CUDA_R_32F), "cublasLtMatmulDescCreate");
    LT(lt.desc_set(p->desc, AMPC_LT_DESC_TRANSA, &trans_a, sizeof(trans_a)), "TRANSA");
    LT(lt.desc_set(p->desc, AMPC_LT_DESC_TRANSB, &trans_b, sizeof(trans_b)), "TRANSB");
    LT(lt.desc_set(p->desc, AMPC_LT_DESC_A_SCALE_POINTER, &scale_a, sizeof(scale_a)),
       "A_SCALE_POINTER");
    LT(lt.desc_set(p->desc, AMPC_LT_DESC_B_SCALE_POINTER, &scale_b, sizeof(scale_b)),
       "B_SCALE_POINTER");
    if (g->bias) {
        const uint32_t epilogue = AMPC_LT_EPILOGUE_BIAS;
        const int32_t bias_type = CUDA_R_16BF;
        LT(lt.desc_set(p->desc, AMPC_LT_DESC_EPILOGUE, &epilogue, sizeof(epilogue)), "EPILOGUE");
        LT(lt.desc_set(p->desc, AMPC_LT_DESC_BIAS_POINTER, &g->bias, sizeof(g->bias)),
           "BIAS_POINTER");
        LT(lt.desc_set(p->desc, AMPC_LT_DESC_BIAS_DATA_TYPE, &bias_type, sizeof(bias_type)),
           "BIAS_DATA_TYPE");
    }
    LT(lt.layout_create(&p->a, a_type, (uint64_t)g->k, (uint64_t)g->n, g->k), "layout of b_t");
    LT(lt.layout_create(&p->b, b_type, (uint64_t)g->k, (uint64_t)g->m, g->k), "layout of a");
    LT(lt.layout_create(&p->d, d_type, (uint64_t)g->n, (uint64_t)g->m, g->n), "layout of out");
    LT(lt.pref_create(&p->pref), "cublasLtMatmulPreferenceCreate");
    LT(lt.pref_set(p->pref, AMPC_LT_PREF_MAX_WORKSPACE_BYTES, &workspace, sizeof(workspace)),
       "MAX_WORKSPACE_BYTES");
    return AMPC_OK;
}

/* Runs the planned GEMM; AMPC_ERR_CUDA with cuBLASLt's reason when it refuses. */
static ampc_status plan_run(const struct plan *p, ampc_lt_handle h,
                            const struct ampc_fp8_gemm_args *g, void *stream)
{
    ampc_lt_heuristic best;
    int found = 0;
    const float one = 1.0f;
    const float zero = 0.0f;
    memset(&best, 0, sizeof(best));
    LT(lt.heuristic(h, p->desc, p->a, p->b, p->d, p->d, p->pref, 1, &best, &found),
       "cublasLtMatmulAlgoGetHeuristic");
    if (found < 1 || best.state != AMPC_LT_SUCCESS)
        return ampc_cuda_fail(AMPC_ERR_CUDA, "cuBLASLt offers no FP8 algorithm for these "
                              "shapes, dtypes and workspace");
    LT(lt.matmul(h, p->desc, &one, g->b_t, p->a, g->a, p->b, &zero, g->out, p->d, g->out, p->d,
                 &best.algo, g->workspace, (size_t)g->workspace_bytes, stream),
       "cublasLtMatmul");
    return AMPC_OK;
}

extern "C" ampc_status ampc_fp8_gemm_cuda_impl(struct ampc_fp8_gemm_args *g, void *stream)
{
    ampc_lt_handle h = NULL;
    struct plan p;
    g->amax_written = 0;
    pthread_once(&lt_once, load_cublaslt);
    if (!lt.matmul)
        return ampc_cuda_fail(AMPC_ERR_CUDA, lt_missing);
    ampc_status st = device_handle(&h);
    if (st != AMPC_OK || g->m == 0)
        return st;
    memset(&p, 0, sizeof(p));
    st = plan_make(&p, g);
    /* the output amax from the epilogue where cuBLASLt offers it for this combination;
     * otherwise the GEMM runs without it and the caller computes it */
    if (st == AMPC_OK && g->amax) {
        const void *amax = g->amax;
        if (lt.desc_set(p.desc, AMPC_LT_DESC_AMAX_D_POINTER, &amax, sizeof(amax)) ==
                AMPC_LT_SUCCESS &&
            plan_run(&p, h, g, stream) == AMPC_OK) {
            g->amax_written = 1;
            plan_free(&p);
            return AMPC_OK;
        }
        const void *none = NULL;
        st = lt.desc_set(p.desc, AMPC_LT_DESC_AMAX_D_POINTER, &none, sizeof(none)) ==
                     AMPC_LT_SUCCESS ? AMPC_OK : lt_fail("AMAX_D_POINTER", 1);
    }
    if (st == AMPC_OK)
        st = plan_run(&p, h, g, stream);
    plan_free(&p);
    return st;
}
