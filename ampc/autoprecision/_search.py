"""search(): the entry. Its arguments checked, the units found and the candidates each tries
(less those the matmul probe rules out here: _probe.py), every unit measured at each
(_measure.py), the solver's first plan (_solve.py), the whole plan checked against fp32 and
backed off (_whole.py), then the step's peak fitted to a byte budget (_peak.py, measured by
_step_peak.py) or, without one, lowered in the time the memory objective allows (_no_budget.py)."""
from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from . import (_candidates, _examples, _loss, _measure, _no_budget, _objectives, _peak,
               _step_peak, _units)
from ._apply import param_shapes
from ._plan import Plan, VERSION
from ._probe import SLOW, probe
from ._solve import CEILING, ERRORS, Budget
from ._whole import check_whole, solve_with_loss
from .._numerics import failures
from .._numerics.model import default_loss, to_device

FN = "ampc.autoprecision.search"
CEILING_SLACK = 1.5   # under a ceiling, a unit's candidate this far past it is not measured on


def _check_args(model, batches, candidates, budget, objective):
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"ampc.autoprecision.search: model must be an nn.Module, "
                        f"got {type(model).__name__}")
    for name, p in model.named_parameters():
        if p.is_floating_point() and p.dtype != torch.float32:
            raise ValueError(f"ampc.autoprecision.search: parameter {name} is {p.dtype}; "
                             "search takes an fp32 model")
    if isinstance(batches, tuple) and len(batches) == 2 and isinstance(batches[0], torch.Tensor):
        raise TypeError("ampc.autoprecision.search: batches must be a list of (inputs, target) "
                        "pairs, got one pair (wrap it in a list)")
    batches = list(batches)
    if not batches or not all(isinstance(b, (tuple, list)) and len(b) == 2 for b in batches):
        raise ValueError("ampc.autoprecision.search: batches must be a non-empty list of "
                         "(inputs, target) pairs")
    if objective not in _objectives.REGISTRY:
        raise ValueError(f"ampc.autoprecision.search: objective must be one of "
                         f"{', '.join(_objectives.REGISTRY)}, got {objective!r}")
    candidates = tuple(_objectives.get(objective).candidates if candidates is None
                       else candidates)
    bad = [c for c in candidates if c not in _candidates.REGISTRY]
    if bad or not candidates:
        raise ValueError(f"ampc.autoprecision.search: candidates must be among "
                         f"{', '.join(_candidates.REGISTRY)}, got {candidates!r}")
    if budget is None:
        budget = Budget()
    elif isinstance(budget, dict):
        budget = Budget(**budget)
    elif not isinstance(budget, Budget):
        raise TypeError(f"ampc.autoprecision.search: budget must be an "
                        f"ampc.autoprecision.Budget or a dict, got {type(budget).__name__}")
    return batches, ("fp32",) + tuple(c for c in candidates if c != "fp32"), budget


