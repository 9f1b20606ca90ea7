"""ampc: mixed-precision training for PyTorch with a C core.

The kernels are registered as torch.ops.ampc.*; ampc.ops wraps them.
"""
from . import _lib  # noqa: F401  (registers torch.ops.ampc.*)
from . import ops
from . import optim
from .master import fp32_state_dict, prepare
from .grad_scaler import GradScaler
from . import policy
from .autocast import (autocast, clear_autocast_cache, custom_bwd, custom_fwd, get_autocast_dtype,
                       is_autocast_cache_enabled, is_autocast_enabled, set_autocast_dtype)
from . import validate
from . import fp8
from . import autoprecision

__all__ = ["GradScaler", "fp32_state_dict", "ops", "optim", "prepare",
           "policy", "autocast", "custom_fwd", "custom_bwd", "is_autocast_enabled", "get_autocast_dtype",
           "set_autocast_dtype", "is_autocast_cache_enabled", "clear_autocast_cache", "fp8", "autoprecision"]
__version__ = "0.1.0"
