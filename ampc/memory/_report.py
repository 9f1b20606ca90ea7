"""One training step measured: its peak memory and what the peak is made of.

The peak is that of live tensors, not of the allocator's cache: the bytes alive when the step
starts (weights, buffers, optimizer state, batch: measured from the tensors) plus the highest
running sum of the allocations and frees torch's profiler records during the step, in time
order (on CUDA, ``torch.cuda.max_memory_allocated`` is reported beside it). Each block the
profiler saw has an address and a lifetime; the blocks alive at the peak are sorted into
gradients, saved activations (by the module that saved them: ``_saved.py``) and the rest.
"""
from __future__ import annotations

import contextlib
import dataclasses
import gc
from collections.abc import Callable

import torch
from torch.profiler import record_function

from .._numerics.model import call_model, default_loss
from .._walk import tensors
from ..lean_state import state_bytes
from ._compress import compressed
from ._micro_batches import accumulate, batch_size, micro_batch_backward as micro_backward
from ._micro_batches import micro_batches as split_batch
from ._recompute import recomputed
from ._saved import SavedTracker, storage_key
from .peak import _events, _lifetimes, start_profiler, stop_profiler

MiB = float(1 << 20)
_MARK = "ampc.memory."
_PHASES = ("forward", "backward", "step")