@_step_peak.measuring
def search(model: torch.nn.Module, batches: Sequence[tuple], loss_fn: Callable | None = None, *,
           candidates: Iterable[str] | None = None,
           budget: Budget | dict | None = None, objective: str = "time",
           units: Iterable[type] | None = None, device: str | None = None,
           fp8_recipe: str = "delayed", sensitivity: bool = True, check: bool = True,
           max_backoffs: int = 12, repeats: int = 2, loss_unit: bool = True,
           warmup: int | str = "auto", max_slowdown: float | None = CEILING,
           peak_bytes: int | str | None = None, examples: int | str | None = "auto",
           optimizer: Callable = torch.optim.AdamW) -> Plan:
    """Chooses a precision for each module of ``model`` from measured error and measured
    cost, under an error budget, and checks the whole choice.

    Args:
        model (nn.Module): an fp32 model; it is not changed (the search works on copies).
        batches: a few ``(inputs, target)`` pairs (2 to 4 are enough): errors are averaged
            and times taken as the fastest over them.
        loss_fn: ``loss_fn(output, target)``; default: cross-entropy over the last dim.
        candidates: precisions to choose from: "fp32", "bf16", "fp16", "fp8", and
            "fp32+8b", "bf16+8b" (those precisions with the module's saved activations
            kept in 8 bits until the backward, ``ampc.memory.compress``); fp32 is always
            one. fp8 applies to nn.Linear layers with dims multiple of 16. Default: the
            first four for the time objective, all six for the memory objective.
        budget (Budget or dict): relative error a plan may add per step against fp32
            (see :class:`Budget`: loss, grad, wgrad).
        objective: "time" (forward + backward time measured on this device; candidates
            whose matmul is 4x slower than fp32 here are not even tried) or "memory"
            (bytes of the module's weights and activations: deterministic; 8 bits a
            saved activation for the "+8b" candidates; under its time ceiling the matmul
            and conv modules do not try a candidate whose matmul is 4x slower here).
        units: module types to decide, only those (default: Linear, convolutions,
            MultiheadAttention, norms, Softmax, and any module found to compute a GEMM or
            a norm, such as GPT-2's Conv1D or Llama's RMSNorm).
        device: "cpu" or "cuda"; default: the model's.
        fp8_recipe: "delayed" (DelayedScaling) or "current" (Float8CurrentScaling).
        sensitivity (bool): False treats every candidate as exact (a control: what a
            plan chosen on cost alone looks like).
        repeats (int): timed runs per unit, candidate and batch (the fastest is kept).
        loss_unit (bool): measure the loss (with the log-softmax inside it) as a unit of
            its own, "(loss)" in the plan, at fp32, bf16 or fp16 (not fp8); use the
            result through ``plan.loss(loss_fn)``. False leaves the loss out of the plan
            (it runs as ``loss_fn`` does). A model that returns its own loss (given labels)
            computes it inside, under the modules' choices: no loss unit then.
        warmup: "auto" (default): where some module's output, or the gradient at it, is
            all zero or not finite on every batch (a zero-initialised head zeroes every
            gradient below it, and every error would read 0), measure a copy of the model
            after a few fp32 AdamW steps; a number: that many steps first (0: none). A
            module that still shows nothing is kept fp32, "not measured". The notes say which.
        max_slowdown: the memory objective's ceiling: no candidate more than this many
            times slower than its module's fastest within the budget, and no whole step more
            than this many times fp32's (default 1.25); None lifts it. Not used with
            ``peak_bytes``.
        peak_bytes: a byte budget for a training step's peak (live tensors, as
            ``ampc.memory.report`` measures it, with ``optimizer``): an int, or a string such
            as "6GiB" or "500MB"; with the memory or the time objective. The fastest plan
            within the error budget is measured; then the whole-step moves that cost little
            time are taken while the step is over, each where it lowers the peak by 1% or
            more (each gradient freed in the backward, the lean state, the head's logits
            sliced: ``plan.step``), and its modules lowered (to fewer bytes, the most bytes
            for the least time first, or blocks recomputed) and measured again until the step
            fits (at most 8 rounds); with the budget met, each costly move the step fits
            without is undone. ``plan.peak`` has the
            figures, by kind; the notes say whether the budget was met (and a warning when it
            was not: the error budget wins). ``plan.prepare(model, ampc.optim.AdamW, lr=...)``
            makes the model and optimizer so. Without it, the memory objective takes the
            whole-step moves that lower the step's peak, recomputes blocks in the time its
            ceiling leaves, and measures the step.
        examples: how many leading examples of each batch the modules and the whole plan
            are measured on: "auto" (default), a quarter of them (at least 4) where an fp32
            step of a whole batch would take over a second, and only where time decides
            something (not the memory objective with ``max_slowdown=None`` and no
            ``peak_bytes``, which gives the same plan every time); a number, that many; None,
            whole batches. A slice is taken only where every tensor of the batches shares
            its leading size and no module reads sequence-first (``batch_first=False``);
            activation bytes are scaled to the whole batch, errors and times are the
            slice's, and the notes say so. ``peak_bytes`` is measured on whole batches.
        optimizer: what the step whose peak is measured trains with: a callable that takes
            the parameters and returns an optimizer (default torch.optim.AdamW). The lean
            state and freed gradients are ampc's: they are tried where it makes Adam or
            AdamW, with its hyperparameters.
        check (bool): measure the whole plan against fp32 and back off the worst
            contributor until it fits the budget: one module per round for 4 rounds, then
            2, 4, ... per round, at most ``max_backoffs`` rounds (12: up to 60 modules),
            after which every module is kept in fp32.

    Under torch.distributed every rank measures and rank 0's plan is broadcast, so that
    all ranks apply the same plan. Returns a :class:`Plan`.

    The phases: the units and their candidates (:func:`_units_and_options`), per-unit
    measurement (``_measure.measure``), the solver (:func:`_first_plan`), and, with
    ``check``, the whole-model check and back-off (``_whole.check_whole``).
    """
    t_start = time.perf_counter()
    batches, candidates, budget = _check_args(model, batches, candidates, budget, objective)
    if fp8_recipe not in _units.FP8_RECIPES:
        raise ValueError(f"ampc.autoprecision.search: fp8_recipe must be 'delayed' or "
                         f"'current', got {fp8_recipe!r}")
    warmup, ceiling = _check_warmup(warmup), _check_ceiling(max_slowdown)
    examples = _examples.check(FN, examples)
    if examples == "auto" and not goal_times(objective, max_slowdown, peak_bytes):
        examples = None     # nothing timed decides: no timed step decides what is measured
    peak_bytes = _step_peak.check_args(peak_bytes, optimizer, objective)
    goal = _objectives.get(objective)
    if not goal.has_ceiling or peak_bytes is not None:
        ceiling = None               # the fastest plan is taken (then lowered to the budget)
    # a candidate this slow is not measured further: under the ceiling, past it with room
    # for noise (fp32 always fits the budget, so a candidate over ceiling x fp32's time is
    # ruled out whatever the others measure)
    # (with a byte budget the first plan is the fastest, as the time objective's: the same)
    slow = SLOW if goal.by_speed or peak_bytes is not None else ceiling and CEILING_SLACK * ceiling
    loss_fn = loss_fn or default_loss
    params = list(model.parameters())
    device = device or (params[0].device.type if params else "cpu")
    batches = [tuple(to_device(b, device)) for b in batches]
    model, compiled = _plain(model)
    loss_name = _loss.loss_name(loss_fn)
    loss_fn = failures.checked_loss(FN, loss_fn)
    found, options, notes = _units_and_options(model, units, candidates, objective, device,
                                               ceiling, budget=peak_bytes is not None)
    whole = batches             # what the peak is measured on
    batches, sliced, note = _examples.choose(model, batches, loss_fn, examples)
    notes += [note] if note else []
    scale_up = sliced[1] / sliced[0] if sliced else 1.0     # whole batches over the slice
    # bad batches or loss_fn are said here; the same fp32 pass finds the units that cannot
    # show an error (zero gradients), for the warm-up
    look = (lambda work, batch: _measure.silent_in(work, batch, loss_fn, found)) \
        if warmup == "auto" else None
    per_batch = failures.first_run(FN, model, batches, loss_fn, step=look)
    notes += compiled
    model, found, note = _measure.warm_if_silent(
        model, batches, loss_fn, found, warmup,
        quiet=_measure.silent_on_all(per_batch) if look else None)
    notes += [note] if note else []
    tally = _loss.Tally(loss_fn, candidates, device, repeats, scale_up) if loss_unit else None
    with torch.random.fork_rng(devices=[]):
        measured, loss_scale = _measure.measure(model, batches, loss_fn, found, options, device,
                                                _units.fp8_recipe(fp8_recipe), repeats,
                                                slow=slow, loss=tally, per_batch=scale_up)
    note = _measure.not_measured_note(measured)
    notes += [note] if note else []
    if not sensitivity:
        _blind(measured)
    # with a byte budget: the fastest plan, then lowered until its step fits
    asked = Asked(objective, tuple(candidates), budget, fp8_recipe, device, ceiling, loss_name)
    plan, rejected = _first_plan(found, measured, asked, loss_scale, notes,
                                 solve_as="time" if peak_bytes is not None else None)
    if peak_bytes is not None:
        _peak.fit(plan, model, whole, loss_fn, measured, rejected, budget, peak_bytes,
                  optimizer)
        fitted = plan.decisions
    report = None
    if check:
        # under a byte budget the whole step's forms are raced with their peaks measured
        peak_of = None if peak_bytes is None else (
            lambda over=None: _step_peak.step_peak(model, plan, whole[0], loss_fn, optimizer,
                                                   over))
        report = check_whole(model, batches, loss_fn, plan, measured, budget, objective, device,
                             max_backoffs, peak_of=peak_of,
                             can_free=lambda: _step_peak.can_free(optimizer, plan) is None)
    if peak_bytes is not None:
        _peak.settle(plan, model, whole, loss_fn, optimizer, fitted, report)
    elif not goal.by_speed:
        _no_budget.whole_step(plan, model, whole, loss_fn, optimizer, measured, budget,
                              _no_budget.room(plan, ceiling))
    plan.data["predicted"] = {
        "fp32_ms": sum(u.options["fp32"]["ms"] or 0.0 for u in plan.every_unit),
        "plan_ms": sum(u.figures()["ms"] or 0.0 for u in plan.every_unit)}
    plan.data["examples"] = list(sliced) if sliced else None
    plan.data["search_s"] = time.perf_counter() - t_start
    return _broadcast(plan)


