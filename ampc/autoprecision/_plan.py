"""Plan: what search() chose, why, and what it measured; applies itself to a model."""
import contextlib
import json
import math

import torch

from . import _units
from ._solve import Budget
from ..validate._layers import expression
from ..validate._report import format_table

VERSION = 1
RAISE_TO = {"fp8": "bf16", "bf16": "fp32", "fp16": "fp32", "fp32": "fp32"}


def _fmt(v, spec=".1e"):
    if v is None:
        return "-"
    if isinstance(v, float) and not math.isfinite(v):
        return "inf"
    return format(v, spec)


class Plan:
    """A precision per module, with the measurements it was chosen from.

    ``plan.choices`` maps module names to "fp32", "bf16", "fp16" or "fp8"; ``plan.dtype``
    is the autocast region's dtype (the ops outside every unit run at it). Print it
    (``table()``), save and load it (``save``, ``Plan.load``, ``as_dict``), paste it
    (``python()``), apply it (``apply(model)``), train under it (``autocast()``,
    ``scaler()``), check it over a training run (``verify``).
    """

    def __init__(self, data):
        if not isinstance(data, dict) or data.get("version") != VERSION:
            raise ValueError(f"ampc.autoprecision.Plan: not a plan of version {VERSION}")
        self.data = data

    # ---- what it says ----

    @property
    def units(self):
        return self.data["units"]

    @property
    def choices(self):
        return {u["module"]: u["choice"] for u in self.units}

    @property
    def device(self):
        return self.data["device"]

    @property
    def dtype(self):
        """The region dtype: bf16 when any unit runs bf16 or fp8, else fp16 when any runs
        fp16, else fp32 (no autocast region at all)."""
        chosen = set(self.choices.values())
        if chosen & {"bf16", "fp8"}:
            return "bf16"
        return "fp16" if "fp16" in chosen else "fp32"

    @property
    def rest(self):
        """The precision of the ops outside every unit: the region dtype, or fp32 (a
        policy scope around the model) where that measured faster."""
        return "fp32" if self.data.get("rest") == "fp32" or self.dtype == "fp32" else self.dtype

    @property
    def budget(self):
        return Budget(**self.data["budget"])

    def needs_scaler(self):
        """An fp16 choice needs loss scaling (GradScaler)."""
        return "fp16" in self.choices.values()

    def __eq__(self, other):
        return isinstance(other, Plan) and self.choices == other.choices and \
            self.dtype == other.dtype

    def __repr__(self):
        counts = {}
        for c in self.choices.values():
            counts[c] = counts.get(c, 0) + 1
        return (f"Plan({len(self.units)} modules: "
                + ", ".join(f"{n} {c}" for c, n in sorted(counts.items())) + ")")

    # ---- the table ----

    def table(self):
        cands = self.data["candidates"]
        header = (["module", "type", "choice", "loss err", "dgrad err", "wgrad err"]
                  + [f"ms {c}" for c in cands] + ["why not lower"])
        rows = []
        for u in self.units:
            r = u["options"].get(u["choice"], {})
            times = [_fmt(u["options"][c].get("ms"), ".2f") if c in u["options"] else "n/a"
                     for c in cands]
            why = "; ".join(f"{c}: {w}" for c, w in u.get("rejected", {}).items())
            if not why and u["choice"] == "fp32" and len(u["options"]) > 1:
                why = "fp32: the cheapest within the summed budget"
            rows.append([u["module"], u["type"], u["choice"], _fmt(r.get("loss_err")),
                         _fmt(r.get("dgrad_err")), _fmt(r.get("wgrad_err"))] + times + [why or "-"])
        d = self.data
        b = d["budget"]
        lines = [f"ampc.autoprecision plan: {len(self.units)} modules on {d['device']} "
                 f"({d.get('where', '')}), objective {d['objective']}, region {self.dtype}, "
                 f"ops outside these modules {self.rest}; "
                 f"budget per step: loss {b['loss']:g}, grad {b['grad']:g}, "
                 f"wgrad {b['wgrad']:g} (relative to fp32)",
                 format_table(header, rows)]
        pred = d.get("predicted") or {}
        if pred:
            lines.append(f"predicted (sum over modules, forward + backward): fp32 "
                         f"{pred['fp32_ms']:.2f} ms, plan {pred['plan_ms']:.2f} ms, saving "
                         f"{pred['fp32_ms'] - pred['plan_ms']:.2f} ms per step")
        m = d.get("measured")
        if m:
            lines.append(f"measured (whole model, forward + backward): fp32 {m['fp32_ms']:.2f} ms, "
                         f"plan {m['plan_ms']:.2f} ms, saving {m['fp32_ms'] - m['plan_ms']:.2f} ms "
                         f"per step; loss err {_fmt(m['loss_err'])}, grad err "
                         f"{_fmt(m['grad_err'])}, worst wgrad err {_fmt(m['wgrad_err'])} "
                         f"({m['wgrad_worst'] or '-'})")
        for step in d.get("backoffs", []):
            lines.append(f"backed off: {step['module']} {step['from']} -> {step['to']} "
                         f"({step['why']})")
        lines += [f"note: {n}" for n in d.get("notes", [])]
        if d.get("search_s") is not None:
            lines.append(f"search took {d['search_s']:.1f} s")
        return "\n".join(lines)

    def __str__(self):
        return self.table()

    # ---- JSON ----

    def as_dict(self):
        return json.loads(json.dumps(self.data))

    def to_json(self):
        return json.dumps(self.data, indent=1, allow_nan=True)

    @classmethod
    def from_json(cls, text):
        return cls(json.loads(text))

    def save(self, path):
        with open(path, "w") as f:
            f.write(self.to_json() + "\n")
        return path

    @classmethod
    def load(cls, path):
        with open(path) as f:
            return cls.from_json(f.read())

    # ---- pasteable Python ----

    def python(self):
        """The plan as Python lines to paste after the model is built (``model``)."""
        dev, region = self.device, self.dtype
        lines = [f"# ampc.autoprecision plan: {len(self.units)} modules, region {region}",
                 "import torch", "import ampc", ""]
        fp8 = []
        for u in self.units:
            c = u["choice"]
            if c == "fp8":
                fp8.append(u["module"])
            expr = expression(u["module"])
            ops = ""
            if u["kind"] == "norm" and c != "fp32":
                ops = (", ops={" + ", ".join(f'"{o}": "lower_precision_fp"'
                                             for o in _units.REDUCTION_OPS) + "}")
            lines.append(f"ampc.policy.module_scope({expr}, "
                         f"dtype={_torch_dtype(_units.DTYPES[c])}{ops})")
        if fp8:
            lines += ["", f"FP8_MODULES = {set(fp8)!r}", "",
                      "def fp8_filter(module, fqn):",
                      "    return fqn in FP8_MODULES", "",
                      "for fqn, module in model.named_modules():",
                      "    if fp8_filter(module, fqn):",
                      "        ampc.fp8.convert(module)"]
        region = (f'ampc.autocast("{dev}", dtype={_torch_dtype(_units.DTYPES[region])})'
                  if region != "fp32" else "contextlib.nullcontext()")
        if self.rest == "fp32" and self.dtype != "fp32":
            region += ", ampc.policy.scope(dtype=torch.float32)"
        if fp8:
            region += ", ampc.fp8.autocast(recipe=ampc.fp8.DelayedScaling(), modules=())"
        lines += ["", f"# each step: with {region}: loss = loss_fn(model(x), y)"]
        if self.needs_scaler():
            lines.append(f'# fp16 choices need loss scaling: scaler = ampc.GradScaler("{dev}")')
        return "\n".join(lines)

    # ---- using it ----

    def apply(self, model):
        """Gives each module of the plan its precision (a module_scope, and for fp8 an
        ampc.fp8.Linear). Refuses, before changing anything, a plan naming a module
        ``model`` lacks, one of another type, or fp8 on a module that cannot take it.
        Returns an :class:`Applied` listing every module changed."""
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"ampc.autoprecision.Plan.apply: model must be an nn.Module, "
                            f"got {type(model).__name__}")
        modules = dict(model.named_modules())
        missing = [u["module"] for u in self.units if u["module"] not in modules]
        if missing:
            raise ValueError(f"ampc.autoprecision.Plan.apply: the plan names {len(missing)} "
                             f"module(s) the model does not have: {', '.join(missing)}")
        for u in self.units:
            m = modules[u["module"]]
            if type(m).__name__ != u["type"]:
                raise ValueError(f"ampc.autoprecision.Plan.apply: module {u['module']} is a "
                                 f"{type(m).__name__}, the plan was made for a {u['type']}")
            if u["choice"] == "fp8" and not (_units.fp8_capable(m) or _is_fp8(m)):
                raise ValueError(f"ampc.autoprecision.Plan.apply: module {u['module']} cannot "
                                 "run in fp8 (an nn.Linear with in and out features multiple "
                                 "of 16)")
        applied = Applied(self, model)
        for u in self.units:
            applied.set(u["module"], u["choice"])
        return applied

    def autocast(self):
        """The region to train in: ampc.autocast at the region dtype, with an FP8 region
        (only the plan's fp8 modules) when there are any."""
        import ampc
        stack = contextlib.ExitStack()
        if self.dtype != "fp32":
            stack.enter_context(ampc.autocast(self.device, dtype=_units.DTYPES[self.dtype]))
            if self.rest == "fp32":     # the modules' own scopes set their precision inside
                stack.enter_context(ampc.policy.scope(dtype=torch.float32))
        if "fp8" in self.choices.values():
            stack.enter_context(ampc.fp8.autocast(recipe=_recipe(self.data.get("fp8_recipe")),
                                                  modules=()))
        return stack

    def scaler(self, **kwargs):
        """An ampc.GradScaler when a module runs fp16, else None."""
        import ampc
        return ampc.GradScaler(self.device, **kwargs) if self.needs_scaler() else None

    def verify(self, make_model, make_batch, steps=50, loss_fn=None, *, setups=("torch.amp",),
               seeds=(0, 1), **kwargs):
        """``ampc.validate.compare`` of fp32 (from each seed: its run-to-run spread), the
        ``setups`` (uniform torch.amp at the region dtype by default) and this plan,
        trained from the same weights on the same batches. Returns the Comparison: its
        table gives each one's gap to fp32, the verdict (inside fp32's spread or not) and
        the median step time."""
        from .. import validate
        dtype = _units.DTYPES["bf16" if self.dtype == "fp32" else self.dtype]
        return validate.compare(make_model, make_batch, loss_fn, steps,
                                setups=tuple(setups) + (self,), dtype=dtype, device=self.device,
                                seeds=seeds, **kwargs)


