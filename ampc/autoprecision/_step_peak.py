"""A training step's peak as a byte budget measures it: the budget read (bytes, or a string
such as "6GiB"), the step of a plan measured on a copy of the model (``ampc.memory.report``)
with the optimizer its state asks for, and what that optimizer can do (free each gradient in
the backward; its step's time)."""
from __future__ import annotations

import contextvars
import copy
import functools
import gc
import math
import re
import time
from dataclasses import dataclass, replace

import torch
from torch import nn

from . import _step

MiB = float(1 << 20)
FN = "ampc.autoprecision.search"

_UNITS = {"": 1, "b": 1, "kb": 10 ** 3, "mb": 10 ** 6, "gb": 10 ** 9, "tb": 10 ** 12,
          "kib": 2 ** 10, "mib": 2 ** 20, "gib": 2 ** 30, "tib": 2 ** 40}


def check_args(peak_bytes, optimizer, objective):
    """The byte budget in bytes (an int, or a string such as "6GiB" or "500 MB"), or None;
    raises, before anything is measured, on a budget search cannot take."""
    if peak_bytes is None:
        return None
    given = peak_bytes
    if isinstance(peak_bytes, str):
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", peak_bytes)
        if m is None or m.group(2).lower() not in _UNITS:
            raise ValueError(f"{FN}: peak_bytes must be a number of bytes or a string such as "
                             f"'6GiB' or '500MB', got {given!r}")
        peak_bytes = float(m.group(1)) * _UNITS[m.group(2).lower()]
    if objective not in ("memory", "time"):
        raise ValueError(f"{FN}: peak_bytes is a budget of the memory and time objectives; "
                         f"got objective={objective!r}")
    if not (isinstance(peak_bytes, (int, float)) and not isinstance(peak_bytes, bool)
            and 0 < peak_bytes < math.inf):
        raise ValueError(f"{FN}: peak_bytes must be a positive number of bytes, got "
                         f"{given!r}")
    if not callable(optimizer):
        raise TypeError(f"{FN}: optimizer must be a callable that takes the parameters and "
                        f"returns an optimizer (such as torch.optim.AdamW), got "
                        f"{type(optimizer).__name__}")
    return int(peak_bytes)


class _Under(torch.nn.Module):
    """The model run inside the plan's region (the report calls a module)."""

    def __init__(self, model, region):
        super().__init__()
        self.model = model
        self.region = region

    def forward(self, *args, **kwargs):
        with self.region():
            return self.model(*args, **kwargs)


@dataclass(frozen=True)
class Floor:
    """A step's forward measured alone (``step_peak`` with ``over``): its peak is at least
    ``peak`` bytes."""
    peak: int


_SEEN = contextvars.ContextVar("ampc_step_peaks", default=None)


def measuring(fn):
    """``fn`` (the search) run as one scope of measured steps:

    - each plan's step is measured once (``step_peak``): a search comes back to plans it
      measured (the whole-plan check measures the plan the budget's fit ended with), and
      the same plan on the same model, batch and optimizer measures the same bytes;
    - the objects alive before it are frozen out of the garbage collector's walks
      (``gc.freeze``): each measured step collects garbage first, and with a library such
      as transformers loaded one collection walked 400,000 objects in 0.19 s; frozen, it
      walks only what the search made. Where the caller froze objects of its own, the
      collector is left as it is."""
    @functools.wraps(fn)
    def run(*args, **kwargs):
        token = _SEEN.set({})
        freeze = not gc.get_freeze_count()
        if freeze:
            gc.collect()
            gc.freeze()
        try:
            return fn(*args, **kwargs)
        finally:
            if freeze:
                gc.unfreeze()
            _SEEN.reset(token)
    return run


def _plan_key(plan):
    """What a plan's measured step depends on: each unit's choice, the ops outside them, the
    step's moves."""
    s = plan.step
    return (tuple(sorted(plan.decisions.items())), plan.rest, s.state, s.grads_freed,
            s.recompute, s.sliced_head, s.micro_batches)


