"""python -m ampc: what a bug report needs, one fact a line.

The versions (ampc, torch, Python), where ampc was imported from, the CPU and the SIMD
path ampc's kernels take on it next to torch's, and on the CUDA side whether ampc's CUDA
library loaded (and if not, why), the driver's and the runtime's CUDA versions, and the
GPUs torch sees. Paste the whole output into the report.
"""
import ctypes
import os
import platform
import sys

import torch

import ampc
from ampc import _lib, ops

# the CPU features ampc's paths and torch's bf16/fp16 matmuls depend on
_CPU_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_bf16", "avx512_fp16",
              "amx_tile", "amx_bf16")


def _cpuinfo():
    try:
        with open("/proc/cpuinfo") as f:
            text = f.read()
    except OSError:
        return {}
    info = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        info.setdefault(key.strip(), value.strip())
    return info


def cpu_model():
    return _cpuinfo().get("model name") or platform.processor() or platform.machine()


def cpu_flags():
    present = set(_cpuinfo().get("flags", "").split())
    return [f for f in _CPU_FLAGS if f in present]


def cuda_library_status(driver=None):
    """Whether ampc's CUDA library loaded and runs, and if not, why. ``driver`` is the
    driver's CUDA version from :func:`cuda_versions` when known: the library loads without
    a driver (it is linked against the runtime only), but then no kernel of it can run."""
    path = os.path.join(os.path.dirname(_lib.__file__), "libampc_cuda.so")
    if _lib.cuda_lib is not None:
        if driver == "none":
            return (f"loaded ({path}) but unusable: no NVIDIA driver, so its kernels cannot "
                    "run (CPU kernels only)")
        return f"loaded ({path})"
    if torch.version.cuda is None:
        return "not loaded: this torch is built without CUDA"
    if not os.path.exists(path):
        return ("not loaded: libampc_cuda.so was not built (nvcc was not on the PATH when "
                "ampc was built; CPU kernels only)")
    return f"not loaded: {_lib.cuda_refusal() or 'unknown reason'}"


def cuda_versions():
    """(driver, runtime) CUDA versions as ampc's CUDA library sees them, as strings; the
    driver is "none" without an NVIDIA driver. None when the library is not loaded."""
    if _lib.cuda_lib is None:
        return None
    api = _lib.cuda_lib.ampc_cuda_get_api()
    # the probe is the first entry of the table (csrc/api/ampc.h, struct ampc_cuda_api)
    probe_type = ctypes.CFUNCTYPE(None, ctypes.POINTER(ctypes.c_int),
                                  ctypes.POINTER(ctypes.c_int))
    probe = probe_type(ctypes.cast(api, ctypes.POINTER(ctypes.c_void_p))[0])
    driver, runtime = ctypes.c_int(0), ctypes.c_int(0)
    probe(ctypes.byref(driver), ctypes.byref(runtime))

    def version(v):
        return f"{v // 1000}.{v % 1000 // 10}" if v > 0 else "none"
    return version(driver.value), version(runtime.value)


def report():
    """The lines `python -m ampc` prints."""
    versions = cuda_versions()
    lines = [
        f"ampc {ampc.__version__} ({os.path.dirname(ampc.__file__)})",
        f"torch {torch.__version__} (CUDA {torch.version.cuda or 'none'}, "
        f"{os.path.dirname(torch.__file__)})",
        f"Python {platform.python_version()} ({sys.executable})",
        f"OS: {platform.platform()}",
        f"CPU: {cpu_model()}, {os.cpu_count()} logical CPUs",
        f"CPU flags: {' '.join(cpu_flags()) or 'none of ' + ' '.join(_CPU_FLAGS)}",
        f"ampc CPU path: {ops.cpu_isa()} (AMPC_CPU_ISA={os.environ.get('AMPC_CPU_ISA', 'unset')})",
        f"torch CPU capability: {torch.backends.cpu.get_cpu_capability()}",
        f"threads: {torch.get_num_threads()}",
        f"streaming stores above: {ops.stream_bytes()} bytes",
        f"ampc CUDA library: {cuda_library_status(versions and versions[0])}",
    ]
    if versions is not None:
        lines.append(f"CUDA driver: {versions[0]}, ampc's CUDA runtime: {versions[1]}")
    refusal = _lib.cuda_refusal() if _lib.cuda_lib is not None else None
    if refusal:
        lines.append(f"ampc CUDA calls refused: {refusal}")
    if torch.version.cuda is not None:
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        lines.append(f"GPUs torch sees: {count}")
        for i in range(count):
            major, minor = torch.cuda.get_device_capability(i)
            lines.append(f"  cuda:{i} {torch.cuda.get_device_name(i)} (sm_{major}{minor})")
    return lines


def main():
    print("\n".join(report()))


if __name__ == "__main__":
    main()
