"""Delayed scaling's amaxes reduced across ranks (TransformerEngine's reduce_amax), in bulk.

Without it each data-parallel rank would scale with the amaxes of its own batch only: under
DDP, whose buffer broadcast gives every rank rank 0's state at each forward, the other ranks
saturate when their data is larger; under FSDP2 the states drift apart and a checkpoint
keeps one of them. With it, the casts of a region (or of a backward pass) take their amaxes
as usual and leave the scales alone; at the end, one all_reduce(MAX) over one flat buffer of
all those amaxes, then the scale updates, all on the device. The reduced amax of a tensor
is the amax of the union of its data over the ranks and over its uses: the max, NaN where
any of them saw a NaN (a flag per amax travels in the same buffer, because backends differ
in what MAX does with NaN). Every rank must run the same FP8 modules in the same order.
"""
from __future__ import annotations  # "X | None" hints on Python 3.9 too; none evaluated at import

import threading
from typing import Any

import torch
import torch.distributed as dist

from .. import ops


class Pending:
    """The amaxes cast so far in one region or one backward pass, waiting for `finish`."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self._lock = threading.Lock()       # a backward pass may run on several threads
        # (history, scale, scale_inv) of one module's casts -> (max of its uses, update args)
        self._amaxes = {}

    def add(self, state: tuple[torch.Tensor, torch.Tensor, torch.Tensor], amax: torch.Tensor,
            update: dict[str, Any]) -> None:
        """Notes a cast's amax for its state (history, scale, scale_inv); a module cast
        again keeps the max of its uses."""
        key = tuple(map(id, state))
        with self._lock:
            seen = self._amaxes.get(key)
            if seen is None:
                self._amaxes[key] = (state, amax.clone(), update)
            else:
                torch.maximum(seen[1], amax, out=seen[1])

    def finish(self) -> None:
        """One all_reduce(MAX) per device (one in the usual case), then the scale updates."""
        with self._lock:
            entries, self._amaxes = self._amaxes, {}
        by_device = {}
        for state, amax, update in entries.values():
            by_device.setdefault(amax.device, []).append((state, amax, update))
        # the same order on every rank, whichever thread of a backward pass cast first
        for _, items in sorted(by_device.items(), key=lambda d: (d[0].type, d[0].index or 0)):
            reduced = self._reduce(torch.cat([amax for _, amax, _ in items]))
            for ((history, scale, scale_inv), amax, update), part in zip(
                    items, reduced.split([amax.numel() for _, amax, _ in items])):
                ops.fp8_update_scales(history, part, scale, scale_inv, **update)

    def _reduce(self, amax):
        nan = amax.isnan()
        buf = torch.cat([amax.masked_fill(nan, 0.0), nan.float()])
        dist.all_reduce(buf, op=dist.ReduceOp.MAX, group=self.group)
        n = amax.numel()
        return buf[:n].masked_fill(buf[n:] > 0, float("nan"))


# ---- the backward pass: one Pending per graph task and group, finished by the engine ----

_backward = {}
_backward_lock = threading.Lock()


def backward_pending(group: dist.ProcessGroup) -> Pending:
    """The Pending of the running backward pass for `group`; the first call queues its
    finish on the autograd engine, which runs it when the whole backward pass is done."""
    key = (torch._C._current_graph_task_id(), group)
    with _backward_lock:
        pending = _backward.get(key)
        if pending is None:
            pending = _backward[key] = Pending(group)
            torch.autograd.Variable._execution_engine.queue_callback(
                lambda: _finish_backward(key))
    return pending


def _finish_backward(key):
    with _backward_lock:
        pending = _backward.pop(key)
    pending.finish()


# ---- the group of a region ----

def resolve_group(fp8_group: dist.ProcessGroup | None) -> dist.ProcessGroup | None:
    """The group to reduce over: `fp8_group`, or the default group when torch.distributed
    is initialized; None (nothing to reduce) where the group has one rank."""
    if fp8_group is None:
        if not (dist.is_available() and dist.is_initialized()):
            return None
        fp8_group = dist.group.WORLD
    return fp8_group if dist.get_world_size(fp8_group) > 1 else None


def check_group(fp8_group: object) -> None:
    """Refuses what is not a process group this rank belongs to, naming the argument."""
    if fp8_group is None:
        return
    if not dist.is_available():
        raise RuntimeError("ampc.fp8.autocast: fp8_group was given, but this torch has no "
                           "torch.distributed")
    if isinstance(fp8_group, int) and fp8_group == dist.GroupMember.NON_GROUP_MEMBER:
        raise ValueError("ampc.fp8.autocast: fp8_group is a group this rank is not a member "
                         "of (torch.distributed.new_group returned NON_GROUP_MEMBER); pass a "
                         "group that holds this rank, or None for the default group")
    if not isinstance(fp8_group, dist.ProcessGroup):
        raise TypeError(f"ampc.fp8.autocast: fp8_group must be a torch.distributed "
                        f"ProcessGroup or None (the default group), got "
                        f"{type(fp8_group).__name__} (of a DeviceMesh, pass mesh.get_group())")
    if not dist.is_initialized():
        raise RuntimeError("ampc.fp8.autocast: fp8_group was given, but torch.distributed's "
                           "process group is not initialized (or was destroyed)")