@dataclasses.dataclass
class MemoryReport:
    """What :func:`report` measured. Bytes throughout.

    Attributes:
        device: where the step ran.
        peak: live tensor bytes at the step's highest point.
        phase: where the peak fell: "forward" (the loss included), "backward" or "step".
        parts: the peak by kind: weights, buffers, optimizer state, batch, grads, saved
            activations, other (temporaries, outputs not saved, gradients in flight).
        saved: saved activations at the end of the forward by module, largest first.
        saved_at_peak: the part of ``saved`` still alive at the peak, by module.
        recomputed: the modules that recompute in the backward (``ampc.memory.recompute``).
        allocator_peak: CUDA only: ``torch.cuda.max_memory_allocated()`` over the step.
        compressed: {module: "8bit" or "bf16"} of the modules keeping their saved tensors in
            fewer bits (``ampc.memory.compress``); ``saved`` counts what they keep.
    """
    device: str
    peak: int
    phase: str
    parts: dict[str, int]
    saved: dict[str, int]
    saved_at_peak: dict[str, int]
    recomputed: list[str]
    allocator_peak: int | None = None
    compressed: dict[str, str] = dataclasses.field(default_factory=dict)

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)

    def by_kind(self) -> dict[str, int]:
        """The peak in five kinds, as a whole-step plan reads it: weights (buffers with
        them), grads, state (the optimizer's), activations (saved), other (the batch and
        the rest)."""
        p = self.parts
        return {"weights": p.get("weights", 0) + p.get("buffers", 0), "grads": p.get("grads", 0),
                "state": p.get("optimizer state", 0), "activations": p.get("saved activations", 0),
                "other": p.get("batch", 0) + p.get("other", 0)}

    def top(self, n: int = 10) -> list[tuple[str, int, int]]:
        """(module, bytes saved, bytes of them alive at the peak) of the ``n`` modules saving
        the most, the last row "(N others)" summing the rest."""
        rows = [(k, b, self.saved_at_peak.get(k, 0)) for k, b in self.saved.items()]
        if len(rows) > n:
            rest = rows[n - 1:]
            rows = rows[:n - 1] + [(f"({len(rest)} others)", sum(r[1] for r in rest), sum(r[2] for r in rest))]
        return rows

    def _unit(self) -> tuple[str, float]:
        return ("MiB", MiB) if self.peak >= 16 * MiB else ("KiB", 1024.0)

    def table(self, top: int = 10) -> str:
        unit, div = self._unit()
        rows = [f"one training step on {self.device}: peak {self.peak / div:,.1f} {unit} of live "
                f"tensors, reached in the {self.phase}"]
        if self.allocator_peak is not None:
            rows.append(f"torch.cuda.max_memory_allocated over the step: {self.allocator_peak / div:,.1f} {unit}")
        rows += ["", f"{'at the peak':34} {unit:>10} {'% of peak':>9}"]
        rows += [f"{k:34} {v / div:10,.1f} {100 * v / max(self.peak, 1):9.1f}" for k, v in self.parts.items()]
        rows += ["", f"{'saved activations by module':34} {unit:>10} {'at peak':>9}"]
        for name, b, live in self.top(top):
            rows.append(f"{name[:34]:34} {b / div:10,.1f} {live / div:9,.1f}")
        rows.append(f"{'total, end of the forward':34} {sum(self.saved.values()) / div:10,.1f} "
                    f"{sum(self.saved_at_peak.values()) / div:9,.1f}")
        if self.recomputed:
            rows.append(f"recomputed in the backward: {', '.join(self.recomputed)}")
        if self.compressed:
            rows.append("saved in fewer bits: " + ", ".join(f"{n} ({h})" for n, h in
                                                          self.compressed.items()))
        return "\n".join(rows)

    def __str__(self) -> str:
        return self.table()

    def plot(self, path: str, top: int = 10, title: str | None = None) -> str:
        """Writes a PNG: the peak by kind as one stacked bar, and the modules saving the most.
        Needs matplotlib."""
        try:
            from matplotlib.figure import Figure    # no pyplot: no GUI backend is touched
        except ImportError as e:
            raise ImportError("ampc.memory: MemoryReport.plot needs matplotlib "
                              "(pip install matplotlib)") from e
        unit, div = self._unit()
        fig = Figure(figsize=(11, 4.2), layout="constrained")
        left, right = fig.subplots(1, 2, width_ratios=(1, 1.4))
        at = 0.0
        for (kind, b), color in zip(self.parts.items(), _COLORS):
            left.barh([0], [b / div], left=at, color=color, label=f"{kind} {b / div:,.0f}")
            at += b / div
        left.set_yticks([])
        left.set_xlabel(f"{unit} at the peak")
        left.legend(loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=2, fontsize=8, frameon=False)
        left.set_title(f"peak {self.peak / div:,.0f} {unit} ({self.phase})", fontsize=10)
        rows = self.top(top)[::-1]
        names = [r[0] for r in rows]
        right.barh(names, [r[1] / div for r in rows], color=_COLORS[5], label="saved")
        right.barh(names, [r[2] / div for r in rows], color="#444444", height=0.35, label="alive at the peak")
        right.tick_params(axis="y", labelsize=8)
        right.set_xlabel(f"{unit} saved for the backward")
        right.legend(fontsize=8)
        right.set_title("saved activations by module", fontsize=10)
        if title:
            fig.suptitle(title, fontsize=11)
        fig.savefig(path, dpi=110)
        return path


_COLORS = ("#4c72b0", "#8172b2", "#55a868", "#937860", "#c44e52", "#dd8452", "#bbbbbb")


def _check(model, optimizer, batch, loss_fn, autocast, warmup, top, micro):
    where = "ampc.memory.report"
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"{where}: model is {type(model).__name__}, expected a torch.nn.Module")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"{where}: optimizer is {type(optimizer).__name__}, expected a torch.optim.Optimizer")
    if not isinstance(batch, (tuple, list)) or len(batch) != 2:
        raise TypeError(f"{where}: batch must be an (inputs, target) pair, got {type(batch).__name__}")
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError(f"{where}: loss_fn is {type(loss_fn).__name__}, expected a callable or None")
    if autocast not in (None, torch.bfloat16, torch.float16):
        raise ValueError(f"{where}: autocast is {autocast!r}, expected None, torch.bfloat16 or torch.float16")
    for arg, v, least in (("warmup", warmup, 0), ("top", top, 1), ("micro_batches", micro, 1)):
        if isinstance(v, bool) or not isinstance(v, int) or v < least:
            raise ValueError(f"{where}: {arg} is {v!r}, expected an int >= {least}")
    size = batch_size(batch, where) if micro > 1 else None
    if micro > 1 and micro > size:
        raise ValueError(f"{where}: micro_batches is {micro}, more than the batch's {size} "
                         "examples")
    params = list(model.parameters())
    if not params:
        raise ValueError(f"{where}: model has no parameters")
    return params[0].device


