"""Builds ampc's two shared libraries; neither needs torch to build.

ampc/libampc.so       the CPU kernels (csrc/cpu/*.c) and the torch glue (csrc/torch/*.c),
                      compiled as C11.
ampc/libampc_cuda.so  the CUDA kernels (csrc/cuda/*.cu), only when nvcc is on the PATH
                      and AMPC_NO_CUDA=1 is not set (the CUDA build takes minutes).

csrc/ is in layers, each a folder on the include path: api/ (the C API and the list of
ops), math/ (per-element math shared by C and CUDA), cpu/, cuda/ and torch/.

Both are loaded with ctypes by ampc/_lib.py after `import torch`, and resolve torch's
stable C ABI symbols against the libtorch that is already loaded, so one build works
with every torch from 2.10 on. DEBUG=1 builds with -O0 -g.
"""
import glob
import os
import re
import shutil
import subprocess

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

DEBUG = os.environ.get("DEBUG") == "1"
# AMPC_NO_CUDA=1: the CPU library only, even with nvcc on the PATH
NO_CUDA = os.environ.get("AMPC_NO_CUDA") == "1"
C_SOURCES = sorted(glob.glob("csrc/cpu/*.c") + glob.glob("csrc/torch/*.c"))
C_INCLUDES = ["csrc/api", "csrc/math", "csrc/cpu", "csrc/torch"]
HEADERS = sorted(glob.glob("csrc/*/*.h"))
# the CUDA files include the api and math headers (and torch_shim.h) by bare name
CUDA_INCLUDES = ["csrc/api", "csrc/math", "csrc/torch"]
CUDA_HEADERS = sorted(glob.glob("csrc/api/*.h") + glob.glob("csrc/math/*.h")
                      + glob.glob("csrc/cuda/*.cuh")) + ["csrc/torch/torch_shim.h"]
# -std=c11 also turns off FMA contraction, which the Adam kernel's exact order relies on;
# -fno-math-errno lets sqrtf be one instruction
C_FLAGS = ["-std=c11", "-fexceptions", "-fno-math-errno", "-fopenmp-simd", "-fvisibility=hidden",
           "-Wall", "-Wextra", "-Wno-unused-parameter"] + (["-O0", "-g"] if DEBUG else ["-O3"])
# --fmad=false: no a * b + c contracted into an FMA (only the explicit fmaf of adam.h), so
# the kernels round every operation as the C build does and match the CPU bit for bit
NVCC_FLAGS = ["-std=c++17", "--fmad=false", "-Xcompiler", "-fPIC,-fvisibility=hidden",
              "-gencode", "arch=compute_80,code=sm_80",
              "-gencode", "arch=compute_90,code=sm_90",
              "-gencode", "arch=compute_90,code=compute_90"] + \
    [f"-I{d}" for d in CUDA_INCLUDES] + (["-O0", "-g"] if DEBUG else ["-O3"])


def warn_on_cuda_mismatch(nvcc):
    """The CUDA library links nvcc's runtime statically: it needs a driver at least as new
    as that runtime's major version, which torch's own CUDA does not guarantee."""
    out = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout
    found = re.search(r"release (\d+)\.(\d+)", out)
    try:
        import torch
        torch_cuda = torch.version.cuda
    except ImportError:
        return
    if not found or not torch_cuda:
        return
    if found.group(1) != torch_cuda.split(".")[0]:
        print(f"ampc: warning: nvcc is CUDA {found.group(1)}.{found.group(2)} and torch was "
              f"built with CUDA {torch_cuda}: ampc's CUDA kernels will need a driver for CUDA "
              f"{found.group(1)}, torch's a driver for CUDA {torch_cuda.split('.')[0]} (at import, "
              f"ampc refuses its CUDA calls when the driver is older than its runtime)")


class BuildLibraries(build_ext):
    """Plain shared libraries (no Python module init), named libampc*.so."""

    def get_ext_filename(self, ext_name):
        return os.path.join(*ext_name.split(".")) + ".so"

    def run(self):
        # setuptools clears `inplace` while it builds (it copies the registered libraries
        # into the tree afterwards, which does not cover the CUDA one): remember it here
        self.cuda_in_tree = bool(self.inplace or getattr(self, "editable_mode", False))
        super().run()

    def build_extensions(self):
        # distutils adds Python's own CFLAGS (-O2, -DNDEBUG ...); keep only what we ask for
        self.compiler.compiler_so = [self.compiler.compiler_so[0], "-fPIC"]
        super().build_extensions()
        self.build_cuda()

    def build_cuda(self):
        nvcc = shutil.which("nvcc")
        sources = sorted(glob.glob("csrc/cuda/*.cu"))
        if not sources:
            return
        if NO_CUDA:
            print("ampc: AMPC_NO_CUDA=1, building the CPU kernels only")
            return
        if nvcc is None:
            print("ampc: nvcc not found, building the CPU kernels only")
            return
        warn_on_cuda_mismatch(nvcc)
        # in place (and for editable installs) next to the sources, else into the wheel
        in_tree = getattr(self, "cuda_in_tree", False)
        out = os.path.join("." if in_tree else self.build_lib, "ampc", "libampc_cuda.so")
        tmp = os.path.join(self.build_temp, "cuda")
        os.makedirs(tmp, exist_ok=True)
        os.makedirs(os.path.dirname(out), exist_ok=True)
        objects = []
        for src in sources:
            obj = os.path.join(tmp, os.path.basename(src) + ".o")
            deps = [src] + CUDA_HEADERS
            if not os.path.exists(obj) or os.path.getmtime(obj) < max(map(os.path.getmtime, deps)):
                print(f"nvcc {src}")
                subprocess.check_call([nvcc, *NVCC_FLAGS, "-c", src, "-o", obj])
            objects.append(obj)
        subprocess.check_call([nvcc, "-shared", "-o", out, *objects])


setup(
    ext_modules=[
        Extension("ampc.libampc", sources=C_SOURCES,
                  include_dirs=C_INCLUDES, depends=HEADERS,
                  extra_compile_args=C_FLAGS,
                  extra_link_args=["-lm"]),
    ],
    cmdclass={"build_ext": BuildLibraries},
)
