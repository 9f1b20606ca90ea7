"""Loads ampc's C libraries into the running torch and registers torch.ops.ampc.*.

The libraries are linked without torch: their stable-ABI symbols resolve against the
libtorch that `import torch` loaded. torch loads its libraries privately
(RTLD_LOCAL), so they are first made global here; then libampc.so registers the ops
through the stable C ABI, and libampc_cuda.so, when torch has CUDA, hands its
launchers to it once its probe says they can run on this driver.

A CUDA library that fails to load or cannot run never breaks `import ampc`: it is
said once in a warning, CUDA calls are refused with the reason, CPU calls work.
"""
import ctypes
import os
import warnings

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


def _load_cuda(lib):
    """The CUDA library, its launchers handed to libampc; or None, with the reason kept
    by libampc (and, unless CUDA simply is not there, one warning)."""
    path = os.path.join(_HERE, "libampc_cuda.so")
    if torch.version.cuda is None or not os.path.exists(path):
        return None
    try:
        _make_global("libtorch_cuda.so")
        cuda = ctypes.CDLL(path)
        cuda.ampc_cuda_get_api.restype = ctypes.c_void_p
        api = cuda.ampc_cuda_get_api()
    except (OSError, ImportError, AttributeError) as e:
        why = f"ampc's CUDA library failed to load ({e})"
        lib.ampc_refuse_cuda(why.encode())
        warnings.warn(f"ampc: {why}; CUDA calls will be refused, CPU calls work",
                      RuntimeWarning, stacklevel=3)
        return None
    if lib.ampc_set_cuda_api(ctypes.c_void_p(api)) != 0:
        warnings.warn(f"ampc: {cuda_refusal()}; CUDA calls will be refused, CPU calls work",
                      RuntimeWarning, stacklevel=3)
        return None
    return cuda


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
    lib.ampc_refuse_cuda.argtypes = [ctypes.c_char_p]
    lib.ampc_set_cuda_api.argtypes = [ctypes.c_void_p]
    lib.ampc_cuda_refusal.restype = ctypes.c_char_p
    return lib


def cuda_refusal():
    """Why ampc's CUDA calls are refused, or None when they run."""
    why = lib.ampc_cuda_refusal()
    return None if why is None else why.decode()


# ---- CUDA emulation (tests only; docs/cuda-emulation.md) ----
def _load_emulated_cuda(lib, path):
    """The emulated CUDA library at `path` (AMPC_CUDA_EMU) in place of the real one: its
    launchers run the CUDA kernels on the CPU, reached by CPU tensors once
    lib.ampc_set_cuda_emulation(1) is called. Fails loudly: a test run asked for it."""
    cuda = ctypes.CDLL(path)
    cuda.ampc_cuda_get_api.restype = ctypes.c_void_p
    if lib.ampc_set_cuda_api(ctypes.c_void_p(cuda.ampc_cuda_get_api())) != 0:
        raise ImportError(f"ampc: the emulated CUDA library {path} was refused: {cuda_refusal()}")
    lib.ampc_set_cuda_emulation.argtypes = [ctypes.c_int]
    return cuda
# ---- end of CUDA emulation ----


lib = _load()
if os.environ.get("AMPC_CUDA_EMU"):
    cuda_lib = _load_emulated_cuda(lib, os.environ["AMPC_CUDA_EMU"])
else:
    cuda_lib = _load_cuda(lib)
HAS_CUDA_KERNELS = cuda_lib is not None
