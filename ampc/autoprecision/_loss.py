"""The loss as a decision unit: the log-softmax and the loss measured like any module.

The loss runs on the model's output outside the model, so no module scope reaches it: a
plan gives it a precision of its own. At fp32 the output's floating tensors are cast to
fp32 and the loss runs without autocast (what ``default_loss`` always did). At bf16 or
fp16 the output is cast to that dtype and the loss runs under autocast with the ops a loss
is made of (LOSS_OPS: log-softmax, softmax, logsumexp and torch's losses, which autocast
keeps in fp32 by default) lowered to it: a large vocabulary's logits then take half the
memory, and what that costs in error is measured, not assumed.

Measured per batch, on the fp32 step's recorded output, against the loss at fp32:

  loss err   |L_c - L| / |L| (the loss itself, not a first-order estimate)
  dgrad err  ||dL_c/dy - dL/dy|| / ||dL/dy||, the gradient the loss hands the model
  noise      fp32's batch-to-batch spread of dL/dy (what dgrad err is judged against)
  fp16       the fractions of the output and of its scaled gradient past fp16's range

and the time of the loss's forward and backward at each candidate.
"""
from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch

import ampc
from . import _candidates, _objectives
from ._solve import clearly_faster
from .._numerics.errors import fp16_loss_scale, fp16_range, rel_error
from .._numerics.model import default_loss, float_tensors
from .._numerics.noise import Spread
from .._walk import map_tensors

NAME = "(loss)"                  # the loss unit's name in a plan (no module has it)
KIND = "loss"
LOSS_OPS = ("log_softmax", "softmax", "logsumexp", "cross_entropy_loss", "nll_loss",
            "nll_loss2d", "mse_loss", "l1_loss", "smooth_l1_loss", "huber_loss", "kl_div",
            "binary_cross_entropy_with_logits", "soft_margin_loss", "poisson_nll_loss")


def loss_name(loss_fn: Callable | None) -> str:
    """How a plan names the loss: the function's or the module's class name."""
    if loss_fn is None:
        return default_loss.__name__
    return getattr(loss_fn, "__name__", None) or type(loss_fn).__name__


def owns_loss(output: Any) -> bool:
    """Whether the model's output carries a loss it computed itself (transformers models
    given labels): the default loss takes it, and the loss ran inside the model."""
    if isinstance(output, torch.Tensor):
        return False
    own = output.get("loss") if isinstance(output, Mapping) else getattr(output, "loss", None)
    return isinstance(own, torch.Tensor)


def region(choice: str, device: str) -> contextlib.AbstractContextManager:
    """Where the loss runs at ``choice``: no autocast at fp32; else autocast at that dtype
    with LOSS_OPS lowered to it."""
    if choice == "fp32":
        return torch.autocast(device, enabled=False)
    dtype = _candidates.get(choice).dtype
    stack = contextlib.ExitStack()
    stack.enter_context(ampc.autocast(device, dtype=dtype))
    stack.enter_context(ampc.policy.scope(dtype=dtype,
                                          ops=dict.fromkeys(LOSS_OPS, "lower_precision_fp")))
    return stack


class AtPrecision:
    """``loss_fn`` run at ``choice``: the output's floating tensors cast to its dtype, the
    loss computed in :func:`region`, returned in fp32 (a GradScaler and ``.item()`` see the
    same thing at every choice). ``choice`` is a name, or a function giving it at each call
    (a plan's record, which may change after the loss function was handed out)."""

    def __init__(self, loss_fn: Callable | None, choice: str | Callable[[], str],
                 device: str) -> None:
        if not callable(choice) and choice not in _candidates.loss_names():
            raise ValueError(f"ampc.autoprecision: the loss's choice must be one of "
                             f"{', '.join(_candidates.loss_names())}, got {choice!r}")
        self.loss_fn, self._choice, self.device = loss_fn or default_loss, choice, device

    @property
    def choice(self) -> str:
        return self._choice() if callable(self._choice) else self._choice

    def __call__(self, output: Any, target: Any) -> torch.Tensor:
        choice = self.choice
        dtype = _candidates.get(choice).dtype
        output = map_tensors(lambda t: t.to(dtype) if t.is_floating_point() else t, output)
        with region(choice, self.device):
            loss = self.loss_fn(output, target)
        return loss.float()

    def __repr__(self) -> str:
        return f"{loss_name(self.loss_fn)} at {self.choice}"


def _run(loss_fn, output, target, scale):
    """(loss, [gradient of each floating output tensor], seconds) of ``loss_fn`` (an
    :class:`AtPrecision`) on leaves made from the recorded ``output``; the gradients are
    those of ``loss * scale``, unscaled, in fp32."""
    leaves = []

    def leaf(t):
        if not t.is_floating_point():
            return t
        x = t.detach().clone().requires_grad_(True)
        leaves.append(x)
        return x
    out = map_tensors(leaf, output)
    t0 = time.perf_counter()
    loss = loss_fn(out, target)
    if loss.requires_grad:
        (loss * scale).backward()
    seconds = time.perf_counter() - t0
    grads = [None if x.grad is None else x.grad.float() / scale for x in leaves]
    return float(loss.detach()), grads, seconds


