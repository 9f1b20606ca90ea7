"""Loading the CUDA library never breaks `import ampc`: a library that fails to load, or a
driver older than the CUDA runtime the library links statically, is said once in a
warning, CUDA calls are refused with the reason (driver and runtime versions named), and
CPU calls work. Each case runs in a fresh process, with the failure simulated by a
ctypes.CDLL that fails to load the library or hands out a version probe of our own (the
first entry of the library's table, the only one read before the table is accepted)."""
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CUDA_LIB = os.path.join(ROOT, "ampc", "libampc_cuda.so")

pytestmark = pytest.mark.skipif(
    torch.version.cuda is None or not os.path.exists(CUDA_LIB),
    reason="needs torch with CUDA and ampc's CUDA library")

SIMULATE = r"""
import ctypes, sys, warnings
real_cdll = ctypes.CDLL
PROBE = ctypes.CFUNCTYPE(None, ctypes.POINTER(ctypes.c_int), ctypes.POINTER(ctypes.c_int))

@PROBE
def old_driver(driver, runtime):
    driver[0], runtime[0] = 12040, 13000        # a CUDA 12.4 driver, a 13.0 runtime

table = (ctypes.c_void_p * 1)(ctypes.cast(old_driver, ctypes.c_void_p))

class Getter:
    restype = None
    def __call__(self):
        return ctypes.addressof(table)

class FakeCudaLibrary:
    ampc_cuda_get_api = Getter()

def cdll(name, *args, **kwargs):
    if str(name).endswith("libampc_cuda.so"):
        if sys.argv[1] == "load":
            raise OSError("libampc_cuda.so: cannot open shared object file (simulated)")
        return FakeCudaLibrary()
    return real_cdll(name, *args, **kwargs)

if sys.argv[1] != "real":
    ctypes.CDLL = cdll
with warnings.catch_warnings(record=True) as seen:
    warnings.simplefilter("always")
    import torch, ampc
print("warnings:", len(seen))
for w in seen:
    print("warning:", w.category.__name__, w.message)
print("has_cuda_kernels:", ampc._lib.HAS_CUDA_KERNELS)
print("refusal:", ampc._lib.cuda_refusal())
(y,) = ampc.ops.cast([torch.tensor([1.0, 2.5])], torch.bfloat16)
assert y.tolist() == [1.0, 2.5]
if sys.argv[2:] == ["cuda"]:
    try:
        ampc.ops.cast([torch.ones(3, device="cuda")], torch.bfloat16)
        print("cuda: ran")
    except RuntimeError as e:
        print("cuda:", e)
print("cpu ok")
"""


def run(case, *extra):
    out = subprocess.run([sys.executable, "-c", SIMULATE, case, *extra], capture_output=True,
                         text=True, timeout=120, cwd=ROOT,
                         env=dict(os.environ, PYTHONPATH=ROOT))
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def test_cuda_library_that_fails_to_load_leaves_cpu_working():
    out = run("load")
    assert "warnings: 1\n" in out
    assert "warning: RuntimeWarning ampc: ampc's CUDA library failed to load (" in out
    assert "(simulated)); CUDA calls will be refused, CPU calls work" in out
    assert "has_cuda_kernels: False" in out
    assert "refusal: ampc's CUDA library failed to load" in out
    assert out.endswith("cpu ok\n")


def test_driver_older_than_the_runtime_warns_once_and_names_both_versions():
    out = run("old-driver")
    assert "warnings: 1\n" in out
    assert ("ampc's CUDA kernels cannot run: they were built with CUDA runtime 13.0, which "
            "needs a driver for CUDA 13.0 or newer, and the NVIDIA driver supports CUDA 12.4") in out
    assert "has_cuda_kernels: False" in out
    assert out.endswith("cpu ok\n")


def test_real_library_loads_without_a_word():
    # here: the library and its probe as built; no driver (a CPU-only machine) or a
    # recent one both hand the table over, silently
    out = run("real")
    assert "warnings: 0\n" in out and "has_cuda_kernels: True" in out and "refusal: None" in out


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_call_refused_with_both_versions_cuda():
    out = run("old-driver", "cuda")
    assert ("cuda: ampc.cast: ampc's CUDA kernels cannot run: they were built with CUDA "
            "runtime 13.0") in out
    assert "the NVIDIA driver supports CUDA 12.4" in out
    out = run("load", "cuda")
    assert "cuda: ampc.cast: ampc's CUDA library failed to load" in out
