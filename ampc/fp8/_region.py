"""The FP8 region of the current thread: the recipe, module types and amax reduction
(a _amax_reduction.Pending, or None) of the innermost ampc.fp8.autocast, or none."""
import threading

_local = threading.local()


def stack():
    s = getattr(_local, "stack", None)
    if s is None:
        s = _local.stack = []
    return s


def current():
    """(recipe, module types, pending) of the innermost enabled region, or None."""
    s = stack()
    return s[-1] if s and s[-1] is not None else None
