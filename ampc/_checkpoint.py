"""Carrying an ampc region into activation checkpointing's recomputation (and, for
ampc.fp8, the scales the forward cast with: fp8/_recompute.py).

torch's checkpoint restores torch's autocast state for the recomputation, which covers every
op whose ampc policy equals torch's lists, but not a TorchFunctionMode. When an op with an
ampc policy of its own runs inside a checkpointed forward, the recomputation of that
checkpoint is wrapped so that it runs under the region too. It is found where torch keeps it:
non-reentrant checkpointing (``checkpoint(use_reentrant=False)``, ``checkpoint_wrapper``, the
composable ``checkpoint``) runs the forward under saved-tensor hooks whose pack hook holds the
checkpoint's frame and its ``recompute_fn``; reentrant checkpointing runs the function under
no_grad inside ``CheckpointFunction.forward``, whose ``ctx.run_function`` it calls again in
backward. Both are torch internals: tests/amp/test_autocast_checkpoint.py fails if they move.
"""
import contextlib
import functools
import sys

import torch
import torch.utils.checkpoint

top_hooks = functools.partial(torch._C._autograd._top_saved_tensors_default_hooks, False)
REENTRANT_FORWARD = torch.utils.checkpoint.CheckpointFunction.forward.__code__


def _closure(fn, name):
    code = getattr(fn, "__code__", None)
    if code is None or name not in code.co_freevars:
        return None
    return fn.__closure__[code.co_freevars.index(name)].cell_contents


def _slot(depth=64):
    """(owner, attribute) of the recomputation function of the checkpointed forward running
    now, or None (outside one, and inside a recomputation). Reentrant checkpointing is
    looked for ``depth`` frames up (None: the whole stack)."""
    hooks = top_hooks()
    if hooks is not None and getattr(hooks[0], "_checkpoint_internal", False):   # non-reentrant
        # the forward's pack hook holds the frame; the recomputation's hook holds none
        frame = _closure(hooks[0], "frame")
        return None if frame is None else (frame, "recompute_fn")
    if torch.is_grad_enabled():
        return None
    f = sys._getframe(1)                     # reentrant: the function runs under no_grad
    while f is not None and depth != 0:
        if f.f_code is REENTRANT_FORWARD:
            ctx = f.f_locals.get("ctx")
            return None if ctx is None else (ctx, "run_function")
        f, depth = f.f_back, None if depth is None else depth - 1
    return None


def in_checkpointed_forward():
    return _slot(None) is not None


def wrap_recompute(wrap, mark, whole_stack=False):
    """Inside a checkpointed forward, replaces its recomputation ``fn`` with ``wrap(fn)``
    unless a function marked ``mark`` (an attribute, not None) is there already; wrappers
    made with functools.wraps keep the marks of the function they wrap. Returns the function
    now in place, or None outside a checkpointed forward."""
    slot = _slot(None if whole_stack else 64)
    if slot is None:
        return None
    owner, name = slot
    fn = getattr(owner, name)
    if getattr(fn, mark, None) is None:
        fn = wrap(fn)
        setattr(owner, name, fn)
    return fn


def carry_into_checkpoint(wrap):
    """Inside a checkpointed forward, replaces its recomputation ``fn`` with ``wrap(fn)``
    (once per checkpoint); does nothing elsewhere."""
    wrap_recompute(wrap, "_ampc")


region_now = None    # set by ampc.autocast: this thread's region as it is now, to enter again


def current_region():
    """A context manager that enters this thread's ampc region (its scopes, torch's autocast
    state) as it is now, for a recomputation that runs outside it; a no-op before ampc.autocast
    is loaded."""
    return contextlib.nullcontext() if region_now is None else region_now()
