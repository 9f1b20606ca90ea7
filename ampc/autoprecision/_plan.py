"""Plan: what search() chose, why, and what it measured (its application to a model is
``_apply``).

A plan is a record per unit (:class:`Unit`, frozen) kept by name, and the plan-wide
figures. A unit's choice changes through one method, :meth:`Plan.set_choice`, which
also keeps the counts of choices that the region dtype is read from: every lookup and
change is O(1), so applying a plan of n units costs O(n).
"""
from __future__ import annotations

import contextlib
import json
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING, Any

import torch

import ampc      # its fp8 attribute loads ampc.fp8 (and torch._dynamo) on first use only
from . import _apply, _candidates, _loss, _objectives, _step, _table
from ._apply import Applied
from ._solve import Budget
from ._units import Reason
from .._numerics.model import call_model, default_loss
from ..memory import micro_batch_backward as micro_backward
from ..validate import compare

if TYPE_CHECKING:
    from ..validate import Comparison

VERSION = 1


@dataclass(frozen=True)
class Unit:
    """One module of a plan: what it is, what it runs at and why, and what was measured
    (``options``: {candidate: figures}; ``rejected``: {candidate: why not})."""
    module: str
    type: str
    kind: str
    choice: str
    options: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    rejected: Mapping[str, str] = field(default_factory=dict)
    reason: Reason = Reason.SOLVED
    shapes: Mapping[str, list[int]] | None = None   # {parameter: shape}; None in older plans

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Unit:
        return cls(d["module"], d["type"], d.get("kind", "other"), d["choice"],
                   d.get("options", {}), d.get("rejected", {}), Reason(d.get("reason", "solved")),
                   d.get("shapes"))

    def as_dict(self) -> dict[str, Any]:
        d = {"module": self.module, "type": self.type, "kind": self.kind,
             "choice": self.choice, "options": self.options, "rejected": self.rejected,
             "reason": self.reason.value}
        if self.shapes is not None:
            d["shapes"] = self.shapes
        return d

    def __getitem__(self, key: str) -> Any:
        """Read access by the saved format's keys (``u["choice"]``), as plans were read
        before the records were typed; there is no item assignment."""
        if key not in _FIELDS:
            raise KeyError(key)
        value = getattr(self, key)
        return value.value if key == "reason" else value

    def figures(self, choice: str | None = None) -> Mapping[str, Any]:
        """What was measured at ``choice`` (default: its own), {} when not measured."""
        return self.options.get(choice or self.choice, {})


_FIELDS = frozenset(f.name for f in fields(Unit))
_REASONS = frozenset(r.value for r in Reason)


def _bad(msg):
    return ValueError(f"ampc.autoprecision.Plan: {msg}")


def _check_unit(k, d):
    """Raises a ValueError naming the field when ``d`` is not a unit record."""
    if not isinstance(d, Mapping):
        raise _bad(f"units[{k}] must be a dict, got {type(d).__name__}")
    for key in ("module", "type", "choice"):
        if not isinstance(d.get(key), str):
            raise _bad(f"units[{k}].{key} must be a string, got {d.get(key)!r}")
    where = f"units[{k}] ({d['module']!r})"
    if d["choice"] not in _candidates.REGISTRY:
        raise _bad(f"{where}.choice must be one of {', '.join(_candidates.REGISTRY)}, "
                   f"got {d['choice']!r}")
    for key in ("options", "rejected"):
        if not isinstance(d.get(key, {}), Mapping):
            raise _bad(f"{where}.{key} must be a dict, got {type(d[key]).__name__}")
    if not isinstance(d.get("kind", "other"), str):
        raise _bad(f"{where}.kind must be a string, got {d['kind']!r}")
    if d.get("reason", "solved") not in _REASONS:
        raise _bad(f"{where}.reason must be one of {', '.join(sorted(_REASONS))}, "
                   f"got {d['reason']!r}")
    shapes = d.get("shapes")
    if shapes is not None and not (
            isinstance(shapes, Mapping) and all(
                isinstance(v, (list, tuple)) and all(isinstance(n, int) and n >= 0 for n in v)
                for v in shapes.values())):
        raise _bad(f"{where}.shapes must map parameter names to lists of sizes, got {shapes!r}")