def report(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: tuple,
           loss_fn: Callable | None = None, *, autocast: torch.dtype | None = None,
           warmup: int = 1, top: int = 10, micro_batches: int = 1) -> MemoryReport:
    """Runs training steps on ``batch`` and measures the last: its peak memory and what the
    peak is made of (see :class:`MemoryReport`).

    The steps are real: the model and the optimizer are trained by ``warmup + 1`` steps
    (pass copies to keep them). A step is ``optimizer.zero_grad(set_to_none=True)``, the
    forward and the loss (under ``ampc.autocast`` when ``autocast`` is a dtype), the
    backward and ``optimizer.step()``; the model's output is dropped once the loss is computed.

    Args:
        model (nn.Module): the model, on the device to measure.
        optimizer: the optimizer over its parameters.
        batch: ``(inputs, target)``: ``model(*inputs)`` for a tuple, ``model(**inputs)`` for
            a dict, else ``model(inputs)``; ``loss_fn(output, target)``.
        loss_fn: default: cross-entropy over the output's last dim (or the model's own loss).
        autocast: None (the model runs as it is) or the dtype of an ``ampc.autocast`` region.
        warmup (int): steps before the measured one (the optimizer makes its state in its
            first). 0: no training step before it; the optimizer makes its state in a step on
            zero gradients instead (the state's bytes then count as they would after a real
            step; weight decay still shrinks the weights once).
        top (int): modules named in the table (the rest summed).
        micro_batches (int): the step's batch run as this many micro-batches, their
            gradients summed (:func:`ampc.memory.micro_batches`); the last is the one
            measured, the gradients of the others alive through it (the step's highest point:
            the first has none).
    """
    return _step(model, optimizer, batch, loss_fn, autocast, warmup, top, micro_batches)


def forward_floor(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: tuple,
                  loss_fn: Callable | None = None, *, autocast: torch.dtype | None = None,
                  warmup: int = 1, micro_batches: int = 1) -> int:
    """What :func:`report` would find at the highest point of the step's forward (the loss
    included), measured alone: the bytes alive before the step plus the running sum's peak
    up to the loss. The step's peak is at least this, and the backward and the optimizer's
    step are not run (on the GPT-2-shaped model at 16 x 256 the forward measured alone took
    1.2 s, the whole measured step 2.5 s). The steps before the measured one are as
    :func:`report` runs them."""
    return _step(model, optimizer, batch, loss_fn, autocast, warmup, 10, micro_batches,
                 forward_only=True)


def _step(model, optimizer, batch, loss_fn, autocast, warmup, top, micro_batches,
          forward_only=False):
    device = _check(model, optimizer, batch, loss_fn, autocast, warmup, top, micro_batches)
    loss_fn = loss_fn or default_loss
    if autocast is None:
        region = contextlib.nullcontext
    else:
        from ..amp import autocast as ampc_autocast
        region = lambda: ampc_autocast(device.type, dtype=autocast)   # noqa: E731

    def forward(piece):
        with region():
            return loss_fn(call_model(model, piece[0]), piece[1])

    for _ in range(warmup):
        optimizer.zero_grad(set_to_none=True)
        micro_backward(optimizer, batch, micro_batches, forward)
        optimizer.step()
    if not warmup:
        _make_state(optimizer)
    optimizer.zero_grad(set_to_none=True)
    pieces = split_batch(batch, micro_batches)
    accumulate(optimizer, pieces[:-1], forward)   # their gradients alive when the last starts
    last, share = pieces[-1]
    gc.collect()

    base, persistent = _persistent(model, optimizer, batch)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    tracker = SavedTracker(model)
    prof = start_profiler(cuda)
    try:
        with record_function(_MARK + "forward"):
            with tracker:
                loss = forward(last)
                if share != 1.0:
                    loss = loss * share
            saved = tracker.live(persistent)      # every saved tensor is still held here
        if not forward_only:
            with record_function(_MARK + "backward"):
                loss.backward()
                grads = {k[0] for p in model.parameters() if p.grad is not None
                         for k in [storage_key(p.grad)] if k}
            del loss
            with record_function(_MARK + "step"):
                optimizer.step()
        if cuda:
            torch.cuda.synchronize(device)
    finally:
        stop_profiler(prof)
    if forward_only:
        return sum(base.values()) + _lifetimes(_events(prof, device)[0])[1]
    allocator_peak = torch.cuda.max_memory_allocated(device) if cuda else None
    return _result(prof, device, base, saved, grads, recomputed(model), compressed(model),
                   allocator_peak)


