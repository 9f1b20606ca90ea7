"""Loads ampc's C libraries into the running torch and registers torch.ops.ampc.*.

The libraries are linked without torch: their stable-ABI symbols resolve against the
libtorch that `import torch` loaded. torch loads its libraries privately
(RTLD_LOCAL), so they are first made global here; then libampc.so registers the ops
through the stable C ABI, and libampc_cuda.so, when torch has CUDA, hands its
launchers to it.
"""
import ctypes
import os

import torch

_HERE = os.path.dirname(os.path.abspath(__file__))
_TORCH_LIB = os.path.join(os.path.dirname(torch.__file__), "lib")
MIN_TORCH = (2, 10)


def _torch_version():
    return tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])


def _make_global(name):
    path = os.path.join(_TORCH_LIB, name)
    try:
        ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_GLOBAL)
    except OSError as e:
        raise ImportError(f"ampc: cannot reach torch's {name} ({e})") from e


def _load():
    if _torch_version() < MIN_TORCH:
        raise ImportError(f"ampc needs torch >= {MIN_TORCH[0]}.{MIN_TORCH[1]} "
                          f"(its stable C ABI), found {torch.__version__}")
    path = os.path.join(_HERE, "libampc.so")
    if not os.path.exists(path):
        raise ImportError(f"ampc: {path} is missing; build ampc with `pip install .`")
    _make_global("libtorch_cpu.so")
    torch.ops.load_library(path)
    lib = ctypes.CDLL(path)
    rc = lib.ampc_register()
    if rc != 0:
        raise ImportError(f"ampc: registering torch.ops.ampc failed at step {rc}")
    cuda = None
    cuda_path = os.path.join(_HERE, "libampc_cuda.so")
    if torch.version.cuda is not None and os.path.exists(cuda_path):
        _make_global("libtorch_cuda.so")
        cuda = ctypes.CDLL(cuda_path)
        cuda.ampc_cuda_get_api.restype = ctypes.c_void_p
        lib.ampc_set_cuda_api.argtypes = [ctypes.c_void_p]
        lib.ampc_set_cuda_api(cuda.ampc_cuda_get_api())
    return lib, cuda


lib, cuda_lib = _load()
HAS_CUDA_KERNELS = cuda_lib is not None