def goal_times(objective, max_slowdown, peak_bytes):
    """Whether measured time decides anything in a search so set (not: the memory objective
    without a ceiling or a byte budget, whose plan is the same every time)."""
    return (_objectives.get(objective).by_speed or peak_bytes is not None
            or (_objectives.get(objective).has_ceiling and max_slowdown is not None))


def _plain(model):
    """(the model to search, notes): a model with torch.compile'd parts is searched on a
    copy through the modules they compile, and the plan names those; a plan cannot be
    applied inside a compiled module (see Plan.apply)."""
    parts = failures.compiled_parts(model)
    if not parts:
        return model, []
    hints = "; ".join(failures.unwrap_hint(p) for p in parts)
    return failures.uncompiled(model), [
        f"{', '.join(p or '(the model)' for p in parts)} compiled with torch.compile: measured "
        f"through the module(s) compiled, and the plan names their modules; apply it to the "
        f"model uncompiled ({hints})"]


def _units_and_options(model, types, candidates, objective, device, ceiling, budget=False):
    """The units of ``model``, each one's candidates (less those too slow here), and the
    notes saying which were not tried. The time objective tries no candidate whose matmul
    runs SLOW times fp32's here; under the memory objective's ceiling (a unit's candidate
    that much slower is ruled out anyway) the matmul and conv units do not try it, the rest
    are measured (a norm's time is mostly not a matmul's). Under a byte ``budget`` the same:
    the first plan is the fastest, and a matmul that slow saves its bytes at a higher price
    than the 8-bit codes or a recomputed block (measuring it on such a CPU took most of a
    search)."""
    found = _units.find_units(model, tuple(types) if types else None)
    if not found:
        raise ValueError("ampc.autoprecision.search: the model has no module of the types "
                         "it decides (Linear, convolutions, attention, norms, softmax); "
                         "name yours with units=")
    everywhere = _objectives.get(objective).by_speed
    skipped = probe(candidates, device) if everywhere or ceiling is not None or budget else {}
    where = "" if everywhere else " on the matmul and conv modules"
    notes = [f"{c} not tried{where}: {why}" for c, why in skipped.items()]

    def tried(m):
        off = skipped if everywhere or _units.kind(m) == "gemm" else {}
        return _units.candidates_for(m, [c for c in candidates if c not in off])
    return found, {n: tried(m) for n, m in found.items()}, notes


