"""ampc: mixed-precision training for PyTorch with a C core.

The kernels are registered as torch.ops.ampc.*; ampc.ops wraps them.

``import ampc`` costs little beyond ``import torch``: ampc.fp8 (which needs torch._dynamo)
ampc.validate, ampc.autoprecision and ampc.memory are imported on first use, and
torch.distributed.tensor only by whoever makes a DTensor (tests/test_import_cost.py holds this).
Every public module is an attribute after a plain ``import ampc`` (the docs' blocks, each run
alone in a fresh process by tests/demo/test_docs.py, hold this).
"""
import importlib

from . import _lib  # noqa: F401  (registers torch.ops.ampc.*)
from . import ops
from . import optim
from .master import fp32_state_dict, prepare
from .grad_scaler import GradScaler
from . import policy
from . import lean_state    # small: its code is ampc.optim's, already loaded
from . import integrations  # imports no framework until one of its modules is used
from .amp import (autocast, clear_autocast_cache, custom_bwd, custom_fwd, get_autocast_dtype,
                  is_autocast_available, is_autocast_cache_enabled, is_autocast_enabled,
                  set_autocast_dtype)

__all__ = ["GradScaler", "fp32_state_dict", "ops", "optim", "prepare", "policy", "lean_state",
           "integrations", "autocast", "custom_fwd", "custom_bwd", "is_autocast_available",
           "is_autocast_enabled", "get_autocast_dtype", "set_autocast_dtype",
           "is_autocast_cache_enabled", "clear_autocast_cache", "fp8", "validate", "autoprecision",
           "memory"]
__version__ = "0.1.0"

# imported on first use: fp8 needs torch._dynamo (longer to import than all the rest of ampc);
# validate, autoprecision and memory are tools that a plain training script does not need
_LAZY = ("fp8", "validate", "autoprecision", "memory")


def __getattr__(name):
    if name in _LAZY:
        return importlib.import_module(f".{name}", __name__)   # also binds ampc.<name>
    raise AttributeError(f"module 'ampc' has no attribute '{name}'")


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
