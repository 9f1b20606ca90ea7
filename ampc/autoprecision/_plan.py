"""Plan: what search() chose, why, and what it measured; applies itself to a model.

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
from . import _loss, _table, _units
from ._monitor import Monitor
from ._solve import Budget
from ._units import Reason
from .._numerics import failures
from .._numerics.model import default_loss, expression
from ..validate import compare

if TYPE_CHECKING:
    from ..validate import Comparison

VERSION = 1
RAISE_TO = _units.RAISE_TO


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
_OBJECTIVES = ("time", "memory")


def param_shapes(module: torch.nn.Module) -> dict[str, list[int]]:
    """{parameter name: shape} of ``module``, as a plan records it."""
    return {n: list(p.shape) for n, p in module.named_parameters()}


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
    if d["choice"] not in _units.CANDIDATES:
        raise _bad(f"{where}.choice must be one of {', '.join(_units.CANDIDATES)}, "
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
    if data.get("objective") not in _OBJECTIVES:
        raise _bad(f"objective must be one of {', '.join(_OBJECTIVES)}, "
                   f"got {data.get('objective')!r}")
    cands = data.get("candidates")
    if not isinstance(cands, (list, tuple)) or not all(c in _units.CANDIDATES for c in cands):
        raise _bad(f"candidates must be a list of {', '.join(_units.CANDIDATES)}, got {cands!r}")
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
    loss = data.get("loss")
    if loss is not None and not isinstance(loss, Unit):
        _check_unit("loss", loss)
        if loss["choice"] not in _loss.CANDIDATES:
            raise _bad(f"loss.choice must be one of {', '.join(_loss.CANDIDATES)}, "
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
        self.data = {k: v for k, v in data.items() if k not in ("units", "loss")}
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
        if choice not in _units.CANDIDATES:
            raise ValueError(f"ampc.autoprecision.Plan: choice must be one of "
                             f"{', '.join(_units.CANDIDATES)}, got {choice!r}")
        if name == _loss.NAME and self._loss is not None:
            if choice not in _loss.CANDIDATES:
                raise ValueError(f"ampc.autoprecision.Plan: the loss's choice must be one "
                                 f"of {', '.join(_loss.CANDIDATES)}, got {choice!r}")
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

    def _uses(self, choice):
        return self._counts[choice] > 0

    @property
    def dtype(self) -> str:
        """The region dtype: bf16 when any unit runs bf16 or fp8, else fp16 when any runs
        fp16, else fp32 (no autocast region at all)."""
        if self._uses("bf16") or self._uses("fp8"):
            return "bf16"
        return "fp16" if self._uses("fp16") else "fp32"

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
        return self._uses("fp16") or (self._loss is not None and self._loss.choice == "fp16")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Plan) and self.decisions == other.decisions and \
            self.dtype == other.dtype

    def __repr__(self) -> str:
        counts = {c: n for c, n in self._counts.items() if n}
        return (f"Plan({len(self._units)} modules: "
                + ", ".join(f"{n} {c}" for c, n in sorted(counts.items())) + ")")

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
        out = dict(self.data, units=[u.as_dict() for u in self])
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
        dev, region = self.device, self.dtype
        lines = [f"# ampc.autoprecision plan: {len(self.units)} modules, region {region}",
                 "import torch", "import ampc", ""]
        fp8 = []
        for u in self:
            c = u.choice
            if c == "fp8":
                fp8.append(u.module)
            if _by_region(self, u.kind, c):
                continue
            ops = ""
            if u.kind == "norm" and c != "fp32":
                ops = (", ops={" + ", ".join(f'"{o}": "lower_precision_fp"'
                                             for o in _units.REDUCTION_OPS) + "}")
            out = _cast_outputs(self, c)
            if out is not None:
                ops += f", cast_outputs={_torch_dtype(out)}"
            lines.append(f"ampc.policy.module_scope({expression(u.module)}, "
                         f"dtype={_torch_dtype(_units.DTYPES[c])}{ops})")
        if fp8:
            lines += ["", f"FP8_MODULES = {set(fp8)!r}", "",
                      "def fp8_filter(module, fqn):",
                      "    return fqn in FP8_MODULES", "",
                      "for fqn, module in model.named_modules():",
                      "    if fp8_filter(module, fqn):",
                      "        ampc.fp8.convert(module)"]
        step, loss = self._loss_lines(dev)
        if region == "fp32":          # no autocast region at all
            lines += ["", f"# each step (every module fp32: nothing to set): {step}"] + loss
            return "\n".join(lines)
        ctx = f'ampc.autocast("{dev}", dtype={_torch_dtype(_units.DTYPES[region])})'
        if self.rest == "fp32":
            ctx += ", ampc.policy.scope(dtype=torch.float32)"
        if fp8:
            ctx += ", ampc.fp8.autocast(recipe=ampc.fp8.DelayedScaling(), modules=())"
        lines += ["", f"# each step: with {ctx}: {step}"] + loss
        if self.needs_scaler():
            lines.append(f'# fp16 choices need loss scaling: scaler = ampc.GradScaler("{dev}")')
        return "\n".join(lines)

    def _loss_lines(self, dev):
        """The step's model line and the lines computing the loss at its precision."""
        if self._loss is None:
            return "loss = loss_fn(model(x), y)", []
        c = self._loss.choice
        if c == "fp32":
            return "out = model(x)", ["# then, outside it: loss = loss_fn(out.float(), y)"]
        dt = _torch_dtype(_units.DTYPES[c])
        ops = "{" + ", ".join(f'"{o}": "lower_precision_fp"' for o in _loss.LOSS_OPS) + "}"
        return "out = model(x)", [
            f"# then the loss in {c}: with ampc.autocast(\"{dev}\", dtype={dt}), "
            f"ampc.policy.scope(dtype={dt}, ops=LOSS_OPS): "
            f"loss = loss_fn(out.to({dt}), y).float()",
            f"LOSS_OPS = {ops}"]

    # ---- using it ----

    def apply(self, model: torch.nn.Module) -> Applied:
        """Gives each module of the plan its precision (a module_scope, and for fp8 an
        ampc.fp8.Linear). Refuses, before changing anything, a plan naming a module
        ``model`` lacks, one of another type or with parameters of other shapes (plans
        that record them), or fp8 on a module that cannot take it; should placing a
        module still fail, the modules placed so far are put back as they were.
        Returns an :class:`Applied` listing every module changed."""
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"ampc.autoprecision.Plan.apply: model must be an nn.Module, "
                            f"got {type(model).__name__}")
        _refuse_compiled(self, model)
        modules = dict(model.named_modules())
        missing = [u.module for u in self if u.module not in modules]
        if missing:
            raise ValueError(f"ampc.autoprecision.Plan.apply: the plan names {len(missing)} "
                             f"module(s) the model does not have: {', '.join(missing)}")
        for u in self:
            _check_module(u, modules[u.module])
        before = {u.module: (type(m), {n for n, _ in m.named_buffers(recurse=False)})
                  for u in self for m in [modules[u.module]]}
        applied = Applied(self, model)
        try:
            for u in self:
                applied.place(u.module)
        except BaseException:
            applied.remove()
            for name, (cls, buffers) in before.items():    # fp8.convert's class and state
                m = modules[name]
                for n in {n for n, _ in m.named_buffers(recurse=False)} - buffers:
                    delattr(m, n)
                m.__class__ = cls
            raise
        return applied

    def autocast(self) -> contextlib.ExitStack:
        """The region to train in: ampc.autocast at the region dtype, with an FP8 region
        (only the plan's fp8 modules) when there are any."""
        stack = contextlib.ExitStack()
        if self.dtype != "fp32":
            stack.enter_context(ampc.autocast(self.device, dtype=_units.DTYPES[self.dtype]))
            if self.rest == "fp32":     # the modules' own scopes set their precision inside
                stack.enter_context(ampc.policy.scope(dtype=torch.float32))
        if self._uses("fp8"):
            stack.enter_context(ampc.fp8.autocast(recipe=_units.fp8_recipe(self.data.get("fp8_recipe")),
                                                  modules=()))
        return stack

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
        verdict (inside fp32's run-to-run spread or not) and the median step time."""
        dtype = _units.DTYPES["bf16" if self.dtype == "fp32" else self.dtype]
        return compare(make_model, make_batch, loss_fn, steps,
                                setups=tuple(setups) + (self,), dtype=dtype, device=self.device,
                                seeds=seeds, **kwargs)


def _refuse_compiled(plan, model):
    """Raises a ValueError when a module the plan sets lies in a torch.compile'd part: its
    scope switches the autocast state at the module's boundary, which torch.compile cannot
    trace (AOTAutograd refuses the graph once an fp8 module breaks it)."""
    for part in failures.compiled_parts(model):
        names = [u.module for u in plan if not part or u.module.startswith(part + ".")]
        if names:
            raise ValueError(
                f"ampc.autoprecision.Plan.apply: {part or 'the model'} is compiled with "
                f"torch.compile and the plan sets module(s) inside it ({names[0]} ...), which "
                f"torch.compile cannot trace (each switches the autocast state); apply the "
                f"plan to the model uncompiled ({failures.unwrap_hint(part)})")


def _check_module(u, m):
    """Raises a ValueError when module ``m`` is not the one unit ``u`` was measured on."""
    if type(m).__name__ != u.type:
        raise ValueError(f"ampc.autoprecision.Plan.apply: module {u.module} is a "
                         f"{type(m).__name__}, the plan was made for a {u.type}")
    if u.shapes is not None:
        have = param_shapes(m)
        want = {n: list(v) for n, v in u.shapes.items()}
        if have != want:
            raise ValueError(f"ampc.autoprecision.Plan.apply: module {u.module} has "
                             f"parameters {have}, the plan was made for {want}")
    if u.choice == "fp8" and not (_units.fp8_capable(m) or _is_fp8(m)):
        raise ValueError(f"ampc.autoprecision.Plan.apply: module {u.module} cannot "
                         "run in fp8 (an nn.Linear with in and out features multiple "
                         "of 16)")


def _by_region(plan, kind, choice):
    """Whether a unit of ``kind`` at ``choice`` needs no scope of its own: a GEMM at the
    dtype the region gives the ops outside the units (a scope's hooks cost time on every
    call), or any module of an all-fp32 plan (no autocast region); norms in 16 bits always
    get theirs (their reduction)."""
    return (kind != "norm" and choice == plan.rest and choice != "fp8") or plan.dtype == "fp32"


def _cast_outputs(plan, choice):
    """float32 for a unit whose 16-bit dtype is not the one the region gives the ops around
    it (fp16 in a bf16 region), else None: torch's autocast refuses such a tensor in its
    promote ops (a cache's ``cat``), and float32 holds the unit's result without rounding."""
    mine, rest = _units.DTYPES[choice], _units.DTYPES[plan.rest]
    if torch.float32 in (mine, rest) or mine == rest:
        return None
    return torch.float32


def _torch_dtype(dtype):
    return "torch." + str(dtype).split(".")[-1]


def _is_fp8(module):
    return isinstance(module, ampc.fp8.Linear)


class _Fp8Off:
    """Hooks that run one ampc.fp8.Linear outside FP8 (a nested disabled fp8 region)."""

    def __init__(self, module):
        self.stack = []

        def pre(mod, args):
            ctx = ampc.fp8.autocast(enabled=False)
            ctx.__enter__()
            self.stack.append(ctx)

        def post(mod, args, out):
            if self.stack:      # the pre-hook may have been traced by torch.compile, not run
                self.stack.pop().__exit__(None, None, None)

        self.handles = [module.register_forward_pre_hook(pre),
                        module.register_forward_hook(post, always_call=True)]

    def remove(self):
        for h in self.handles:
            h.remove()


class Applied:
    """A plan applied to a model: ``changes`` lists (module, type, choice) for every
    module given a precision; ``set(name, choice)`` changes one; ``remove()`` takes the
    scopes off again (fp8 modules stay ampc.fp8.Linear, run outside FP8)."""

    def __init__(self, plan: Plan, model: torch.nn.Module) -> None:
        self.plan, self.model = plan, model
        self.modules = dict(model.named_modules())
        self.handles = {}
        self._changes = {}       # name -> (name, type, choice), in the order first set
        self._by_region = {}     # modules the region's dtype already gives their choice

    @property
    def changes(self) -> list[tuple[str, str, str]]:
        return list(self._changes.values())

    @property
    def by_region(self) -> list[str]:
        return list(self._by_region)

    def set(self, name: str, choice: str, reason: Reason = Reason.SET) -> None:
        """Gives module ``name`` (or the loss, ``"(loss)"``) the precision ``choice`` (the
        plan's record changes too; a ``plan.loss(...)`` made before follows it)."""
        if choice == "fp8" and name in self.modules:   # fp8.convert would skip a Conv1D silently
            _check_module(replace(self.plan.unit(name), choice=choice), self.modules[name])
        region = (self.plan.dtype, self.plan.rest)
        self.plan.set_choice(name, choice, reason)
        if name == _loss.NAME and self.plan.loss_unit is not None:
            return
        # a new region dtype changes what every unit needs (its scope, its outputs' cast)
        others = [n for n in self.handles if n != name] \
            if (self.plan.dtype, self.plan.rest) != region else []
        for n in others + [name]:
            self.place(n)

    def place(self, name: str) -> None:
        """Puts module ``name`` at the precision its plan record holds."""
        m = self.modules[name]
        choice = self.plan.choice(name)
        for h in self.handles.pop(name, []):
            h.remove()
        dtype, ops = _units.scope_args(m, choice)
        # an ampc.fp8.Linear at another choice keeps a scope (its dtype outside FP8)
        fp8_now = _is_fp8(m)
        by_region = _by_region(self.plan, _units.kind(m), choice) and not fp8_now
        handles = [] if by_region else [ampc.policy.module_scope(
            m, dtype=dtype, ops=ops, cast_outputs=_cast_outputs(self.plan, choice))]
        if choice == "fp8":
            ampc.fp8.convert(m)
        elif fp8_now:
            handles.append(_Fp8Off(m))
        self.handles[name] = handles
        self._changes.pop(name, None)
        self._changes[name] = (name, type(m).__name__, choice)
        self._by_region.pop(name, None)
        if by_region:
            self._by_region[name] = None

    def remove(self) -> None:
        for hs in self.handles.values():
            for h in hs:
                h.remove()
        self.handles = {}

    def __str__(self) -> str:
        return "\n".join([f"ampc.autoprecision: {len(self._changes)} modules set"]
                         + [f"  {n} ({t}): {c}" + (" (by the autocast region)"
                                                    if n in self._by_region else "")
                            for n, t, c in self._changes.values()])

    def monitor(self, loss_fn: Callable | None = None, **kwargs: Any) -> Monitor:
        """A :class:`Monitor` re-checking these modules during training."""
        return Monitor(self, loss_fn, **kwargs)
