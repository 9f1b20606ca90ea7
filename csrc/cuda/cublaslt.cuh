/*
 * cublaslt.cuh: our declarations of the few cuBLASLt types, constants and functions the
 * FP8 GEMM uses. cuBLASLt is not linked: fp8_gemm.cu finds the library torch already
 * loaded at run time and takes these functions from it, so the build needs neither its
 * headers nor the library. tests/test_fp8_cublaslt_header.py compiles this file next to
 * the real cublasLt.h (where torch's CUDA wheels ship it) and checks every value and
 * layout, so a drift is a test failure.
 */
#ifndef AMPC_CUBLASLT_CUH
#define AMPC_CUBLASLT_CUH

#include <stddef.h>
#include <stdint.h>

typedef int ampc_lt_status;                 /* cublasStatus_t; 0 = success */
typedef struct ampc_lt_context *ampc_lt_handle;
typedef void *ampc_lt_desc;                 /* cublasLtMatmulDesc_t */
typedef void *ampc_lt_layout;               /* cublasLtMatrixLayout_t */
typedef void *ampc_lt_pref;                 /* cublasLtMatmulPreference_t */

typedef struct {
    uint64_t data[8];
} ampc_lt_algo;                             /* cublasLtMatmulAlgo_t */

typedef struct {
    ampc_lt_algo algo;
    size_t workspace_size;
    ampc_lt_status state;
    float waves_count;
    int reserved[4];
} ampc_lt_heuristic;                        /* cublasLtMatmulHeuristicResult_t */

enum {
    AMPC_LT_SUCCESS = 0,                    /* CUBLAS_STATUS_SUCCESS */
    AMPC_LT_OP_N = 0,                       /* CUBLAS_OP_N */
    AMPC_LT_OP_T = 1,                       /* CUBLAS_OP_T */
    AMPC_LT_COMPUTE_32F = 68,               /* CUBLAS_COMPUTE_32F */
    AMPC_LT_DESC_TRANSA = 3,                /* CUBLASLT_MATMUL_DESC_TRANSA */
    AMPC_LT_DESC_TRANSB = 4,
    AMPC_LT_DESC_EPILOGUE = 7,
    AMPC_LT_DESC_BIAS_POINTER = 8,
    AMPC_LT_DESC_A_SCALE_POINTER = 17,
    AMPC_LT_DESC_B_SCALE_POINTER = 18,
    AMPC_LT_DESC_AMAX_D_POINTER = 21,
    AMPC_LT_DESC_BIAS_DATA_TYPE = 26,
    AMPC_LT_EPILOGUE_DEFAULT = 1,           /* CUBLASLT_EPILOGUE_DEFAULT */
    AMPC_LT_EPILOGUE_BIAS = 4,
    AMPC_LT_PREF_MAX_WORKSPACE_BYTES = 1,   /* CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES */
};

/* The functions, by the names cuBLASLt exports; cudaDataType and cudaStream_t as int and
 * void * (the ABI is the same). */
struct ampc_lt_api {
    ampc_lt_status (*create)(ampc_lt_handle *handle);
    ampc_lt_status (*desc_create)(ampc_lt_desc *desc, int compute_type, int scale_type);
    ampc_lt_status (*desc_destroy)(ampc_lt_desc desc);
    ampc_lt_status (*desc_set)(ampc_lt_desc desc, int attr, const void *buf, size_t size);
    ampc_lt_status (*layout_create)(ampc_lt_layout *layout, int type, uint64_t rows,
                                    uint64_t cols, int64_t ld);
    ampc_lt_status (*layout_destroy)(ampc_lt_layout layout);
    ampc_lt_status (*pref_create)(ampc_lt_pref *pref);
    ampc_lt_status (*pref_destroy)(ampc_lt_pref pref);
    ampc_lt_status (*pref_set)(ampc_lt_pref pref, int attr, const void *buf, size_t size);
    ampc_lt_status (*heuristic)(ampc_lt_handle handle, ampc_lt_desc desc, ampc_lt_layout a,
                                ampc_lt_layout b, ampc_lt_layout c, ampc_lt_layout d,
                                ampc_lt_pref pref, int requested, ampc_lt_heuristic *results,
                                int *returned);
    ampc_lt_status (*matmul)(ampc_lt_handle handle, ampc_lt_desc desc, const void *alpha,
                             const void *a, ampc_lt_layout a_desc, const void *b,
                             ampc_lt_layout b_desc, const void *beta, const void *c,
                             ampc_lt_layout c_desc, void *d, ampc_lt_layout d_desc,
                             const ampc_lt_algo *algo, void *workspace, size_t workspace_size,
                             void *stream);
    const char *(*status_string)(ampc_lt_status status);
};

/* Exported names, in the order of struct ampc_lt_api. */
#define AMPC_LT_SYMBOLS                                                                  \
    "cublasLtCreate", "cublasLtMatmulDescCreate", "cublasLtMatmulDescDestroy",            \
    "cublasLtMatmulDescSetAttribute", "cublasLtMatrixLayoutCreate",                       \
    "cublasLtMatrixLayoutDestroy", "cublasLtMatmulPreferenceCreate",                      \
    "cublasLtMatmulPreferenceDestroy", "cublasLtMatmulPreferenceSetAttribute",            \
    "cublasLtMatmulAlgoGetHeuristic", "cublasLtMatmul", "cublasLtGetStatusString"

#endif /* AMPC_CUBLASLT_CUH */
