"""Monitor: the plan re-checked during training.

Every ``every`` steps it takes the next ``sample`` modules of the plan (in turn, so that
all are seen over len(plan) / sample checks), runs the step's batch through the model in
fp32 on stand-ins for its state (its parameters as new leaves on the same storage, so that
the backward fills neither their ``.grad`` nor reaches a hook DDP put on them; its buffers
as copies, so that batch-norm statistics do not move) and measures a copy of each sampled
module, and of no other, at its planned precision against fp32, as search() did. A module leaves the budget when its error, added to the others' errors from
the search, would put the plan over it (its weight-gradient error on its own); after
``patience`` such checks in a row it is raised (fp8 -> bf16, bf16/fp16 -> fp32) or a
warning is given, as ``action`` says. It counts as back inside only once its error is
under ``release`` times its allowance (hysteresis: no flapping at the edge). Steps in
between only count: no device work, no host sync.

Given the step's ``loss`` or ``grad_norm`` (``monitor.step(batch, loss=loss,
grad_norm=norm)``), it also watches them for spikes against their own recent history
(``_spikes.SpikeWatch``: on the device, no host sync while the run is healthy). On a spike
it re-measures every module of the plan that is not fp32 on that batch and raises those
over their allowance (``action="warn"``: names them); when none is over, it names the
closest in a warning, since the cause may lie outside the plan (data, learning rate).
Spikes within ``spike_cooldown`` steps of one it acted on are taken as that one's.
"""
from __future__ import annotations

import copy
import math
import warnings
from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.distributed as dist

from . import _candidates, _measure, _units
from ._solve import _err
from ._spikes import SpikeWatch
from ._units import Reason
from .._numerics.capture import capture
from .._numerics.errors import loss_error, rel_error
from .._numerics.model import default_loss


class AppliedPlan(Protocol):
    """What the Monitor needs of an applied plan (ampc.autoprecision.Applied): the plan, the
    model it is applied to, and a way to change one module's precision."""
    plan: Any
    model: torch.nn.Module

    def set(self, name: str, choice: str, reason: Reason = ...) -> None: ...