def _blind(measured):
    """Every candidate counted exact (the sensitivity=False control)."""
    for opts in measured.values():
        for r in opts.values():
            for k in ERRORS + ("out_err",):
                r[k] = 0.0 if r.get(k) is not None else None


def _check_warmup(warmup):
    if warmup != "auto" and not (isinstance(warmup, int) and not isinstance(warmup, bool)
                                 and warmup >= 0):
        raise ValueError(f"ampc.autoprecision.search: warmup must be 'auto' or a number of "
                         f"steps (0 or more), got {warmup!r}")
    return warmup


def _check_ceiling(max_slowdown):
    if max_slowdown is not None and not (
            isinstance(max_slowdown, (int, float)) and not isinstance(max_slowdown, bool)
            and 1 <= max_slowdown < math.inf):
        raise ValueError(f"ampc.autoprecision.search: max_slowdown must be None or a number "
                         f"of at least 1, got {max_slowdown!r}")
    return max_slowdown


@dataclass(frozen=True)
class Asked:
    """What the search was asked for, as the plan records it."""
    objective: str
    candidates: tuple[str, ...]
    budget: Budget
    fp8_recipe: str
    device: str
    ceiling: float | None
    loss_name: str


def _first_plan(found, measured, asked, loss_scale, notes, solve_as=None):
    """(the solver's plan, unit by unit (the loss one of them, where measured), before any
    whole-model check; {unit: {candidate: why not}}). ``solve_as``: the objective the
    solver ranks by, when not the plan's own."""
    a = asked
    choice, rejected = solve_with_loss(measured, a.budget, solve_as or a.objective, a.ceiling)
    units = [{"module": n, "type": type(m).__name__, "kind": _units.kind(m), "choice": choice[n],
              "shapes": param_shapes(m),
              "options": measured[n], "rejected": rejected[n]} for n, m in found.items()]
    loss = None
    if _loss.NAME in measured:
        loss = {"module": _loss.NAME, "type": a.loss_name, "kind": _loss.KIND,
                "choice": choice[_loss.NAME], "options": measured[_loss.NAME],
                "rejected": rejected[_loss.NAME]}
    return Plan({"version": VERSION, "device": a.device, "where": _where(a.device),
                 "objective": a.objective, "budget": a.budget.as_dict(),
                 "candidates": list(a.candidates), "fp8_recipe": a.fp8_recipe,
                 "loss_scale": loss_scale, "ceiling": a.ceiling,
                 "notes": notes,
                 "backoffs": [], "units": units, "loss": loss}), rejected


def _where(device):
    if device == "cuda":
        return torch.cuda.get_device_name()
    return f"torch CPU capability {torch.backends.cpu.get_cpu_capability()}"


def _broadcast(plan):
    """Rank 0's plan on every rank (when torch.distributed is initialized)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return plan
    box = [plan.to_json() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return Plan.from_json(box[0])
