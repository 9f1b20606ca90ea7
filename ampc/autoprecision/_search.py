"""search(): measure, solve, check the whole plan, back off until it holds."""
from __future__ import annotations

import contextlib
import copy
import math
import time
from collections.abc import Callable, Iterable, Sequence

import torch
import torch.distributed as dist

import ampc      # its fp8 attribute loads ampc.fp8 (and torch._dynamo) on first use only
from . import _candidates, _examples, _loss, _measure, _objectives, _peak, _units
from ._apply import param_shapes
from ._plan import Plan, VERSION
from ._solve import (CEILING, ERRORS, MARGIN, Budget, Over, clearly_faster, order, raise_one,
                     solve)
from ._units import Reason
from .._numerics import failures
from .._numerics.errors import rel_error
from .._numerics.model import call_model, default_loss, to_device
from .._numerics.noise import spread

RACE_ROUNDS = 3      # turns each entrant takes in race()
FN = "ampc.autoprecision.search"

SLOW = 4.0       # a candidate whose matmul is this many times slower than fp32 is not tried
CEILING_SLACK = 1.5   # under a ceiling, a unit's candidate this far past it is not measured on


def _matmul_ms(choice, device, n=512, reps=20, seconds=0.2):
    """Milliseconds of an (n x n) @ (n x n) at ``choice`` (fp8: an ampc.fp8.Linear) and in
    fp32: the fastest of up to ``reps`` calls each within about ``seconds``."""
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    x = torch.randn(n, n, device=device)
    lin = torch.nn.Linear(n, n, bias=False).to(device)
    if _candidates.fp8_linear(choice):
        ampc.fp8.convert(lin)
    base = torch.nn.Linear(n, n, bias=False).to(device)
    best = {choice: math.inf, "fp32": math.inf}
    # interleaved with fp32's: a busy machine slows both alike
    with torch.no_grad():
        for mod, c in ((lin, choice), (base, "fp32")):
            with _measure.at(mod, c, device, ampc.fp8.DelayedScaling()):
                mod(x)
        start = time.perf_counter()
        for _ in range(reps):
            for mod, c in ((lin, choice), (base, "fp32")):
                with _measure.at(mod, c, device, ampc.fp8.DelayedScaling()):
                    sync()
                    t0 = time.perf_counter()
                    mod(x)
                    sync()
                    best[c] = min(best[c], time.perf_counter() - t0)
            if time.perf_counter() - start > seconds:
                break
    return best[choice] * 1e3, best["fp32"] * 1e3


def probe(candidates, device):
    """{candidate: why it is not tried} for candidates whose matmul runs SLOW times slower
    than fp32's here (fp16 on most CPUs, bf16 without AVX-512 BF16 or AMX, fp8's exact
    CPU reference path), or that do not run at all."""
    out = {}
    for c in candidates:
        if c == "fp32":
            continue
        try:
            ms, base = _matmul_ms(c, device)
        except RuntimeError as e:
            out[c] = f"does not run here ({str(e).splitlines()[0][:80]})"
            continue
        if ms > SLOW * base:
            out[c] = (f"its 512x512 matmul takes {ms / base:.0f}x fp32's time on this "
                      f"{'GPU' if device == 'cuda' else 'CPU'} ({ms:.2f} vs {base:.2f} ms)")
    return out


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


def whole_step(model, batch, loss_fn, region, device):
    """(loss, {param name: grad}, seconds) of one forward and backward."""
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    inputs, target = batch
    for p in model.parameters():
        p.grad = None
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        sync()
        t0 = time.perf_counter()
        with region():
            out = call_model(model, inputs)
        loss = loss_fn(out, target)
        loss.backward()
        sync()
        seconds = time.perf_counter() - t0
    grads = {n: p.grad.detach().float().clone() for n, p in model.named_parameters()
             if p.grad is not None}
    return loss.detach().float().item(), grads, seconds


