"""A plan applied: each unit's precision put on its module (a module_scope, an
ampc.fp8.Linear), the region to train in, and the same as Python lines to paste. The
record itself (what was chosen, why, what was measured) is ``_plan.Plan``."""
from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

import ampc      # its fp8 attribute loads ampc.fp8 (and torch._dynamo) on first use only
from . import _candidates, _loss, _units
from ._monitor import Monitor
from ._units import Reason
from .._numerics import failures
from .._numerics.model import expression

def param_shapes(module: torch.nn.Module) -> dict[str, list[int]]:
    """{parameter name: shape} of ``module``, as a plan records it."""
    return {n: list(p.shape) for n, p in module.named_parameters()}


def apply(plan, model: torch.nn.Module) -> Applied:
    """Gives each module of the plan its precision (a module_scope, and for fp8 an
    ampc.fp8.Linear). Refuses, before changing anything, a plan naming a module
    ``model`` lacks, one of another type or with parameters of other shapes (plans
    that record them), or fp8 on a module that cannot take it; should placing a
    module still fail, the modules placed so far are put back as they were.
    Returns an :class:`Applied` listing every module changed."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"ampc.autoprecision.Plan.apply: model must be an nn.Module, "
                        f"got {type(model).__name__}")
    _refuse_compiled(plan, model)
    modules = dict(model.named_modules())
    missing = [u.module for u in plan if u.module not in modules]
    if missing:
        raise ValueError(f"ampc.autoprecision.Plan.apply: the plan names {len(missing)} "
                         f"module(s) the model does not have: {', '.join(missing)}")
    for u in plan:
        _check_module(u, modules[u.module])
    before = {u.module: (type(m), {n for n, _ in m.named_buffers(recurse=False)})
              for u in plan for m in [modules[u.module]]}
    applied = Applied(plan, model)
    try:
        for u in plan:
            applied.place(u.module)
        if recomputed(plan):
            applied.recompute = ampc.memory.recompute(model, recomputed(plan))
        if sliced(plan):
            applied.sliced = ampc.memory.sliced_head(model, sliced(plan))
    except BaseException:
        applied.remove()
        for name, (cls, buffers) in before.items():    # fp8.convert's class and state
            m = modules[name]
            for n in {n for n, _ in m.named_buffers(recurse=False)} - buffers:
                delattr(m, n)
            m.__class__ = cls
        raise
    return applied


def recomputed(plan) -> list[str]:
    """The modules the plan recomputes in the backward (a byte budget's last resort)."""
    return list(plan.step.recompute)


def sliced(plan) -> list[str]:
    """The heads whose logits the plan defers to the loss (ampc.memory.sliced_head)."""
    return list(plan.step.sliced_head)


def step_contexts(plan) -> list:
    """The contexts a step runs in, as (what, dtype) pairs in the order they are entered:
    ("autocast", dtype) for ampc.autocast, ("scope", torch.float32) for the policy scope
    that keeps the ops outside the units in fp32, ("fp8", None) for the FP8 region of the
    plan's fp8 modules."""
    if plan.dtype != "fp32":
        out = [("autocast", _candidates.get(plan.dtype).dtype)]
        if plan.rest == "fp32":     # the modules' own scopes set their precision inside
            out.append(("scope", torch.float32))
    elif plan.step.state != "fp32":
        # every module computes in fp32 though the state keeps the weights in bf16: without
        # a region they would run in bf16 (the weights' dtype), not what was measured, and
        # slow where bf16 matmuls are (a CPU without AVX-512 BF16)
        out = [("autocast", torch.bfloat16), ("scope", torch.float32)]
    else:
        out = []
    if plan._uses_any(_candidates.fp8_linear):
        out.append(("fp8", None))
    return out


def autocast(plan) -> contextlib.ExitStack:
    """The region to train in (:func:`step_contexts`), entered."""
    stack = contextlib.ExitStack()
    for what, dtype in step_contexts(plan):
        if what == "autocast":
            stack.enter_context(ampc.autocast(plan.device, dtype=dtype))
        elif what == "scope":
            stack.enter_context(ampc.policy.scope(dtype=dtype))
        else:
            stack.enter_context(ampc.fp8.autocast(
                recipe=_units.fp8_recipe(plan.data.get("fp8_recipe")), modules=()))
    return stack


def _region_python(plan) -> str:
    """:func:`step_contexts` as the ``with`` line's contexts."""
    said = []
    for what, dtype in step_contexts(plan):
        if what == "autocast":
            said.append(f'ampc.autocast("{plan.device}", dtype={_torch_dtype(dtype)})')
        elif what == "scope":
            said.append(f"ampc.policy.scope(dtype={_torch_dtype(dtype)})")
        else:
            said.append("ampc.fp8.autocast(recipe=ampc.fp8.DelayedScaling(), modules=())")
    return ", ".join(said)


def python(plan) -> str:
    """The plan as Python lines to paste after the model is built (``model``): the
    scopes :meth:`apply` would attach, the fp8 conversions, and the training step."""
    dev, region = plan.device, plan.dtype
    lines = [f"# ampc.autoprecision plan: {len(plan.units)} modules, region {region}",
             "import torch", "import ampc", ""]
    fp8 = []
    if recomputed(plan):
        lines.append(f"ampc.memory.recompute(model, {recomputed(plan)!r})")
    if sliced(plan):
        lines.append(f"ampc.memory.sliced_head(model, {sliced(plan)!r})")
    for u in plan:
        c = u.choice
        if _candidates.fp8_linear(c):
            fp8.append(u.module)
        if _candidates.saved(c):
            lines.append(f'ampc.memory.compress(model, "{u.module}", "{_candidates.saved(c)}")')
        if _by_region(plan, u.kind, c):
            continue
        ops = ""
        if u.kind == "norm" and not _candidates.full_precision(c):
            ops = (", ops={" + ", ".join(f'"{o}": "lower_precision_fp"'
                                         for o in _units.REDUCTION_OPS) + "}")
        out = _cast_outputs(plan, c)
        if out is not None:
            ops += f", cast_outputs={_torch_dtype(out)}"
        lines.append(f"ampc.policy.module_scope({expression(u.module)}, "
                     f"dtype={_torch_dtype(_candidates.get(c).dtype)}{ops})")
    if fp8:
        lines += ["", f"FP8_MODULES = {set(fp8)!r}", "",
                  "def fp8_filter(module, fqn):",
                  "    return fqn in FP8_MODULES", "",
                  "for fqn, module in model.named_modules():",
                  "    if fp8_filter(module, fqn):",
                  "        ampc.fp8.convert(module)"]
    step, loss = _loss_lines(plan, dev)
    ctx = _region_python(plan)
    if not ctx:
        lines += ["", f"# each step (every module computes in fp32: nothing to set): {step}"] + loss
        return "\n".join(lines + _micro_lines(plan))
    if region == "fp32" and plan.step.state != "fp32":
        lines += ["", f"# each step (every module computes in fp32 on the {plan.step.state} "
                  f"state's bf16 weights): with {ctx}: {step}"] + loss
    else:
        lines += ["", f"# each step: with {ctx}: {step}"] + loss
    if plan.needs_scaler():
        lines.append(f'# fp16 choices need loss scaling: scaler = ampc.GradScaler("{dev}")')
    return "\n".join(lines + _micro_lines(plan))


def _micro_lines(plan):
    """The lines that say how a step runs a batch the plan splits into micro-batches."""
    k = plan.step.micro_batches
    if k == 1:
        return []
    return [f"# the batch in {k} micro-batches, their gradients summed: opt.zero_grad(); "
            "plan.backward(model, opt, (x, y), loss_fn); opt.step()",
            f"# (by hand: ampc.memory.micro_batches((x, y), {k}) gives each piece and its share "
            "of the loss; the pieces but the last inside opt.accumulating())"]


def _loss_lines(plan, dev):
    """The step's model line and the lines computing the loss at its precision."""
    if plan._loss is None:
        return "loss = loss_fn(model(x), y)", []
    c = plan._loss.choice
    if c == "fp32":
        return "out = model(x)", ["# then, outside it: loss = loss_fn(out.float(), y)"]
    dt = _torch_dtype(_candidates.get(c).dtype)
    ops = "{" + ", ".join(f'"{o}": "lower_precision_fp"' for o in _loss.LOSS_OPS) + "}"
    return "out = model(x)", [
        f"# then the loss in {c}: with ampc.autocast(\"{dev}\", dtype={dt}), "
        f"ampc.policy.scope(dtype={dt}, ops=LOSS_OPS): "
        f"loss = loss_fn(out.to({dt}), y).float()",
        f"LOSS_OPS = {ops}"]


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
    if not (_candidates.get(u.choice).fits(m) or _is_fp8(m)):
        raise ValueError(f"ampc.autoprecision.Plan.apply: module {u.module} cannot "
                         "run in fp8 (an nn.Linear with in and out features multiple "
                         "of 16)")


def _by_region(plan, kind, choice):
    """Whether a unit of ``kind`` at ``choice`` needs no scope of its own: a GEMM at the
    dtype the region gives the ops outside the units (a scope's hooks cost time on every
    call), or any module of an all-fp32 plan (no autocast region); norms in 16 bits always
    get theirs (their reduction)."""
    return (kind != "norm" and choice == plan.rest
             and not _candidates.fp8_linear(choice)) or plan.dtype == "fp32"


def _cast_outputs(plan, choice):
    """float32 for a unit whose 16-bit dtype is not the one the region gives the ops around
    it (fp16 in a bf16 region), else None: torch's autocast refuses such a tensor in its
    promote ops (a cache's ``cat``), and float32 holds the unit's result without rounding."""
    mine, rest = _candidates.get(choice).dtype, _candidates.get(plan.rest).dtype
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
    scopes off again, and makes the modules that kept their saved tensors in 8 bits save
    them as they are (fp8 modules stay ampc.fp8.Linear, run outside FP8)."""

    def __init__(self, plan, model: torch.nn.Module) -> None:      # plan: a _plan.Plan
        self.plan, self.model = plan, model
        self.modules = dict(model.named_modules())
        self.handles = {}
        self.recompute = None    # the ampc.memory.recompute handle of the plan's blocks
        self.sliced = None       # the ampc.memory.sliced_head handle of the plan's head
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
        if _candidates.fp8_linear(choice) and name in self.modules:   # fp8.convert would skip a Conv1D silently
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
        if _candidates.fp8_linear(choice):
            ampc.fp8.convert(m)
        elif fp8_now:
            handles.append(_Fp8Off(m))
        if _candidates.saved(choice):
            handles.append(ampc.memory.compress(self.model, m, _candidates.saved(choice)))
        self.handles[name] = handles
        self._changes.pop(name, None)
        self._changes[name] = (name, type(m).__name__, choice)
        self._by_region.pop(name, None)
        if by_region:
            self._by_region[name] = None

    def remove(self) -> None:
        if self.sliced is not None:          # the last applied, the first taken off
            self.sliced.remove()
            self.sliced = None
        for hs in self.handles.values():
            for h in hs:
                h.remove()
        self.handles = {}
        if self.recompute is not None:
            self.recompute.remove()
            self.recompute = None

    def __str__(self) -> str:
        return "\n".join([f"ampc.autoprecision: {len(self._changes)} modules set"]
                         + [f"  {n} ({t}): {c}" + (" (by the autocast region)"
                                                    if n in self._by_region else "")
                            for n, t, c in self._changes.values()])

    def monitor(self, loss_fn: Callable | None = None, **kwargs: Any) -> Monitor:
        """A :class:`Monitor` re-checking these modules during training."""
        return Monitor(self, loss_fn, **kwargs)
