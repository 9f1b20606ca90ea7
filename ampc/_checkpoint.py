"""Carrying an ampc region into activation checkpointing's recomputation.

torch's checkpoint restores torch's autocast state for the recomputation, which covers every
op whose ampc policy equals torch's lists, but not a TorchFunctionMode. When an op with an
ampc policy of its own runs inside a checkpointed forward, the recomputation of that
checkpoint is wrapped so that it runs under the region too. It is found where torch keeps it:
non-reentrant checkpointing (``checkpoint(use_reentrant=False)``, ``checkpoint_wrapper``, the
composable ``checkpoint``) runs the forward under saved-tensor hooks whose pack hook holds the
checkpoint's frame and its ``recompute_fn``; reentrant checkpointing runs the function under
no_grad inside ``CheckpointFunction.forward``, whose ``ctx.run_function`` it calls again in
backward. Both are torch internals: tests/test_autocast_checkpoint.py fails if they move.
"""
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


def carry_into_checkpoint(wrap):
    """Inside a checkpointed forward, replaces its recomputation ``fn`` with ``wrap(fn)``
    (once per checkpoint); does nothing elsewhere."""
    hooks = top_hooks()
    if hooks is not None and getattr(hooks[0], "_checkpoint_internal", False):   # non-reentrant
        frame = _closure(hooks[0], "frame")
        if frame is not None and not getattr(frame.recompute_fn, "_ampc", False):
            frame.recompute_fn = wrap(frame.recompute_fn)
        return
    if torch.is_grad_enabled():
        return
    f, depth = sys._getframe(1), 64          # reentrant: the function runs under no_grad
    while f is not None and depth:
        if f.f_code is REENTRANT_FORWARD:
            ctx = f.f_locals.get("ctx")
            if ctx is not None and not getattr(ctx.run_function, "_ampc", False):
                ctx.run_function = wrap(ctx.run_function)
            return
        f, depth = f.f_back, depth - 1