class Tally:
    """The loss unit's figures over the batches, in the shape ``_measure.measure`` gives a
    module's: :meth:`add` one captured step (its ``output`` and ``target``) at a time, then
    :meth:`result`. Each candidate's run is timed ``repeats`` times per batch, interleaved
    with the others, the fastest kept; a candidate that fails to run keeps its error."""

    def __init__(self, loss_fn, candidates, device, repeats=2, per_batch=1.0):
        self.fns = {c: AtPrecision(loss_fn, c, device) for c in ("fp32",) + tuple(
            c for c in candidates if c in _candidates.loss_names() and c != "fp32")}
        self.sums = {c: {"loss_err": [], "dgrad_err": [], "underflow": [], "overflow": []}
                     for c in self.fns}
        self.times = {c: [] for c in self.fns}
        self.errors = {}
        self.noise = Spread()
        self.scale = None          # the loss scale fp16 was measured at
        self.numel = 0
        self.repeats = repeats
        self.per_batch = per_batch    # whole batches over the batches measured (a slice)

    def _runs(self, step, scale):
        runs = {}
        for _ in range(self.repeats):
            for c, fn in self.fns.items():     # fp32 first: fp16's scale is read from it
                if c in self.errors:
                    continue
                if _candidates.loss_scaled(c):
                    scale = loss_scale(scale, runs["fp32"][1])
                try:
                    r = _run(fn, step.output, step.target, scale if _candidates.loss_scaled(c) else 1.0)
                except RuntimeError as e:
                    if c == "fp32":
                        raise
                    self.errors[c] = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
                    continue
                runs[c] = r if c not in runs else runs[c][:2] + (min(runs[c][2], r[2]),)
        return runs

    def add(self, step, scale):
        """One captured step's errors and times (fp16 at the modules' loss scale ``scale``,
        or lower where the loss's own gradient needs it: :func:`loss_scale`)."""
        outputs = float_tensors(step.output)
        self.numel = round(sum(t.numel() for t in outputs) * self.per_batch)
        runs = self._runs(step, scale)
        ref_loss, ref_grads, _ = runs["fp32"]
        scale = loss_scale(scale, ref_grads)
        self.noise.add(ref_grads)
        for c, (loss, grads, t) in runs.items():
            self.times[c].append(t)
            sums = self.sums[c]
            sums["loss_err"].append(abs(loss - ref_loss) / max(abs(ref_loss), 1e-12)
                                    if math.isfinite(loss) else math.inf)
            sums["dgrad_err"].append(rel_error(grads, ref_grads))
            if _candidates.loss_scaled(c):
                under, over = fp16_range([g for g in ref_grads if g is not None], scale, outputs)
                sums["underflow"].append(under)
                sums["overflow"].append(over)
                self.scale = scale

    def result(self):
        out = {}
        for c in self.fns:
            r = {k: (sum(v) / len(v) if v and None not in v else None)
                 for k, v in self.sums[c].items()}
            r.update(out_err=r["loss_err"], wgrad_err=None, wgrad_noise=None,
                     dgrad_noise=self.noise.value(),
                     ms=1e3 * min(self.times[c]) if self.times[c] else None,
                     bytes=self.numel * _candidates.get(c).bytes)
            if c in self.errors:
                r["error"] = self.errors[c]
            if _candidates.loss_scaled(c) and self.scale is not None:
                r["loss_scale"] = self.scale
            out[c] = r
        return out


SHARE = 0.10    # the least share of the units' fp32 bytes lowering the loss must save


def keep_fp32(measured, choice, objective):
    """Why the loss stays fp32 though the solver lowered it, or None. Lowered, the loss's
    value is rounded to 16 bits (bf16: 0.2-0.8% on a 10-class cross-entropy), which no
    gradient yardstick excuses; so it goes lower only where that buys something: it
    measured clearly faster (by more than MARGIN, time objective), or its bytes saved are at
    least SHARE of the bytes of all units at fp32 (the logits of a large vocabulary; not a
    classifier's ten classes)."""
    c = choice.get(NAME, "fp32")
    if c == "fp32":
        return None
    mine, fp32 = measured[NAME][c], measured[NAME]["fp32"]
    by_speed = _objectives.get(objective).by_speed
    if by_speed and clearly_faster(mine["ms"] or math.inf, fp32["ms"] or math.inf):
        return None
    total = sum(opts["fp32"]["bytes"] or 0 for opts in measured.values())
    saved = (fp32["bytes"] or 0) - (mine["bytes"] or 0)
    if saved >= SHARE * total:
        return None
    return (f"saves {saved} bytes, under {SHARE:.0%} of the units' {total} at fp32"
            + (", and not clearly faster" if by_speed else ""))


def loss_scale(scale, grads):
    """The loss scale an fp16 loss is judged at: the modules' ``scale``, or lower where the
    loss needs it. In fp16 the loss's own gradient is the scale itself (its backward starts
    from d(scale * L)/dL), and a dynamic scaler that meets it past fp16's 65504 backs off:
    the scale a run settles at keeps it, and the largest gradient the loss hands on
    (``grads``, at scale 1), under half of fp16's range."""
    top = max([1.0] + [float(g.abs().max()) for g in grads if g is not None and g.numel()])
    return min(scale, fp16_loss_scale(top))