def _make_state(optimizer):
    """The optimizer's state, made by a step on zero gradients (a gradient hook that steps
    in the backward sees none: its step() takes them)."""
    params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
    with torch.no_grad():
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _persistent(model, optimizer, batch):
    """({kind: bytes} alive before the step, the addresses of their storages)."""
    state = state_bytes(model, optimizer)["bytes"]
    addresses = set()
    for t in [*model.parameters(), *tensors([s for s in optimizer.state.values()])]:
        key = storage_key(t)
        if key:
            addresses.add(key[0])

    def fresh(ts):   # bytes of the storages not counted yet
        n = 0
        for t in ts:
            key = storage_key(t)
            if key and key[0] not in addresses:
                addresses.add(key[0])
                n += key[1]
        return n
    base = {"weights": state["weights"], "buffers": fresh(model.buffers()),
            "optimizer state": sum(v for k, v in state.items() if k not in ("weights", "grads")),
            "batch": fresh(tensors(list(batch))), "grads": state["grads"]}
    return base, addresses


def _result(prof, device, base, saved, grads, recomputed_names, compressed_names, allocator_peak):
    events, marks, times = _events(prof, device, _MARK)
    blocks, top, at = _lifetimes(events)

    def alive_at(i):
        return {b[0]: b for b in blocks if b[1] <= i < b[2]}

    def last_before(ns):      # index of the last event at or before ns
        return sum(1 for t in times if t <= ns) - 1

    at_peak = alive_at(at)
    # a saved storage or a grad is the block at its address when its phase ended
    fwd_blocks = alive_at(last_before(marks["forward"][1]))
    bwd_blocks = alive_at(last_before(marks["backward"][1]))

    def at_peak_bytes(then, ptr):     # the bytes of that block if it is still alive at the peak
        b = then.get(ptr)
        return b[3] if b is not None and at_peak.get(ptr) is b else 0
    saved_by, saved_at_peak = {}, {}
    for ptr, (nbytes, name) in saved.items():
        saved_by[name] = saved_by.get(name, 0) + nbytes
        live = at_peak_bytes(fwd_blocks, ptr)
        if live:
            saved_at_peak[name] = saved_at_peak.get(name, 0) + live
    grads_at_peak = sum(at_peak_bytes(bwd_blocks, p) for p in grads)
    acts = sum(saved_at_peak.values())
    parts = {**base, "grads": base["grads"] + grads_at_peak, "saved activations": acts,
             "other": top - grads_at_peak - acts}
    peak_ns = times[at] if at >= 0 else marks["forward"][0]
    phase = next((p for p in _PHASES if peak_ns <= marks[p][1]), _PHASES[-1])
    order = sorted(saved_by, key=saved_by.get, reverse=True)
    return MemoryReport(device=str(device), peak=sum(base.values()) + top, phase=phase, parts=parts,
                        saved={k: saved_by[k] for k in order},
                        saved_at_peak={k: saved_at_peak[k] for k in order if k in saved_at_peak},
                        recomputed=recomputed_names, allocator_peak=allocator_peak,
                        compressed=compressed_names)
