"""The FP8 region of the current thread: the recipe, module types and amax reduction
(a _amax_reduction.Pending, or None) of the innermost ampc.fp8.autocast, or none."""
from __future__ import annotations  # "X | None" hints on Python 3.9 too; none evaluated at import

import threading
from typing import Optional, Tuple

from torch import nn

from ._amax_reduction import Pending
from .recipe import Recipe

# an enabled region: (recipe, module types, pending); a disabled one: None
Region = Optional[Tuple[Recipe, Tuple[type[nn.Module], ...], Optional[Pending]]]

_local = threading.local()


def stack() -> list[Region]:
    s = getattr(_local, "stack", None)
    if s is None:
        s = _local.stack = []
    return s


def current() -> Region:
    """(recipe, module types, pending) of the innermost enabled region, or None."""
    s = stack()
    return s[-1] if s and s[-1] is not None else None