class WorkingCopy:
    """The one copy of the model every whole-plan check of a search runs on. Each check
    takes the previous plan's scopes off, starts every FP8 module's scaling state afresh
    (as a fresh copy would have it; a module no longer fp8 runs outside FP8) and applies
    the plan. A check runs no optimizer step, so the weights stay the model's."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = copy.deepcopy(model)
        self.applied = None

    def under(self, plan: Plan) -> torch.nn.Module:
        if self.applied is not None:
            self.applied.remove()
            for m in self.model.modules():
                if isinstance(m, ampc.fp8.Linear):
                    h = m.fp8_fwd_amax_history
                    ampc.fp8.scaling.init_state(m, h.shape[0], h.device)
        self.applied = plan.apply(self.model)
        return self.model


def check_plan(work, batches, loss_fn, plan, ref, device):
    """:func:`measure_plan`; a plan whose step raises is a failed check, not a crash: its
    errors infinite, ``failed`` saying what was raised (and what to do, where ampc can
    tell), ``involved`` the units below fp32 where it was raised (all of them when no
    module's forward was running: a backward), which the back-off raises one step."""
    try:
        return measure_plan(work, batches, loss_fn, plan, ref, device)
    except Exception as e:      # noqa: BLE001 (any failure of the plan's step backs off)
        low = [u.module for u in plan.every_unit if u.choice != "fp32"]
        where = failures.failing_module(e, work.model)
        mine = [n for n in low if where is not None and n != _loss.NAME
                and (where == "" or n == where or n.startswith(where + ".")
                     or where.startswith(n + "."))]
        what = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
        hint = failures.explain(FN, e, work.model, batches[0][0], device)
        return {"loss_err": math.inf, "grad_err": math.inf, "wgrad_err": math.inf,
                "wgrad_worst": None, "unit_wgrad": {}, "grad_noise": None,
                "plan_ms": math.inf, "failed": what + (f" ({hint})" if hint else "")
                + (f" in {where or 'the model'}" if where is not None else ""),
                "involved": mine or low}


def measure_plan(work, batches, loss_fn, plan, ref, device):
    """The whole plan on ``work`` (a :class:`WorkingCopy`) against fp32 over the batches:
    loss error, error of all weight gradients together, the worst unit's weight-gradient
    error, fp32's batch-to-batch spread of the weight gradients, and step times."""
    m = work.under(plan)
    scale = plan.data.get("loss_scale", 1.0) if plan.needs_scaler() else 1.0
    if plan.loss_unit is not None and _candidates.loss_scaled(plan.loss_unit.choice):
        # an fp16 loss's own gradient is the scale: a run backs off to what it measured at
        scale = min(scale, plan.loss_unit.options["fp16"].get("loss_scale") or scale)
    plan_loss = plan.loss(loss_fn)

    def scaled_loss(out, target):
        return plan_loss(out, target) * scale
    loss_errs, grad_errs, times = [], [], []
    unit_errs = {}
    owners = {}
    for name, mod in m.named_modules():
        if name in plan:
            for pn, _ in mod.named_parameters():
                owners[f"{name}.{pn}"] = name
    whole_step(m, batches[0], scaled_loss, plan.autocast, device)   # warm-up
    for k, batch in enumerate(batches):
        ref_loss, ref_grads, _ = ref[k]
        loss, grads, t = whole_step(m, batch, scaled_loss, plan.autocast, device)
        loss /= scale
        grads = {n: g / scale for n, g in grads.items()}
        times.append(t)
        loss_errs.append(abs(loss - ref_loss) / max(abs(ref_loss), 1e-12)
                         if math.isfinite(loss) else math.inf)
        grad_errs.append(rel_error([grads.get(n) for n in ref_grads], list(ref_grads.values()))
                         or 0.0)
        per = {}
        for n, g in ref_grads.items():
            if n in owners:
                per.setdefault(owners[n], ([], []))
                per[owners[n]][0].append(grads.get(n))
                per[owners[n]][1].append(g)
        for u, (a, b) in per.items():
            unit_errs.setdefault(u, []).append(rel_error(a, b) or 0.0)
    worst, worst_err = None, 0.0
    for u, errs in unit_errs.items():
        e = sum(errs) / len(errs)
        if e > worst_err or not math.isfinite(e):
            worst, worst_err = u, e
    return {"loss_err": sum(loss_errs) / len(loss_errs),
            "grad_err": sum(grad_errs) / len(grad_errs),
            "wgrad_err": worst_err, "wgrad_worst": worst,
            "unit_wgrad": {u: sum(e) / len(e) for u, e in unit_errs.items()},
            # fp32's own batch-to-batch spread of all weight gradients: grad_err's yardstick
            "grad_noise": spread([list(g.values()) for _, g, _ in ref]),
            "plan_ms": 1e3 * min(times)}


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
            within the error budget is measured; then the whole-step moves that cost about no
            time are taken while the step is over (each gradient freed in the backward, the
            lean state, the head's logits sliced: ``plan.step``), and its modules lowered (to
            fewer bytes, the most bytes for the least time first, or blocks recomputed) and
            measured again until the step fits (at most 8 rounds). ``plan.peak`` has the
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
    ``check``, the whole-model check and back-off (:func:`_check_whole`).
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
    peak_bytes = _peak.check_args(peak_bytes, optimizer, objective)
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
    plan, rejected = _first_plan(found, measured, budget, objective, candidates, fp8_recipe,
                                 loss_scale, device, notes, loss_name, ceiling,
                                 solve_as="time" if peak_bytes is not None else None)
    if peak_bytes is not None:
        _peak.fit(plan, model, whole, loss_fn, measured, rejected, budget, peak_bytes,
                  optimizer)
        fitted = plan.decisions
    if check:
        _check_whole(model, batches, loss_fn, plan, measured, budget, objective, device,
                     max_backoffs)
    if peak_bytes is not None:
        _peak.settle(plan, model, whole, loss_fn, optimizer, fitted)
    elif not goal.by_speed:
        _peak.whole_step(plan, model, whole, loss_fn, optimizer, measured, budget,
                         _peak.room(plan, ceiling))
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


def solve_with_loss(measured, budget, objective, ceiling=None):
    """``solve``, then the loss back at fp32 where lowering it buys too little
    (``_loss.keep_fp32``): the reason goes to its rejected candidates."""
    choice, rejected = solve(measured, budget, objective, ceiling)
    why = _loss.keep_fp32(measured, choice, objective)
    if why is not None:
        rejected[_loss.NAME][choice[_loss.NAME]] = why
        choice[_loss.NAME] = "fp32"
    return choice, rejected


def _first_plan(found, measured, budget, objective, candidates, fp8_recipe, loss_scale, device,
                notes, loss_name, ceiling=None, solve_as=None):
    """(the solver's plan, unit by unit (the loss one of them, where measured), before any
    whole-model check; {unit: {candidate: why not}}). ``solve_as``: the objective the
    solver ranks by, when not the plan's own."""
    choice, rejected = solve_with_loss(measured, budget, solve_as or objective, ceiling)
    units = [{"module": n, "type": type(m).__name__, "kind": _units.kind(m), "choice": choice[n],
              "shapes": param_shapes(m),
              "options": measured[n], "rejected": rejected[n]} for n, m in found.items()]
    loss = None
    if _loss.NAME in measured:
        loss = {"module": _loss.NAME, "type": loss_name, "kind": _loss.KIND,
                "choice": choice[_loss.NAME], "options": measured[_loss.NAME],
                "rejected": rejected[_loss.NAME]}
    return Plan({"version": VERSION, "device": device, "where": _where(device),
                 "objective": objective, "budget": budget.as_dict(), "candidates": list(candidates),
                 "fp8_recipe": fp8_recipe, "loss_scale": loss_scale, "ceiling": ceiling,
                 "notes": notes,
                 "backoffs": [], "units": units, "loss": loss}), rejected


def _fp32_reference(model, batches, loss_fn, device):
    """(fp32 model, [(loss, grads, seconds)] of fp32 per batch); the time, which every
    whole-model choice is held against, the faster of two runs."""
    ref_model = copy.deepcopy(model)
    whole_step(ref_model, batches[0], loss_fn, _null, device)            # warm-up
    ref = [whole_step(ref_model, b, loss_fn, _null, device) for b in batches]
    return ref_model, [(loss, g, min(t, whole_step(ref_model, b, loss_fn, _null, device)[2]))
                       for (loss, g, t), b in zip(ref, batches)]


def race(entrants, batches, device, rounds=RACE_ROUNDS):
    """{name: ms}: each entrant's step timed turn about, ``rounds`` turns each over the
    batches, the fastest it ran. ``entrants`` maps a name to a ``setup()`` giving (model,
    region, loss_fn), called before each of its turns. Timed apart, a load that came
    between two timings made the later one look slower (and a whole plan flip to fp32);
    turn about, every entrant sees the same machine."""
    best = dict.fromkeys(entrants, math.inf)
    for _ in range(rounds):
        for name, setup in entrants.items():
            model, region, fn = setup()
            for b in batches:
                best[name] = min(best[name], whole_step(model, b, fn, region, device)[2])
    return {name: 1e3 * t for name, t in best.items()}


def fp32_entrant(ref_model, loss_fn):
    """A :func:`race` entrant: fp32's step on the reference model."""
    return lambda: (ref_model, _null, loss_fn)


def plan_entrant(work, plan, loss_fn, change=None):
    """A :func:`race` entrant: the plan's step on the working copy, after ``change(plan)``
    (which puts the plan in the form this entrant times)."""
    def setup():
        if change is not None:
            change(plan)
        return work.under(plan), plan.autocast, plan.loss(loss_fn)
    return setup


def _back_off(work, batches, loss_fn, plan, ref, device, result, measured, budget, objective,
              max_backoffs):
    """Raises the worst contributors until the whole plan fits the budget: one module per
    round for 4 rounds, then 2, 4, ... Returns the last check's result."""
    for k in range(max_backoffs):
        over = _over(result, budget)
        if over is None:
            break
        if over.key == "failed":
            _raise_failed(plan, result)
            result = check_plan(work, batches, loss_fn, plan, ref, device)
            continue
        for _ in range(2 ** (k // 4)):
            name = _worst(plan, result, over)
            if name is None:
                break
            u = plan.unit(name)
            usable = [c for c in order(measured[name], objective) if c not in u.rejected]
            new = raise_one(plan.decisions, measured, usable, name)
            plan.data["backoffs"].append({"module": name, "from": u.choice, "to": new,
                                          "why": str(over)})
            plan.set_choice(name, new, Reason.BACKED_OFF)
        result = check_plan(work, batches, loss_fn, plan, ref, device)
    return result


def _raise_failed(plan, result):
    """Raises each unit involved in a failed check one step (RAISE_TO), and says so."""
    names = [n for n in result["involved"] if plan.unit(n).choice != "fp32"]
    for name in names:
        u = plan.unit(name)
        new = _candidates.get(u.choice).raise_to
        plan.data["backoffs"].append({"module": name, "from": u.choice, "to": new,
                                      "why": "the whole plan raised an error"})
        plan.set_choice(name, new, Reason.BACKED_OFF)
    plan.data["notes"].append(f"the whole plan raised {result['failed']}: {len(names)} "
                              "module(s) raised one step and the plan checked again")


def _check_whole(model, batches, loss_fn, plan, measured, budget, objective, device, max_backoffs):
    """The whole plan measured against fp32, backed off until it fits (else all fp32), and
    for the time objective its fastest form; the figures go to ``plan.data["measured"]``."""
    notes = plan.data["notes"]
    ref_model, ref = _fp32_reference(model, batches, loss_fn, device)
    ceiling = plan.data.get("ceiling")
    goal = _objectives.get(objective)
    if not goal.by_speed and ceiling is None:
        ref_model = None        # only the time objective and the ceiling race fp32
    fp32_ms = 1e3 * min(r[2] for r in ref)
    work = WorkingCopy(model)
    result = check_plan(work, batches, loss_fn, plan, ref, device)
    if goal.by_speed:
        result = _whole_low(work, batches, loss_fn, plan, ref, device, result, measured,
                            budget, notes)
    result = _back_off(work, batches, loss_fn, plan, ref, device, result, measured, budget,
                       objective, max_backoffs)
    if _over(result, budget):
        # fp32 throughout fits any budget: never hand back a plan known to be over it
        notes.append(f"the whole plan was still over the budget ({_over(result, budget)}) "
                     f"after {max_backoffs} rounds of back-off: every module kept in fp32")
        plan.set_choices(dict.fromkeys(plan.decisions, "fp32"), Reason.ALL_FP32)
        result = dict(result, loss_err=0.0, grad_err=0.0, wgrad_err=0.0, wgrad_worst=None,
                      plan_ms=fp32_ms)
    if goal.by_speed and plan.dtype != "fp32":
        result, fp32_ms = _fastest(work, batches, loss_fn, plan, ref, ref_model, device,
                                   result, budget, notes)
    if ceiling is not None and plan.dtype != "fp32" and result["plan_ms"] > ceiling * fp32_ms:
        result, fp32_ms = _under_ceiling(work, batches, loss_fn, plan, ref, ref_model, device,
                                         result, measured, ceiling, notes)
    note = _wgrad_note(result, plan, measured, budget)
    if note:
        notes.append(note)
    result.pop("unit_wgrad")
    result.pop("failed", None)
    result.pop("involved", None)
    result["fp32_ms"] = fp32_ms
    plan.data["measured"] = result


def _whole_low(work, batches, loss_fn, plan, ref, device, result, measured, budget, notes):
    """Small modules time slower in 16 bits one by one (each pays its casts) than they run
    in a model that stays in 16 bits between them. So the whole model is also measured
    with every module at its least precise candidate that fits the budget; that plan wins
    unless the modules' own choice measured clearly faster (by more than MARGIN), the two
    timed turn about (:func:`race`)."""
    low, _ = solve_with_loss(measured, budget, "memory")    # ranked by bytes: the least precise
    if low == plan.decisions or result.get("failed"):    # a failed plan is not raced
        return result
    mine = plan.decisions
    plan.set_choices(low, Reason.WHOLE_MODEL)
    other = check_plan(work, batches, loss_fn, plan, ref, device)
    if _over(other, budget) is not None:
        plan.set_choices(mine, Reason.SOLVED)
        return result
    ms = race({"mine": plan_entrant(work, plan, loss_fn,
                                    lambda p: p.set_choices(mine, Reason.SOLVED)),
               "low": plan_entrant(work, plan, loss_fn,
                                   lambda p: p.set_choices(low, Reason.WHOLE_MODEL))},
              batches, device)
    # the least precise plan needs the least memory: it wins unless the modules' own
    # choice measured clearly faster (by more than MARGIN)
    if not clearly_faster(ms["mine"], ms["low"]):
        plan.set_choices(low, Reason.WHOLE_MODEL)
        notes.append(f"the modules one by one chose {_count(mine)}; the whole model measured "
                     f"{ms['low']:.1f} ms per step with {_count(low)} against "
                     f"{ms['mine']:.1f} ms (timed turn about; no more than {MARGIN:.0%} "
                     f"slower, less memory): taken")
        return dict(other, plan_ms=ms["low"])
    plan.set_choices(mine, Reason.SOLVED)
    return dict(result, plan_ms=ms["mine"])


def _under_ceiling(work, batches, loss_fn, plan, ref, ref_model, device, result, measured,
                   ceiling, notes):
    """The memory objective's ceiling on the whole step: the plan measured more than
    ``ceiling`` times fp32's step (the units' casts, the ops outside them), so the two are
    timed turn about (:func:`race`); while the plan is still over, first the ops outside
    the units go to fp32, then the units that measured slower alone than in fp32, then
    every unit. Each change only raises precision: errors are measured again, and fall.
    Returns (result, fp32 ms)."""
    def ms_at(n, c):
        return measured[n][c]["ms"] or 0.0
    slower = {n: "fp32" for n, c in plan.decisions.items()
              if c != "fp32" and ms_at(n, c) > ms_at(n, "fp32")}
    changes = [(None, None)]
    if plan.rest != "fp32":
        changes.append(("the ops outside the modules to fp32",
                        lambda: plan.data.update(rest="fp32")))
    if slower:
        changes.append((f"{len(slower)} modules slower than fp32 alone to fp32",
                        lambda: plan.set_choices(slower, Reason.WHOLE_MODEL)))
    changes.append(("every module to fp32", lambda: plan.set_choices(
        dict.fromkeys(plan.decisions, "fp32"), Reason.ALL_FP32)))
    done, first = [], None
    for what, change in changes:
        if change is not None:
            change()
            done.append(what)
            result = check_plan(work, batches, loss_fn, plan, ref, device)
        ms = race({"fp32": fp32_entrant(ref_model, loss_fn),
                   "plan": plan_entrant(work, plan, loss_fn)}, batches, device)
        first = first or ms
        if ms["plan"] <= ceiling * ms["fp32"] or plan.dtype == "fp32":
            break
    if done:
        notes.append(f"the whole plan measured {first['plan']:.1f} ms per step against fp32's "
                     f"{first['fp32']:.1f} ms (timed turn about), over the {ceiling:g}x ceiling: "
                     + ", then ".join(done))
    return dict(result, plan_ms=ms["plan"]), ms["fp32"]


def _count(choices):
    counts = {}
    for c in choices.values():
        counts[c] = counts.get(c, 0) + 1
    return ", ".join(f"{n} {c}" for c, n in sorted(counts.items()))


def _fastest(work, batches, loss_fn, plan, ref, ref_model, device, result, budget, notes):
    """The time objective, for the whole model: the ops outside the units in fp32 only when
    that measured clearly faster (by more than MARGIN, within the budget) than at the region
    dtype; and fp32 throughout only when fp32 measured clearly faster than the plan. Each
    pair is timed turn about (:func:`race`). Returns (result, fp32 ms)."""
    plan.data["rest"] = "fp32"
    other = check_plan(work, batches, loss_fn, plan, ref, device)
    plan.data["rest"] = plan.dtype
    if _over(other, budget) is None:
        ms = race({"region": plan_entrant(work, plan, loss_fn,
                                          lambda p: p.data.update(rest=p.dtype)),
                   "fp32": plan_entrant(work, plan, loss_fn,
                                        lambda p: p.data.update(rest="fp32"))},
                  batches, device)
        if clearly_faster(ms["fp32"], ms["region"]):
            plan.data["rest"] = "fp32"
            result = other
        else:
            plan.data["rest"] = plan.dtype
    ms = race({"fp32": fp32_entrant(ref_model, loss_fn),
               "plan": plan_entrant(work, plan, loss_fn)}, batches, device)
    fp32_ms = ms["fp32"]
    result = dict(result, plan_ms=ms["plan"])
    if clearly_faster(fp32_ms, result["plan_ms"]):
        notes.append(f"the whole plan measured {result['plan_ms']:.1f} ms per step against "
                     f"{fp32_ms:.1f} ms for fp32: every module kept in fp32")
        plan.set_choices(dict.fromkeys(plan.decisions, "fp32"), Reason.ALL_FP32)
        result = dict(result, plan_ms=fp32_ms, loss_err=0.0, grad_err=0.0, wgrad_err=0.0,
                      wgrad_worst=None)
    return result, fp32_ms


def _null():
    return contextlib.nullcontext()


def _over(result, budget):
    """Which whole-plan error is over the budget (an :class:`Over`), or None: the loss error
    against the fixed loss budget, the error of all weight gradients together against the
    grad budget or ``noise_fraction`` of fp32's batch-to-batch spread of them. (One unit's
    weight-gradient error in the whole plan also carries every later unit's dgrad error:
    it is held to the budget by :func:`_wgrad_note`, and the units' own wgrad errors one
    by one, in the search.)"""
    if result.get("failed"):
        return Over("failed", math.inf, 0.0)
    if not (result["loss_err"] <= budget.loss):
        return Over("loss_err", result["loss_err"], budget.loss)
    limit = budget.limit("grad_err", result.get("grad_noise"))
    if not (result["grad_err"] <= limit):
        return Over("grad_err", result["grad_err"], limit)
    return None


def _wgrad_note(result, plan, measured, budget):
    """A note for each unit whose weight gradient, in the whole plan, is over its limit (the
    wgrad budget or ``noise_fraction`` of its own batch-to-batch spread), or None when none
    is. The whole-plan back-off holds loss and grad; this says plainly what it left."""
    if plan.dtype == "fp32":
        return None        # fp32 throughout: nothing is off (the figures are an earlier plan's)
    over = []
    for name, e in result.get("unit_wgrad", {}).items():
        noise = measured[name]["fp32"].get("wgrad_noise")
        limit = budget.limit("wgrad_err", noise)
        if not (e <= limit):
            over.append(f"{name} {e:.2g} > {limit:.2g}")
    if not over:
        return None
    return (f"in the whole plan {len(over)} module(s) have weight-gradient errors over their "
            f"limit (wgrad budget or {budget.noise_fraction:g} of fp32's batch-to-batch "
            f"spread): " + ", ".join(over[:5]) + (" ..." if len(over) > 5 else ""))


def _worst(plan, result, over):
    """The unit below fp32 that contributes most to what is over the budget."""
    low = [u for u in plan.every_unit if u.choice != "fp32"]
    if not low:
        return None
    key = "loss_err" if over.key == "loss_err" else "dgrad_err"

    def contribution(u):
        r = u.figures()
        return (r.get(key) or 0.0, r.get("wgrad_err") or 0.0)
    return max(low, key=contribution).module


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
