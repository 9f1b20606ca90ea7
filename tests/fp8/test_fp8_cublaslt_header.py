"""csrc/cuda/cublaslt.cuh declares the few cuBLASLt types, constants and functions the FP8
GEMM takes from the library at run time. This test compiles it next to the real
cublasLt.h (shipped with torch's CUDA wheels) and checks every constant, the layout of
the structs and the type of every function; a wrong value is checked to fail."""
import glob
import os
import shutil
import subprocess

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SITE = os.path.dirname(os.path.dirname(torch.__file__))
HEADERS = sorted(glob.glob(os.path.join(SITE, "nvidia", "*", "include", "cublasLt.h"))
                 + glob.glob(os.path.join(SITE, "nvidia", "cublas", "include", "cublasLt.h")))
NVCC = shutil.which("nvcc")


def cuda_include():
    """The toolkit's include folder (nvcc may be a wrapper script elsewhere)."""
    roots = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"]
    if NVCC:
        roots.append(os.path.dirname(os.path.dirname(os.path.realpath(NVCC))))
    for root in filter(None, roots):
        if os.path.exists(os.path.join(root, "include", "crt", "host_defines.h")):
            return os.path.join(root, "include")
    return None


CUDA_INCLUDE = cuda_include()

pytestmark = [
    pytest.mark.needs("g++"),
    pytest.mark.skipif(CUDA_INCLUDE is None, reason="no CUDA toolkit headers found"),
    pytest.mark.skipif(not HEADERS, reason="torch ships no cublasLt.h here (a CPU-only torch)"),
]

CONSTANTS = {
    "AMPC_LT_SUCCESS": "CUBLAS_STATUS_SUCCESS", "AMPC_LT_OP_N": "CUBLAS_OP_N",
    "AMPC_LT_OP_T": "CUBLAS_OP_T", "AMPC_LT_COMPUTE_32F": "CUBLAS_COMPUTE_32F",
    "AMPC_LT_DESC_TRANSA": "CUBLASLT_MATMUL_DESC_TRANSA",
    "AMPC_LT_DESC_TRANSB": "CUBLASLT_MATMUL_DESC_TRANSB",
    "AMPC_LT_DESC_EPILOGUE": "CUBLASLT_MATMUL_DESC_EPILOGUE",
    "AMPC_LT_DESC_BIAS_POINTER": "CUBLASLT_MATMUL_DESC_BIAS_POINTER",
    "AMPC_LT_DESC_A_SCALE_POINTER": "CUBLASLT_MATMUL_DESC_A_SCALE_POINTER",
    "AMPC_LT_DESC_B_SCALE_POINTER": "CUBLASLT_MATMUL_DESC_B_SCALE_POINTER",
    "AMPC_LT_DESC_AMAX_D_POINTER": "CUBLASLT_MATMUL_DESC_AMAX_D_POINTER",
    "AMPC_LT_DESC_BIAS_DATA_TYPE": "CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE",
    "AMPC_LT_EPILOGUE_DEFAULT": "CUBLASLT_EPILOGUE_DEFAULT",
    "AMPC_LT_EPILOGUE_BIAS": "CUBLASLT_EPILOGUE_BIAS",
    "AMPC_LT_PREF_MAX_WORKSPACE_BYTES": "CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES",
}
# struct ampc_lt_api's members and the functions they stand for, in order
FUNCTIONS = ["cublasLtCreate", "cublasLtMatmulDescCreate", "cublasLtMatmulDescDestroy",
             "cublasLtMatmulDescSetAttribute", "cublasLtMatrixLayoutCreate",
             "cublasLtMatrixLayoutDestroy", "cublasLtMatmulPreferenceCreate",
             "cublasLtMatmulPreferenceDestroy", "cublasLtMatmulPreferenceSetAttribute",
             "cublasLtMatmulAlgoGetHeuristic", "cublasLtMatmul", "cublasLtGetStatusString"]


def check_source(extra=""):
    lines = ['#include <cublasLt.h>', '#include "cuda/cublaslt.cuh"', '#include <cstddef>']
    for ours, theirs in CONSTANTS.items():
        lines.append(f'static_assert((int){ours} == (int){theirs}, "{ours}");')
    lines += [
        'static_assert(sizeof(ampc_lt_algo) == sizeof(cublasLtMatmulAlgo_t), "algo");',
        'static_assert(sizeof(ampc_lt_heuristic) == sizeof(cublasLtMatmulHeuristicResult_t), "h");',
        'static_assert(offsetof(ampc_lt_heuristic, workspace_size) == '
        'offsetof(cublasLtMatmulHeuristicResult_t, workspaceSize), "ws");',
        'static_assert(offsetof(ampc_lt_heuristic, state) == '
        'offsetof(cublasLtMatmulHeuristicResult_t, state), "state");',
        'static const char *names[] = { AMPC_LT_SYMBOLS };',
        f'static_assert(sizeof(names) / sizeof(names[0]) == {len(FUNCTIONS)}, "count");',
        'static_assert(sizeof(ampc_lt_api) == sizeof(names), "one pointer a function");',
    ]
    # each member's signature, with cuBLASLt's own types mapped to ours, is the function's
    lines.append("template <class T> struct sig;")
    lines.append("template <class R, class... A> struct sig<R (*)(A...)> { static const int n = sizeof...(A); };")
    for i, f in enumerate(FUNCTIONS):
        lines.append(f'static_assert(sig<decltype(&{f})>::n == '
                     f'sig<decltype(ampc_lt_api{{}}.{member(i)})>::n, "{f} arity");')
    return "\n".join(lines) + "\n" + extra


def member(i):
    return ["create", "desc_create", "desc_destroy", "desc_set", "layout_create",
            "layout_destroy", "pref_create", "pref_destroy", "pref_set", "heuristic", "matmul",
            "status_string"][i]


def compile_check(tmp_path, extra=""):
    src = tmp_path / "check.cpp"
    src.write_text(check_source(extra))
    # the toolkit's CUDA headers first: the wheel's copies lack some they include
    includes = ["-I", CUDA_INCLUDE, "-I", os.path.dirname(HEADERS[0]),
                "-I", os.path.join(ROOT, "csrc")]
    return subprocess.run(["g++", "-std=c++17", "-fsyntax-only", *includes, str(src)],
                          capture_output=True, text=True)


def test_declarations_match_cublaslt(tmp_path):
    result = compile_check(tmp_path)
    assert result.returncode == 0, result.stderr[-4000:]


def test_a_wrong_constant_fails(tmp_path):
    wrong = 'static_assert((int)AMPC_LT_DESC_AMAX_D_POINTER == (int)CUBLASLT_MATMUL_DESC_D_SCALE_POINTER, "drifted");\n'
    result = compile_check(tmp_path, wrong)
    assert result.returncode != 0
    assert "drifted" in result.stderr and result.stderr.count("error") == 1
