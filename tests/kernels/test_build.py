"""What the build produced: plain C libraries on torch's stable C ABI only, the CUDA
library whenever nvcc is there, and both loaded into the running torch."""
import ctypes
import glob
import os
import re
import shutil
import subprocess

import pytest
import torch

import ampc

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LIB = os.path.join(ROOT, "ampc", "libampc.so")
CUDA_LIB = os.path.join(ROOT, "ampc", "libampc_cuda.so")
# the one list of kernels and ops that registration and the CUDA table are generated from
OPS_LIST = os.path.join(ROOT, "csrc", "api", "ampc_ops.h")
# the stable C ABI, libc/libm and the gcc runtime; nothing from ATen or c10
ALLOWED_UNDEFINED = re.compile(r"^(aoti_torch_\w+|torch_\w+|_ITM_\w+|__gmon_start__|__cxa_finalize"
                               r"|__cpu_\w+|[a-z_0-9]+@GLIBC\S*|[a-z_0-9]+@GCC\S*)$")


def symbols(path, kind):
    out = subprocess.run(["nm", "-D", kind, path], check=True, capture_output=True,
                         text=True).stdout
    return [line.split()[-1] for line in out.splitlines() if line.strip()]


needs_nm = pytest.mark.needs("nm")


def listed(kind):
    """The names of the AMPC_OP, AMPC_KERNEL or AMPC_CUDA_KERNEL entries of the list."""
    with open(OPS_LIST) as f:
        return re.findall(rf"^{kind}\((\w+),", f.read(), flags=re.M)


@pytest.mark.smoke
@needs_nm
def test_library_exports_only_its_entry_points():
    exported = [s for s in symbols(LIB, "--defined-only") if not s.startswith("_")]
    assert sorted(exported) == ["ampc_cache_bytes", "ampc_cpu_isa_name", "ampc_cuda_refusal",
                                "ampc_refuse_cuda", "ampc_register", "ampc_set_cuda_api",
                                "ampc_set_cuda_emulation"]


@pytest.mark.smoke
@needs_nm
def test_library_needs_only_the_stable_abi():
    undefined = symbols(LIB, "--undefined-only")
    assert any(s.startswith("torch_library_impl") for s in undefined)
    bad = [s for s in undefined if not ALLOWED_UNDEFINED.match(s)]
    assert bad == [], f"symbols outside torch's stable C ABI: {bad}"


def test_sources_use_no_aten_cpp_api():
    banned = re.compile(r'#include\s*[<"](torch/extension\.h|ATen/|c10/|torch/library\.h)'
                        r"|at::Tensor|TORCH_LIBRARY")
    for path in glob.glob(os.path.join(ROOT, "csrc", "**", "*.*"), recursive=True):
        with open(path) as f:
            assert not banned.search(f.read()), path


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on the PATH")
def test_cuda_library_was_built_with_nvcc_present():
    # a CUDA source that does not compile fails the build; this catches a silent skip
    assert os.path.exists(CUDA_LIB)


@needs_nm
@pytest.mark.skipif(not os.path.exists(CUDA_LIB), reason="built without nvcc")
def test_cuda_library_exports_its_table_only():
    exported = [s for s in symbols(CUDA_LIB, "--defined-only") if not s.startswith("_")]
    assert exported == ["ampc_cuda_get_api"]
    torch_symbols = [s for s in symbols(CUDA_LIB, "--undefined-only")
                     if "torch" in s or s.startswith("_Z")]
    assert all(s.startswith("aoti_torch_") for s in torch_symbols), torch_symbols


@pytest.mark.smoke
def test_cuda_kernels_loaded_exactly_when_torch_has_cuda():
    expected = torch.version.cuda is not None and os.path.exists(CUDA_LIB)
    assert ampc._lib.HAS_CUDA_KERNELS == expected


@pytest.mark.smoke
def test_ops_registered_for_cpu_and_cuda():
    ops = listed("AMPC_OP")
    assert "cast" in ops and len(set(ops)) == len(ops), ops
    registered = [n.split("::")[1] for n in torch._C._dispatch_get_all_op_names()
                  if n.startswith("ampc::")]
    assert sorted(registered) == sorted(ops)
    for op in ops:
        packet = getattr(torch.ops.ampc, op)
        for key in ("CPU", "CUDA"):
            assert torch._C._dispatch_has_kernel_for_dispatch_key(packet.default.name(), key), (op, key)


@pytest.mark.skipif(not ampc._lib.HAS_CUDA_KERNELS, reason="no CUDA library loaded")
def test_cuda_table_fills_every_slot_of_the_list():
    # probe, begin, end and last_error, then one launcher per kernel of the list
    kernels = listed("AMPC_KERNEL") + listed("AMPC_CUDA_KERNEL")
    assert "cast" in kernels and "fp8_gemm" in kernels, kernels
    get_api = ctypes.CDLL(CUDA_LIB).ampc_cuda_get_api   # its own handle: restype is ours
    get_api.restype = ctypes.POINTER(ctypes.c_void_p * (4 + len(kernels)))
    slots = list(get_api().contents)
    assert all(slots), slots
    assert len(set(slots)) == len(slots)