def step_peak(model, plan, batch, loss_fn, optimizer, over=None):
    """The ``ampc.memory.report`` of a training step of ``plan`` applied to a copy of
    ``model``: its state and optimizer as ``plan.step`` says (from ``optimizer``, a callable
    taking the params), its modules as the plan says (module names begin ``model.``).
    With ``over`` (bytes): the forward is measured first, on a copy of its own, and where it
    alone reaches more than ``over`` a ``Floor`` of its bytes comes back instead (the moves
    a search undoes to see whether the step stays under a mark mostly fail in the forward,
    and the forward alone costs about half a measured step). Inside :func:`measuring`, a
    plan measured before is not measured again."""
    from ..memory import forward_floor, report
    seen, got = _SEEN.get(), {}
    if seen is not None:
        args = (model, batch, loss_fn, optimizer)
        # the entry holds the objects, so that no id in its key is reused in the scope
        got = seen.setdefault(tuple(map(id, args)) + _plan_key(plan), {"of": args})
    if "report" in got:
        return got["report"]
    if over is not None:
        if "floor" not in got:
            got["floor"] = _measured(forward_floor, model, plan, batch, loss_fn, optimizer)
        if got["floor"] > over:
            return Floor(got["floor"])
    got["report"] = _measured(report, model, plan, batch, loss_fn, optimizer)
    return got["report"]


def _measured(measure, model, plan, batch, loss_fn, optimizer):
    """``measure`` (report or forward_floor) of a step of ``plan`` on a copy of ``model``."""
    work, opt = _step.make(plan.step, copy.deepcopy(model), optimizer_for(optimizer, plan.step))
    plan.apply(work)
    with torch.random.fork_rng(devices=[]):
        # warmup=0: the optimizer's state from a step on zero gradients, not a whole
        # training step (the same bytes; half the time of each measurement)
        return measure(_Under(work, plan.autocast), opt, batch, plan.loss(loss_fn), warmup=0,
                       micro_batches=plan.step.micro_batches)


def _ampc_adam(optimizer):
    """(ampc's Adam class, its options) standing for what ``optimizer`` makes: ampc's Adam
    or AdamW as it is, torch's with the same hyperparameters; None for another optimizer."""
    import ampc.optim
    probe = optimizer([nn.Parameter(torch.zeros(1))])
    if isinstance(probe, ampc.optim.Adam):
        keep = ("lr", "betas", "eps", "weight_decay", "amsgrad", "maximize")
        return type(probe), {k: v for k, v in probe.defaults.items() if k in keep}
    if type(probe) in (torch.optim.Adam, torch.optim.AdamW) and not probe.defaults.get("amsgrad"):
        cls = ampc.optim.AdamW if type(probe) is torch.optim.AdamW else ampc.optim.Adam
        return cls, {k: probe.defaults[k] for k in ("lr", "betas", "eps", "weight_decay")}
    return None


def optimizer_for(optimizer, step):
    """A callable (params, **options) making the optimizer of ``step``: ``optimizer`` itself
    where the step keeps fp32 state and every gradient, else ampc's Adam/AdamW with its
    hyperparameters (the lean states and step_in_backward are ampc's)."""
    if step.state == "fp32" and not step.grads_freed:
        return lambda params, **options: optimizer(params)
    cls, base = _ampc_adam(optimizer)
    return lambda params, **options: cls(params, **{**base, **options})


def can_free(optimizer, plan):
    """Why the step cannot free each gradient in the backward, or None when it can: that
    takes ampc's Adam/AdamW (``step_in_backward``), which fp16's loss scaler and several
    ranks rule out."""
    if plan.needs_scaler():
        return "a module runs fp16: its loss scaler sees every gradient before the step"
    if (torch.distributed.is_available() and torch.distributed.is_initialized()
            and torch.distributed.get_world_size() > 1):
        return "several ranks: gradients are reduced across them before the step"
    if _ampc_adam(optimizer) is None:
        return "the optimizer is not Adam or AdamW"
    return None


def _optimizer_ms(model, step, optimizer, reps=3):
    """Milliseconds of an optimizer step of ``step``'s state on a copy of ``model``, on
    gradients of the weights' size (the fastest of ``reps``)."""
    work, opt = _step.make(replace(step, grads_freed=False), copy.deepcopy(model),
                           optimizer_for(optimizer, replace(step, grads_freed=False)))
    params = [p for p in work.parameters() if p.requires_grad]
    times = []
    for _ in range(reps + 1):           # the first makes the state: not counted
        for p in params:
            p.grad = torch.full_like(p, 1e-3)
        t0 = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - t0)
    return min(times[1:]) * 1e3