def _check_record(data):
    """Raises a ValueError naming the field when ``data`` is not a saved plan (version 1)."""
    if not isinstance(data, Mapping) or data.get("version") != VERSION:
        raise _bad(f"not a plan of version {VERSION}")
    if data.get("device") not in ampc.policy.DEVICES:
        raise _bad(f"device must be one of {', '.join(ampc.policy.DEVICES)}, "
                   f"got {data.get('device')!r}")
    if data.get("objective") not in _objectives.REGISTRY:
        raise _bad(f"objective must be one of {', '.join(_objectives.REGISTRY)}, "
                   f"got {data.get('objective')!r}")
    cands = data.get("candidates")
    if not isinstance(cands, (list, tuple)) or not all(c in _candidates.REGISTRY for c in cands):
        raise _bad(f"candidates must be a list of {', '.join(_candidates.REGISTRY)}, got {cands!r}")
    budget = data.get("budget")
    if not isinstance(budget, Mapping):
        raise _bad(f"budget must be a dict, got {budget!r}")
    try:
        Budget(**budget)
    except (TypeError, ValueError) as e:
        raise _bad(f"budget {dict(budget)!r} is not a budget: {e}") from None
    # noise_fraction came later: a plan saved without it was judged by the fixed figures
    missing = [f.name for f in fields(Budget) if f.name not in budget and f.name != "noise_fraction"]
    if missing:
        raise _bad(f"budget lacks {', '.join(missing)}")
    units = data.get("units")
    if not isinstance(units, (list, tuple)):
        raise _bad(f"units must be a list of unit records, got {units!r}")
    names = set()
    for k, d in enumerate(units):
        if not isinstance(d, Unit):
            _check_unit(k, d)
        name = d.module if isinstance(d, Unit) else d["module"]
        if name in names:
            raise _bad(f"units[{k}]: module {name!r} appears twice")
        names.add(name)
    _step.Step.from_record(data)
    _step.Peak.from_record(data.get("peak"))
    loss = data.get("loss")
    if loss is not None and not isinstance(loss, Unit):
        _check_unit("loss", loss)
        if loss["choice"] not in _candidates.loss_names():
            raise _bad(f"loss.choice must be one of {', '.join(_candidates.loss_names())}, "
                       f"got {loss['choice']!r}")


