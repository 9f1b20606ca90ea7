/*
 * no_cublaslt.cpp: the FP8 GEMM of the emulation build. fp8_gemm.cu is a cuBLASLt call,
 * nothing of it runs on a CPU, so the emulated library refuses it (a real GPU tests it).
 */
#include "../common.cuh"

extern "C" ampc_status ampc_fp8_gemm_cuda_impl(struct ampc_fp8_gemm_args *args, void *stream)
{
    return ampc_cuda_fail(AMPC_ERR_CUDA, "the FP8 GEMM is cuBLASLt's: it runs on a GPU only, "
                                         "not in the CUDA emulation");
}
