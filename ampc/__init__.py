"""ampc: mixed-precision training for PyTorch with a C core.

The kernels are registered as torch.ops.ampc.*; ampc.ops wraps them.
"""
from . import _lib  # noqa: F401  (registers torch.ops.ampc.*)
from . import ops
from . import optim
from .master import fp32_state_dict, prepare
from .grad_scaler import GradScaler

__all__ = ["GradScaler", "fp32_state_dict", "ops", "optim", "prepare"]
__version__ = "0.1.0"