class Plan:
    """A precision per module, with the measurements it was chosen from.

    ``plan.choices`` maps module names to "fp32", "bf16", "fp16" or "fp8"; ``plan.dtype``
    is the autocast region's dtype (the ops outside every unit run at it). Print it
    (``table()``), save and load it (``save``, ``Plan.load``, ``as_dict``), paste it
    (``python()``), apply it (``apply(model)``), train under it (``autocast()``,
    ``scaler()``), check it over a training run (``verify``). ``plan.units`` lists the
    :class:`Unit` records, ``plan.unit(name)`` finds one; ``plan.data`` holds the
    plan-wide fields (device, budget, notes, backoffs, measured figures).
    """

    def __init__(self, data: Mapping[str, Any]) -> None:
        _check_record(data)     # every field, before anything reads one
        self.data = {k: v for k, v in data.items()
                     if k not in ("units", "loss", "peak", *_step.RECORD_KEYS)}
        self._step = _step.Step.from_record(data)
        self._peak = _step.Peak.from_record(data.get("peak"))
        loss = data.get("loss")
        # the loss unit (None: not measured; the loss runs as loss_fn does)
        self._loss = loss if isinstance(loss, Unit) or loss is None else Unit.from_dict(loss)
        self._units = {}
        self._counts = Counter()
        for d in data.get("units", []):
            u = d if isinstance(d, Unit) else Unit.from_dict(d)
            self._units[u.module] = u
            self._counts[u.choice] += 1

    # ---- what it says ----

    @property
    def units(self) -> list[Unit]:
        return list(self._units.values())

    def __len__(self) -> int:
        return len(self._units)

    def __iter__(self) -> Iterator[Unit]:
        return iter(self._units.values())

    def __contains__(self, name: object) -> bool:
        return name in self._units

    def unit(self, name: str) -> Unit:
        """The record of module ``name``, or of the loss (``"(loss)"``); KeyError when the
        plan has none."""
        if name == _loss.NAME and self._loss is not None:
            return self._loss
        return self._units[name]

    def choice(self, name: str) -> str:
        return self.unit(name).choice

    @property
    def every_unit(self) -> list[Unit]:
        """The records of the modules and, where measured, of the loss."""
        return self.units + ([self._loss] if self._loss is not None else [])

    @property
    def loss_unit(self) -> Unit | None:
        """The loss's record (module ``"(loss)"``), or None when the loss was not measured
        (a plan saved before, ``search(loss_unit=False)``, a model returning its own loss)."""
        return self._loss

    def set_choice(self, name: str, choice: str, reason: Reason = Reason.SET) -> Unit:
        """The one way a unit's choice changes; returns its new record."""
        if choice not in _candidates.REGISTRY:
            raise ValueError(f"ampc.autoprecision.Plan: choice must be one of "
                             f"{', '.join(_candidates.REGISTRY)}, got {choice!r}")
        if name == _loss.NAME and self._loss is not None:
            if choice not in _candidates.loss_names():
                raise ValueError(f"ampc.autoprecision.Plan: the loss's choice must be one "
                                 f"of {', '.join(_candidates.loss_names())}, got {choice!r}")
            self._loss = replace(self._loss, choice=choice, reason=Reason(reason))
            return self._loss
        old = self._units[name]
        new = replace(old, choice=choice, reason=Reason(reason))
        self._units[name] = new
        self._counts[old.choice] -= 1
        self._counts[choice] += 1
        return new

    def set_choices(self, choices: Mapping[str, str], reason: Reason) -> None:
        """set_choice for each (name, choice) of ``choices``."""
        for name, c in choices.items():
            self.set_choice(name, c, reason)

    @property
    def choices(self) -> dict[str, str]:
        """{module: choice} (the modules only)."""
        return {n: u.choice for n, u in self._units.items()}

    @property
    def decisions(self) -> dict[str, str]:
        """:attr:`choices` and, where the plan measured it, the loss's (``"(loss)"``)."""
        out = self.choices
        if self._loss is not None:
            out[_loss.NAME] = self._loss.choice
        return out

    def loss(self, loss_fn: Callable | None = None) -> Callable:
        """``loss_fn`` (default: cross-entropy over the last dim) run at the precision the
        plan chose for the loss: ``loss = plan.loss(loss_fn)(model(x), y)``. A plan that did
        not measure the loss returns ``loss_fn`` as it is."""
        if self._loss is None:
            return loss_fn or default_loss
        return _loss.AtPrecision(loss_fn, lambda: self._loss.choice, self.device)

    @property
    def device(self) -> str:
        return self.data["device"]

    def _uses_any(self, test):
        """Whether a unit's choice passes ``test`` (a name -> bool of _candidates)."""
        return any(n > 0 and test(c) for c, n in self._counts.items())

    @property
    def dtype(self) -> str:
        """The region dtype (_candidates.region_dtype): bf16 when any unit runs in bf16
        (fp8 included), else fp16 when any runs fp16, else fp32 (no autocast region)."""
        return _candidates.region_dtype(c for c, n in self._counts.items() if n > 0)

    @property
    def rest(self) -> str:
        """The precision of the ops outside every unit: the region dtype, or fp32 (a
        policy scope around the model) where that measured faster."""
        return "fp32" if self.data.get("rest") == "fp32" or self.dtype == "fp32" else self.dtype

    @property
    def budget(self) -> Budget:
        # a plan saved before noise_fraction was judged by the fixed figures alone
        return Budget(**{"noise_fraction": 0.0, **self.data["budget"]})

    def needs_scaler(self) -> bool:
        """An fp16 choice (a module's or the loss's) needs loss scaling (GradScaler)."""
        return (self._uses_any(_candidates.loss_scaled)
                or (self._loss is not None and _candidates.loss_scaled(self._loss.choice)))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Plan) and self.decisions == other.decisions and \
            self.dtype == other.dtype and replace(self.step, why={}) == replace(other.step, why={})

    def __repr__(self) -> str:
        counts = {c: n for c, n in self._counts.items() if n}
        return (f"Plan({len(self._units)} modules: "
                + ", ".join(f"{n} {c}" for c, n in sorted(counts.items())) + ")")

    @property
    def step(self) -> _step.Step:
        """The whole-step choices: the weights' and optimizer's state, freed gradients, the
        blocks recomputed, the heads sliced (:class:`ampc.autoprecision.Step`)."""
        return self._step

    def set_step(self, **changes: Any) -> _step.Step:
        """The one way the step's choices change (``plan.set_step(state="lean")``)."""
        self._step = replace(self._step, **changes)
        return self._step

    @property
    def peak(self) -> _step.Peak | None:
        """A byte budget's figures (:class:`ampc.autoprecision.Peak`), None without one."""
        return self._peak

    def set_peak(self, peak: _step.Peak | None) -> None:
        self._peak = peak

    # ---- the table ----

    def table(self, details: bool = False) -> str:
        """The plan as text, at most 120 columns: a row per unit (its choice, errors, time
        and, in a word or two, why not lower), the budget, the measured saving, back-offs,
        notes. ``details=True``: every candidate's time and the reasons in full (wide)."""
        return _table.render(self, details)

    def __str__(self) -> str:
        return self.table()

    # ---- JSON ----

    def _record(self):
        out = dict(self.data, **self._step.record(), units=[u.as_dict() for u in self])
        if self._peak is not None:
            out["peak"] = self._peak.record()
        if self._loss is not None:
            out["loss"] = self._loss.as_dict()
        return out

    def as_dict(self) -> dict[str, Any]:
        return json.loads(json.dumps(self._record()))

    def to_json(self) -> str:
        return json.dumps(self._record(), indent=1, allow_nan=True)

    @classmethod
    def from_json(cls, text: str) -> Plan:
        return cls(json.loads(text))

    def save(self, path: str) -> str:
        with open(path, "w") as f:
            f.write(self.to_json() + "\n")
        return path

    @classmethod
    def load(cls, path: str) -> Plan:
        with open(path) as f:
            return cls.from_json(f.read())

    # ---- pasteable Python ----

    def python(self) -> str:
        """The plan as Python lines to paste after the model is built (``model``): the
        scopes :meth:`apply` would attach, the fp8 conversions, and the training step."""
        return _apply.python(self)

    # ---- using it ----

    def apply(self, model: torch.nn.Module) -> Applied:
        """Gives each module of the plan its precision; returns an :class:`Applied` (see
        ``_apply.apply``: what it refuses before changing anything)."""
        return _apply.apply(self, model)

    def prepare(self, model: torch.nn.Module, optimizer: Callable = None,
                **kwargs: Any) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        """(model, optimizer) ready to train as the plan says: the weights and the
        optimizer's state as :attr:`step` chose (``ampc.prepare`` for bf16 weights), each
        gradient freed in the backward where it chose so, then :meth:`apply` (each module's
        precision, saved activations, blocks recomputed, heads sliced). ``optimizer``: a
        class or callable taking the params and ``kwargs`` (default ``ampc.optim.AdamW``;
        one of ampc's where the state is not "fp32" or gradients are freed), or such an
        optimizer made already over the model's parameters, before its first step (a
        framework's: its layout is set as the plan says). The loop is the
        usual one, inside :meth:`autocast`, with :meth:`loss`. ``model`` is changed in place;
        the optimizer's step count and state start fresh."""
        model, opt = self.prepare_state(model, optimizer, **kwargs)
        self.apply(model)
        return model, opt

    def prepare_state(self, model: torch.nn.Module, optimizer: Callable = None,
                      **kwargs: Any) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        """:meth:`prepare` without :meth:`apply`: the weights, the optimizer's state and the
        gradient release alone (for a caller that applies the modules' part itself and keeps
        its :class:`Applied`)."""
        return _step.prepare_state(self, model, optimizer, **kwargs)

    def autocast(self) -> contextlib.ExitStack:
        """The region to train in: ampc.autocast at the region dtype, with an FP8 region
        (only the plan's fp8 modules) when there are any."""
        return _apply.autocast(self)

    def backward(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
                 batch: tuple, loss_fn: Callable | None = None,
                 scaler: ampc.GradScaler | None = None) -> torch.Tensor:
        """A training step's forward and backward on ``batch`` (``(inputs, target)``) as the
        plan says: inside :meth:`autocast`, the loss by :meth:`loss`, the batch in
        ``step.micro_batches`` micro-batches with their gradients summed (the pieces but the
        last inside ``optimizer.accumulating()``; ``ampc.memory.micro_batches``), each loss
        scaled by ``scaler`` where given. Returns the batch's loss (detached); the step is
        the caller's: ``opt.zero_grad()``, ``plan.backward(model, opt, batch, loss_fn)``,
        ``opt.step()``. A plan with an fp16 module needs ``scaler`` (``plan.scaler()``, its
        step and update the caller's): refused without one, before anything runs, since
        fp16 gradients unscaled can underflow where the search measured them scaled."""
        if scaler is None and self.needs_scaler():
            fp16 = [u.module for u in self.every_unit if _candidates.loss_scaled(u.choice)]
            raise ValueError(
                f"ampc.autoprecision.Plan.backward: the plan runs {', '.join(fp16[:3])}"
                f"{' and others' if len(fp16) > 3 else ''} in fp16, which needs loss scaling: "
                "pass scaler=plan.scaler() and step through it (scaler.step(opt); "
                "scaler.update())")
        loss = self.loss(loss_fn)

        def loss_of(piece):
            with self.autocast():
                out = call_model(model, piece[0])
            return loss(out, piece[1])
        return micro_backward(optimizer, batch, self._step.micro_batches, loss_of, scaler)

    def scaler(self, **kwargs: Any) -> ampc.GradScaler | None:
        """An ampc.GradScaler when a module runs fp16, else None."""
        return ampc.GradScaler(self.device, **kwargs) if self.needs_scaler() else None

    def verify(self, make_model: Callable[[], torch.nn.Module], make_batch: Callable[[int], tuple],
               steps: int = 50, loss_fn: Callable | None = None, *,
               setups: tuple[str, ...] = ("torch.amp",), seeds: tuple[int, ...] = (0, 1),
               **kwargs: Any) -> Comparison:
        """``ampc.validate.compare`` of fp32, the ``setups`` (uniform torch.amp at the region
        dtype by default) and this plan, each trained from every seed, the runs of a seed
        from the same weights on the same batches. Returns the Comparison: its table gives
        each one's gap to fp32 of the same seed over the last quarter of the run, the
        verdict (inside fp32's run-to-run spread or not) and the median step time.
        ``monitor=dict(...)`` trains the plan's runs with a :class:`Monitor` of those
        arguments watching each (what it did is printed under the table).

        The runs train in lockstep (a step of each in turn: ``time_limit=inf`` unless
        given), so that a machine whose load changes during the verification slows every
        run alike and the step times compare; every model is held at once. Pass
        ``time_limit=None`` to train them one after another."""
        kwargs.setdefault("time_limit", float("inf"))
        dtype = _candidates.get("bf16" if self.dtype == "fp32" else self.dtype).dtype
        return compare(make_model, make_batch, loss_fn, steps,
                                setups=tuple(setups) + (self,), dtype=dtype, device=self.device,
                                seeds=seeds, **kwargs)
