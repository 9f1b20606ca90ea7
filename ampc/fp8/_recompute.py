"""Activation checkpointing of FP8 layers: the recomputation casts as the forward did.

torch.utils.checkpoint runs a checkpointed forward again during backward, to rebuild the
tensors the backward needs. By then, under DelayedScaling, every layer's scales have moved
on (each forward updates them right after its cast), and the FP8 region may be closed. A
recomputation that cast with the module's scales of the moment would quantize otherwise than
the forward whose output the loss saw, and would update the amax history a second time.

So each FP8 call of an ampc.fp8.Linear inside a checkpointed forward records, on that
checkpoint, the recipe and the scales it cast with (ampc/_checkpoint.py finds the checkpoint,
as it does for ampc.autocast; both reentrant and non-reentrant checkpointing). The
checkpoint's recomputation is wrapped to replay the record in order: the same casts, the
scaling state left alone, each call FP8 or not as in the forward, whatever region is open
when the backward runs.
The record lives and dies with its checkpoint, so several forwards before their backwards
(gradient accumulation) each replay their own, in whatever order the backwards run.
Current scaling replays too: the same scales, without the amax pass (recomputing them from
the rebuilt tensors would give the same, as test_fp8_checkpoint.py shows).

A checkpoint is found through torch's saved-tensor hooks (non-reentrant) or, under no_grad,
its frame (reentrant). Saved-tensor hooks of one's own pushed inside a checkpointed function
around an FP8 layer, or torch.enable_grad() around one inside a reentrant checkpoint, hide it:
the layer's forward is not recorded and its recomputation runs without FP8, undetected.

A call without FP8 under a disabled region (``fp8.autocast(enabled=False)`` inside an enabled
one) is recorded as such. Not supported, with an error rather than a wrong answer: FP8 layers
in a checkpoint nested in another, once the outer recomputation runs the inner checkpoint's
forward again; a layer called both in and out of FP8 within one checkpoint where the
recomputation cannot tell the calls apart (the call out of FP8 made with no FP8 region open).
"""
from __future__ import annotations  # "X | None" hints on Python 3.9 too; none evaluated at import

import functools
import threading
import weakref
from collections import namedtuple
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from .. import ops
from . import _open_regions
from .._checkpoint import in_checkpointed_forward, wrap_recompute
from .recipe import Recipe

MARK = "_ampc_fp8_record"
NOT_FP8 = "not fp8"     # a recomputed call whose forward ran without FP8
_local = threading.local()
_checkpointed = weakref.WeakSet()   # the layers that have run FP8 inside a checkpoint


class Cast(namedtuple("Cast", "recipe scale scale_inv group")):
    """What the forward of one FP8 call cast its input and weight with, and the group its
    amaxes are reduced over (None: not reduced), which its backward's reduce over too."""

    def cast(self, tensors: Sequence[torch.Tensor],
             dtype: torch.dtype) -> tuple[list[torch.Tensor], torch.Tensor]:
        """``tensors`` cast with the recorded scales; returns them and the inverse scales.
        The amaxes go to a scratch tensor: the scaling state is the forward's business."""
        out = [torch.empty(t.shape, dtype=dtype, device=t.device) for t in tensors]
        scratch = torch.empty(len(tensors), dtype=torch.float32, device=self.scale.device)
        ops.cast_fp8(out, tensors, self.scale, scratch)
        return out, self.scale_inv


class Record:
    """The FP8 calls of one checkpointed forward, in order: (module, Cast)."""

    def __init__(self) -> None:
        self.calls = []

    def add(self, module: nn.Module, recipe: Recipe, scale: torch.Tensor,
            scale_inv: torch.Tensor, group: dist.ProcessGroup | None) -> None:
        self.calls.append((module, Cast(recipe, scale, scale_inv, group)))
        _checkpointed.add(module)

    def add_not_fp8(self, module: nn.Module) -> None:
        self.calls.append((module, NOT_FP8))


class _Replay:
    def __init__(self, record):
        self.record, self.next = record, 0
        self.base = len(_open_regions.stack())

    def take(self, module):
        rest = self.record.calls[self.next:]
        inner = _open_regions.stack()[self.base:]
        # a region the checkpointed function opened itself decides as it did in the forward
        fp8 = inner[-1] is not None if inner else None
        if rest and rest[0][0] is module and fp8 in (None, rest[0][1] is not NOT_FP8):
            self.next += 1
            return rest[0][1]
        if not fp8 and not any(m is module for m, _ in rest):
            return NOT_FP8
        raise RuntimeError(
            "ampc.fp8: the recomputation of a checkpointed forward called its FP8 layers in "
            "another order than the forward did, or called one layer both in and out of FP8 "
            "with no FP8 region open for the call out of it; open a disabled region "
            "(ampc.fp8.autocast(enabled=False)) for such a call")


def _replays():
    s = getattr(_local, "replays", None)
    if s is None:
        s = _local.replays = []
    return s


def _replaying(fn):
    """``fn`` (a checkpoint's recomputation) made to replay a new, empty record."""
    record = Record()

    @functools.wraps(fn)
    def recompute(*args, **kwargs):
        replays = _replays()
        replays.append(_Replay(record))
        try:
            return fn(*args, **kwargs)
        finally:
            replays.pop()
    setattr(recompute, MARK, record)
    return recompute


def recording() -> Record | None:
    """The record of the checkpointed forward running now, or None outside one."""
    fn = wrap_recompute(_replaying, MARK, whole_stack=True)
    return None if fn is None else getattr(fn, MARK)


def record_not_fp8(module: nn.Module) -> None:
    """Inside a checkpointed forward, records that ``module`` ran without FP8 (called when
    an FP8 region is open but disabled: the recomputation must not take it for an FP8 call
    of the same layer)."""
    record = recording()
    if record is not None:
        record.add_not_fp8(module)


def replayed(module: nn.Module) -> Cast | str | None:
    """In a checkpoint's recomputation, the Cast the forward's call of ``module`` used, or
    NOT_FP8 when that call ran without FP8; None outside a recomputation."""
    replays = _replays()
    if replays:
        if in_checkpointed_forward():
            _nested()
        return replays[-1].take(module)
    if torch._C._current_graph_task_id() == -1:
        return None
    # a forward inside a backward pass with nothing to replay: the recomputation of a
    # checkpoint whose forward ran no FP8 (no region, or the layer was not converted yet),
    # or, inside another checkpoint's recomputation, of a nested checkpoint
    if module in _checkpointed and in_checkpointed_forward():
        _nested()
    return NOT_FP8


def _nested():
    raise RuntimeError(
        "ampc.fp8: an FP8 layer in a checkpoint nested inside another checkpoint is not "
        "supported (its recomputation cannot find the scales the forward cast with); "
        "checkpoint the FP8 layers at one level")