def _torch_dtype(dtype):
    return "torch." + str(dtype).split(".")[-1]


def _is_fp8(module):
    import ampc
    return isinstance(module, ampc.fp8.Linear)


def _recipe(name):
    import ampc
    return ampc.fp8.Float8CurrentScaling() if name == "current" else ampc.fp8.DelayedScaling()


class _Fp8Off:
    """Hooks that run one ampc.fp8.Linear outside FP8 (a nested disabled fp8 region)."""

    def __init__(self, module):
        import ampc
        self.stack = []

        def pre(mod, args):
            ctx = ampc.fp8.autocast(enabled=False)
            ctx.__enter__()
            self.stack.append(ctx)

        def post(mod, args, out):
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

    def __init__(self, plan, model):
        self.plan, self.model = plan, model
        self.modules = dict(model.named_modules())
        self.handles = {}
        self.changes = []
        self.by_region = []     # modules the region's dtype already gives their choice

    def set(self, name, choice):
        import ampc
        m = self.modules[name]
        for h in self.handles.pop(name, []):
            h.remove()
        for u in self.plan.units:
            if u["module"] == name:
                u["choice"] = choice
        dtype, ops = _units.scope_args(m, choice)
        # a GEMM at the dtype the region gives the ops outside the units needs no scope (a
        # scope's hooks cost time on every call), nor does any module of an all-fp32 plan
        # (no autocast region); norms in 16 bits always get theirs (their reduction)
        by_region = ((_units.kind(m) != "norm" and choice == self.plan.rest and choice != "fp8"
                      and not _is_fp8(m))
                     or (self.plan.dtype == "fp32" and not _is_fp8(m)))   # no region at all
        handles = [] if by_region else [ampc.policy.module_scope(m, dtype=dtype, ops=ops)]
        if choice == "fp8":
            ampc.fp8.convert(m)
        elif _is_fp8(m):
            handles.append(_Fp8Off(m))
        self.handles[name] = handles
        self.changes = [c for c in self.changes if c[0] != name] + [(name, type(m).__name__, choice)]
        self.by_region = [n for n in self.by_region if n != name] + \
            ([name] if by_region else [])

    def remove(self):
        for hs in self.handles.values():
            for h in hs:
                h.remove()
        self.handles = {}

    def __str__(self):
        region = set(self.by_region)
        return "\n".join([f"ampc.autoprecision: {len(self.changes)} modules set"]
                         + [f"  {n} ({t}): {c}" + (" (by the autocast region)" if n in region
                                                    else "") for n, t, c in self.changes])

    def monitor(self, loss_fn=None, **kwargs):
        """A :class:`Monitor` re-checking these modules during training."""
        from ._monitor import Monitor
        return Monitor(self, loss_fn, **kwargs)
