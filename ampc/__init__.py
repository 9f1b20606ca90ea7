"""ampc: mixed-precision training for PyTorch with a C core.

The kernels are registered as torch.ops.ampc.*; ampc.ops wraps them.
"""
from . import _lib  # noqa: F401  (registers torch.ops.ampc.*)
from . import ops
from .grad_scaler import GradScaler

__all__ = ["GradScaler", "ops"]
__version__ = "0.1.0"