def _agree(ratios):
    """Under torch.distributed, each module's largest ratio over the ranks: every rank
    then takes the same decisions (each measured its own batch)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return ratios
    t = torch.tensor([min(r, 1e30) for r in ratios.values()], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return {n: (math.inf if v >= 1e30 else v) for n, v in zip(ratios, t.tolist())}


def _stand_ins(model):
    """{qualified name: tensor} to run ``model`` on without touching it: each parameter as
    a new leaf on the same storage (nothing copied), each buffer as a copy."""
    state, seen = {}, {}
    for n, p in model.named_parameters(remove_duplicate=False):
        state[n] = seen.setdefault(id(p), p.detach().requires_grad_(p.requires_grad))
    for n, b in model.named_buffers(remove_duplicate=False):
        state[n] = seen.setdefault(id(b), b.clone())
    return state


def _tensors(module):
    return list(module.parameters()) + list(module.buffers())


def _bytes(tensors):
    seen = {id(t): t for t in tensors}
    return sum(t.numel() * t.element_size() for t in seen.values())


class Monitor:
    """Re-measures the modules of an applied plan during training (see the module's doc)."""

    def __init__(self, applied: AppliedPlan, loss_fn: Callable | None = None, *, every: int = 100,
                 sample: int = 2, action: str = "raise", patience: int = 1, release: float = 0.5,
                 device: str | None = None, spike_k: float = 4.0, spike_rise: float = 0.5,
                 spike_warmup: int = 20, spike_cooldown: int = 10) -> None:
        if action not in ("raise", "warn"):
            raise ValueError(f"ampc.autoprecision.Monitor: action must be 'raise' or 'warn', "
                             f"got {action!r}")
        for name, v in (("every", every), ("sample", sample), ("patience", patience)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"ampc.autoprecision.Monitor: {name} must be a positive int, "
                                 f"got {v!r}")
        for name, v in (("spike_k", spike_k), ("spike_rise", spike_rise)):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                raise ValueError(f"ampc.autoprecision.Monitor: {name} must be a positive number, "
                                 f"got {v!r}")
        for name, v in (("spike_warmup", spike_warmup), ("spike_cooldown", spike_cooldown)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"ampc.autoprecision.Monitor: {name} must be a positive int, "
                                 f"got {v!r}")
        if not 0 < release < 1:
            raise ValueError(f"ampc.autoprecision.Monitor: release must be in (0, 1), "
                             f"got {release!r}")
        self.applied, self.plan = applied, applied.plan
        self.loss_fn = loss_fn or default_loss
        self.every, self.sample, self.action = every, sample, action
        self.patience, self.release = patience, release
        self.device = device or self.plan.device
        self.steps = 0
        self.cursor = 0
        self.over = {}          # module -> checks in a row over its allowance
        self.out = set()        # modules currently outside the budget
        self.history = []       # {"step", "module", "choice", "errors", "ratio"}
        self.decisions = []     # {"step", "module", "from", "to", "ratio", "action"}
        self.copied_bytes = 0   # what the last check copied: the buffers, the checked modules
        self.watches = {k: SpikeWatch(spike_k, spike_rise, spike_warmup)
                        for k in ("loss", "grad_norm")}
        self.spikes = []        # {"step", "signals", "raised", "ratios"}
        self.spike_cooldown = spike_cooldown    # steps after a spike whose spikes are its own

    def allowance(self, name: str) -> dict[str, float]:
        """{error: limit} for one module: the budget less the other modules' errors."""
        b = self.plan.budget
        others = [u for u in self.plan if u.module != name]
        out = {"wgrad_err": b.wgrad}
        for key, limit in (("loss_err", b.loss), ("dgrad_err", b.grad)):
            used = sum(_err(u.figures(), key) ** 2 for u in others)
            out[key] = max(limit ** 2 - used, 0.0) ** 0.5
        return out

    def step(self, batch: tuple, loss: torch.Tensor | None = None,
             grad_norm: torch.Tensor | None = None) -> list[dict[str, Any]]:
        """Call once per training step; on every ``every``-th step it checks the next
        sampled modules on ``batch``, and on a spike of ``loss`` or ``grad_norm`` (each
        optional, a tensor: the step's loss, the norm clip_grad_norm_ returned) it checks
        all of them; returns the decisions taken (else [])."""
        self.steps += 1
        signals = [k for k, v in (("loss", loss), ("grad_norm", grad_norm)) if v is not None
                   and self.watches[k].seen(self.watches[k].update(v))]
        if signals and not (self.spikes and
                            self.steps - self.spikes[-1]["step"] <= self.spike_cooldown):
            return self.on_spike(batch, signals)
        if self.steps % self.every:
            return []
        return self.check(batch)

    def on_spike(self, batch: tuple, signals: list[str]) -> list[dict[str, Any]]:
        """Re-measures every module not at fp32 on ``batch``; raises (or names) those over
        their allowance, else names the closest."""
        names = [u.module for u in self.plan if self.plan.choice(u.module) != "fp32"]
        ratios = _agree(self._ratios(self.measure(batch, names), names)) if names else {}
        over = [n for n in names if ratios[n] > 1]
        taken = [self._act(n, self.plan.choice(n), ratios[n]) for n in over]
        self.decisions += taken
        closest = sorted(ratios, key=ratios.get, reverse=True)[:3]
        self.spikes.append({"step": self.steps, "signals": signals, "raised": over,
                            "ratios": {n: ratios[n] for n in closest}})
        if not over:
            named = ", ".join(f"{n} ({ratios[n]:.2f}x)" for n in closest) or "none"
            warnings.warn(f"ampc.autoprecision.Monitor: step {self.steps}: a spike of the "
                          f"{' and the '.join(signals)}; no module of the plan is over its "
                          f"error allowance on this batch (closest: {named}): look at the data "
                          "or the learning rate", stacklevel=2)
        return taken

    def _ratios(self, errors, names):
        """{module: its largest error over its allowance}."""
        ratios = {}
        for name in names:
            e, limits = errors[name], self.allowance(name)
            ratios[name] = max((_err(e, k) / lim if lim > 0 else (math.inf if _err(e, k) > 0
                                                                  else 0.0))
                               for k, lim in limits.items())
        return ratios

    def check(self, batch: tuple) -> list[dict[str, Any]]:
        """Checks the next sampled modules on ``batch`` now; returns the decisions taken."""
        names = [u.module for u in self.plan]
        if not names:
            return []
        picked = [names[(self.cursor + i) % len(names)] for i in range(min(self.sample, len(names)))]
        self.cursor = (self.cursor + len(picked)) % len(names)
        errors = self.measure(batch, picked)
        ratios = _agree(self._ratios(errors, picked))
        taken = []
        for name in picked:
            choice = self.plan.choice(name)
            e, ratio = errors[name], ratios[name]
            self.history.append({"step": self.steps, "module": name, "choice": choice,
                                 "errors": e, "ratio": ratio})
            if choice == "fp32":
                continue
            if ratio > 1:
                self.over[name] = self.over.get(name, 0) + 1
            else:
                self.over[name] = 0
            if name in self.out:
                if ratio < self.release:
                    self.out.discard(name)
                continue
            if self.over[name] >= self.patience:
                self.out.add(name)
                taken.append(self._act(name, choice, ratio))
        self.decisions += taken
        return taken

    def _act(self, name, choice, ratio):
        new = _candidates.get(choice).raise_to if self.action == "raise" else choice
        d = {"step": self.steps, "module": name, "from": choice, "to": new,
             "ratio": ratio, "action": self.action}
        if self.action == "raise":
            self.applied.set(name, new, Reason.MONITOR)
            self.out.discard(name)          # judged afresh at its new precision
            self.over[name] = 0
        else:
            warnings.warn(f"ampc.autoprecision.Monitor: step {self.steps}: module {name} "
                          f"({choice}) is at {ratio:.1f}x its error allowance", stacklevel=3)
        return d

    def measure(self, batch: tuple, names: list[str]) -> dict[str, dict[str, float | None]]:
        """{name: errors at its planned precision} on ``batch``, against fp32. Copies only
        the model's buffers and the modules in ``names`` (``copied_bytes`` says how much)."""
        model = self.applied.model
        state = _stand_ins(model)
        units = {n: copy.deepcopy(model.get_submodule(n)) for n in names}
        self.copied_bytes = _bytes(model.buffers()) + sum(_bytes(_tensors(m))
                                                          for m in units.values())
        batch = tuple(batch)
        plan = self.plan
        recipe = (_units.fp8_recipe(plan.data.get("fp8_recipe"))
                  if any(map(_candidates.fp8_linear, plan.choices.values())) else None)
        with torch.random.fork_rng(devices=[]):
            step = capture(model, batch, self.loss_fn, names, state=state)
            scale = _measure.loss_scale_for(step)      # where GradScaler would be now
            out = {}
            for name in names:
                rec = step.calls.get(name)
                if rec is None or not rec.returned:
                    out[name] = {}
                    continue
                m, c = units[name], plan.choice(name)
                if c == "fp32":
                    out[name] = {"loss_err": 0.0, "dgrad_err": 0.0, "wgrad_err": 0.0}
                    continue
                ref_y, ref_dx, ref_dw, _ = _measure.run_at(m, "fp32", rec, self.device, None, 1.0)
                s = scale if _candidates.loss_scaled(c) else 1.0
                y, dx, dw, _ = _measure.run_at(m, c, rec, self.device, recipe, s)
                out[name] = {"loss_err": loss_error(y, ref_y, rec.grad, step.loss),
                             "dgrad_err": rel_error(dx, ref_dx),
                             "wgrad_err": rel_error(dw, ref_dw)}
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"steps": self.steps, "cursor": self.cursor, "over": dict(self.over),
                "out": sorted(self.out), "history": list(self.history),
                "decisions": list(self.decisions), "spikes": list(self.spikes),
                "choices": self.plan.choices}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores the record and re-applies the choices it had taken."""
        self.steps, self.cursor = state["steps"], state["cursor"]
        self.over, self.out = dict(state["over"]), set(state["out"])
        self.history, self.decisions = list(state["history"]), list(state["decisions"])
        self.spikes = list(state.get("spikes", []))     # a record from before spikes: none
        for name, choice in state["choices"].items():
            if name in self.plan and self.plan.choice(name) != choice:
                self.applied.set(name, choice, Reason.MONITOR)
