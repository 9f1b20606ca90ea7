"""fp16_ready(): before a model trained in fp32 or bf16 is trained in fp16, which of its
modules produce values fp16 cannot hold.

Each batch runs one forward and backward in the model's own precision (bf16 and fp32 share
one exponent range, so the values are those training saw), recording every module's first
output, the loss's gradient at that output and the gradients of its own weights. Two
failures are looked for:

  overflow   an output with a magnitude over fp16's largest value, 65504: under fp16
             autocast it becomes inf, and the loss NaN. A loss scaler cannot help.
  underflow  gradients that flush to zero in fp16 even at the loss scale a dynamic scaler
             can reach: the largest power of two at which the largest gradient of the whole
             model (outputs' and weights') stays under 65504, at most ``max_scale``.
             A larger scale would overflow elsewhere, so these gradients are lost.

Gradients are measured in float64 from the recorded values; nothing is run in fp16.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .._numerics.capture import capture
from .._numerics.errors import FP16_MAX, fp16_range
from .._numerics.model import default_loss, to_device


def _label(name: str) -> str:
    return name or "(model)"


def _max_abs(tensors: Sequence[torch.Tensor]) -> float:
    return max((float(t.detach().abs().max()) for t in tensors if t.numel()), default=0.0)


def _judged(module: torch.nn.Module) -> bool:
    """A leaf, or a module with weights of its own: a container's outputs are its children's."""
    return (next(module.children(), None) is None
            or next(module.parameters(recurse=False), None) is not None)


class Fp16Readiness:
    """What :func:`fp16_ready` found: a row per leaf module (and per module with weights of
    its own) that has an output or weight gradients, in call order (``.rows``); ``.overflow`` and ``.underflow`` name the
    modules that fail; ``.ready`` is True when none does."""

    def __init__(self, rows: list[dict[str, Any]], config: dict[str, Any]) -> None:
        self.rows, self.config = rows, config
        self.overflow = [r["module"] for r in rows if r["overflow"]]
        self.underflow = [r["module"] for r in rows if r["underflow"]]

    @property
    def ready(self) -> bool:
        return not (self.overflow or self.underflow)

    def as_dict(self) -> dict[str, Any]:
        return {"config": dict(self.config), "ready": self.ready, "overflow": self.overflow,
                "underflow": self.underflow, "rows": [dict(r) for r in self.rows]}

    def table(self) -> str:
        c = self.config
        head = (f"fp16 readiness over {c['batches']} batch(es): loss scale {c['loss_scale']:g} "
                f"(largest gradient {c['max_grad']:.3g}); fp16 holds magnitudes up to "
                f"{FP16_MAX:g}, flushes scaled gradients under 2**-24 to zero")
        cols = ["module", "type", "max |output|", "max |grad|", "underflow %", "verdict"]
        lines = [[r["module"], r["type"], f"{r['max_output']:.3g}", f"{r['max_grad']:.3g}",
                  f"{100 * r['underflow_frac']:.2f}",
                  ", ".join(k for k in ("overflow", "underflow") if r[k]) or "ok"]
                 for r in self.rows]
        widths = [max(len(x) for x in col) for col in zip(cols, *lines)]
        out = [head, " | ".join(h.rjust(w) for h, w in zip(cols, widths)),
               "-+-".join("-" * w for w in widths)]
        out += [" | ".join(x.rjust(w) for x, w in zip(line, widths)) for line in lines]
        verdict = ("ready for fp16" if self.ready else
                   "not ready: " + "; ".join(
                       f"{k} in {', '.join(names)}" for k, names in
                       (("overflow", self.overflow), ("underflow", self.underflow)) if names)
                   + " (keep these modules in bf16 or fp32: ampc.policy.module_scope)")
        return "\n".join(out + [verdict])

    def __repr__(self) -> str:
        return self.table()


def _check_args(model, batches, loss_fn, max_scale, tolerance):
    fn = "ampc.validate.fp16_ready"
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"{fn}: model must be an nn.Module, got {type(model).__name__}")
    if isinstance(batches, (str, bytes, torch.Tensor)) or not isinstance(batches, Sequence):
        raise TypeError(f"{fn}: batches must be a list of (inputs, target) pairs, "
                        f"got {type(batches).__name__}")
    if not batches:
        raise ValueError(f"{fn}: batches is empty; give at least one (inputs, target) pair")
    for k, b in enumerate(batches):
        if not (isinstance(b, (tuple, list)) and len(b) == 2):
            raise TypeError(f"{fn}: batches[{k}] must be a pair (inputs, target)")
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError(f"{fn}: loss_fn must be callable, got {type(loss_fn).__name__}")
    if (isinstance(max_scale, bool) or not isinstance(max_scale, (int, float))
            or not 1.0 <= max_scale < math.inf):
        raise ValueError(f"{fn}: max_scale must be a finite number >= 1, got {max_scale!r}")
    if (isinstance(tolerance, bool) or not isinstance(tolerance, (int, float))
            or not 0.0 <= tolerance < 1.0):
        raise ValueError(f"{fn}: tolerance must be in [0, 1), got {tolerance!r}")


def _refuse_non_finite(seen):
    """Raises when the model's own step is not finite, naming where it starts: the first
    module (in call order) whose output is, else the last whose gradients are."""
    def finite(ts):
        return all(bool(torch.isfinite(t).all()) for t in ts)
    names = [n for n, rec in seen.items() if not finite(rec["out"])]
    where = "output"
    if not names:
        names = [n for n, rec in reversed(seen.items()) if not finite(rec["grads"])]
        where = "gradients"
    if names:
        raise ValueError(f"ampc.validate.fp16_ready: module {_label(names[0])} gives non-finite "
                         f"{where} in the model's own precision, before any fp16: fix that first")


def fp16_ready(model: torch.nn.Module, batches: Sequence[tuple], loss_fn: Callable | None = None,
               *, max_scale: float = 2.0 ** 24, tolerance: float = 0.01) -> Fp16Readiness:
    """Which modules of ``model`` (trained in fp32 or bf16) produce outputs or gradients
    fp16 cannot hold, found before an fp16 run turns them into NaN losses.

    Args:
        model (nn.Module): the model, in the precision it was trained in. Its weights,
            buffers (BatchNorm statistics) and ``.grad`` are left as they were.
        batches: a few ``(inputs, target)`` pairs; ``inputs`` is a tensor or a tuple of
            positional arguments. Figures are the worst over the batches.
        loss_fn: ``loss_fn(output, target)``; default: cross-entropy over the last dim.
        max_scale (float): the largest loss scale to credit (a dynamic scaler grows the
            scale until gradients overflow; 2**24 by default).
        tolerance (float): a module underflows when more than this fraction of its
            gradient elements (its output's and its own weights') flush to zero at the
            loss scale. Default 0.01.

    Returns:
        :class:`Fp16Readiness`: ``.ready``, ``.overflow``, ``.underflow``, ``.rows``,
        ``.table()``, ``.as_dict()``.
    """
    _check_args(model, batches, loss_fn, max_scale, tolerance)
    loss_fn = loss_fn or default_loss
    first = next(model.parameters(), None)
    device = first.device if first is not None else torch.device("cpu")
    modules = dict(model.named_modules())
    saved = {n: b.detach().clone() for n, b in model.named_buffers()}
    steps = []
    try:
        for b in batches:
            steps.append(capture(model, to_device(tuple(b), device), loss_fn, list(modules)))
    finally:
        with torch.no_grad():
            for n, b in model.named_buffers():
                b.copy_(saved[n])

    # per module: its outputs and the gradients it is judged on, over all batches
    seen: dict[str, dict[str, list[torch.Tensor]]] = {}
    for step in steps:
        for name, call in step.calls.items():
            rec = seen.setdefault(name, {"out": [], "grads": []})
            if call.out is not None:
                rec["out"].append(call.out)
            rec["grads"] += [g for g in [call.grad] + step.module_grads(model, name)
                             if g is not None and g.is_floating_point()]
    seen = {n: rec for n, rec in seen.items() if _judged(modules[n])}
    _refuse_non_finite(seen)
    max_grad = max((_max_abs(r["grads"]) for r in seen.values()), default=0.0)
    scale = max_scale
    if max_grad > 0:
        scale = min(max_scale, 2.0 ** math.floor(math.log2(FP16_MAX / max_grad)))

    rows = []
    for name, rec in seen.items():
        if not rec["out"] and not rec["grads"]:
            continue
        max_out = _max_abs([t for t in rec["out"] if t.is_floating_point()])
        under = fp16_range(rec["grads"], scale)[0] or 0.0
        rows.append({"module": _label(name), "type": type(modules[name]).__name__,
                     "max_output": max_out, "max_grad": _max_abs(rec["grads"]),
                     "underflow_frac": under, "overflow": not max_out <= FP16_MAX,
                     "underflow": under > tolerance})
    config = {"batches": len(batches), "loss_scale": scale, "max_grad": max_grad,
              "max_scale": max_scale, "tolerance": tolerance, "device": device.type}
    return Fp16Readiness(rows, config)
