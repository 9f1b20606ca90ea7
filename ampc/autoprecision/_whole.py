"""search()'s last phase: the whole plan measured against fp32 on one working copy of the
model, backed off until it fits the error budget, and, where time decides, raced against
the forms it could take (the least precise plan, the ops outside the units in fp32, fp32
throughout) with every pair timed turn about (:func:`race`). Entry: :func:`check_whole`;
:class:`Check` holds what every measurement of one search shares."""
from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass
import math
import time

import torch

import ampc      # its fp8 attribute loads ampc.fp8 (and torch._dynamo) on first use only
from . import _candidates, _loss, _objectives
from ._step_peak import Floor, MiB
from ._plan import Plan
from ._solve import MARGIN, Budget, Over, clearly_faster, order, raise_one, solve
from ._units import Reason
from .._numerics import failures
from .._numerics.errors import rel_error
from .._numerics.model import call_model
from .._numerics.noise import spread

RACE_ROUNDS = 3      # turns each entrant takes in race()
FN = "ampc.autoprecision.search"


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


def null():
    """fp32's region: none."""
    return contextlib.nullcontext()


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


def fp32_reference(model, batches, loss_fn, device):
    """(fp32 model, [(loss, grads, seconds)] of fp32 per batch); the time, which every
    whole-model choice is held against, the faster of two runs."""
    ref_model = copy.deepcopy(model)
    whole_step(ref_model, batches[0], loss_fn, null, device)            # warm-up
    ref = [whole_step(ref_model, b, loss_fn, null, device) for b in batches]
    return ref_model, [(loss, g, min(t, whole_step(ref_model, b, loss_fn, null, device)[2]))
                       for (loss, g, t), b in zip(ref, batches)]


@dataclass(frozen=True)
class Form:
    """A form of a plan under a byte budget: each unit's choice (None: as chosen) and the
    ops outside the units (``plan.data["rest"]``; None: the region's)."""
    choices: dict | None
    rest: str | None


class Check:
    """What the whole-plan measurements of one search share: ``plan`` (changed in place),
    the working copy it runs on, the batches and loss, fp32's reference model and its
    (loss, grads, seconds) per batch, the units' measurements, the error budget, the device
    and the plan's notes."""

    def __init__(self, model: torch.nn.Module, batches, loss_fn, plan: Plan, measured,
                 budget: Budget, device: str) -> None:
        self.batches, self.loss_fn, self.plan = batches, loss_fn, plan
        self.measured, self.budget, self.device = measured, budget, device
        self.notes = plan.data["notes"]
        self.ref_model, self.ref = fp32_reference(model, batches, loss_fn, device)
        self.work = WorkingCopy(model)

    # ---- one measurement ----

    def run(self) -> dict:
        """:meth:`measure`; a plan whose step raises is a failed check, not a crash: its
        errors infinite, ``failed`` saying what was raised (and what to do, where ampc can
        tell), ``involved`` the units below fp32 where it was raised (all of them when no
        module's forward was running: a backward), which the back-off raises one step."""
        plan, work = self.plan, self.work
        try:
            return self.measure()
        except Exception as e:      # noqa: BLE001 (any failure of the plan's step backs off)
            low = [u.module for u in plan.every_unit if u.choice != "fp32"]
            where = failures.failing_module(e, work.model)
            mine = [n for n in low if where is not None and n != _loss.NAME
                    and (where == "" or n == where or n.startswith(where + ".")
                         or where.startswith(n + "."))]
            what = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
            hint = failures.explain(FN, e, work.model, self.batches[0][0], self.device)
            return {"loss_err": math.inf, "grad_err": math.inf, "wgrad_err": math.inf,
                    "wgrad_worst": None, "unit_wgrad": {}, "grad_noise": None,
                    "plan_ms": math.inf, "failed": what + (f" ({hint})" if hint else "")
                    + (f" in {where or 'the model'}" if where is not None else ""),
                    "involved": mine or low}

    def measure(self) -> dict:
        """The whole plan on the working copy against fp32 over the batches: loss error,
        error of all weight gradients together, the worst unit's weight-gradient error,
        fp32's batch-to-batch spread of the weight gradients, and step times."""
        plan, ref, device = self.plan, self.ref, self.device
        m = self.work.under(plan)
        scale = plan.data.get("loss_scale", 1.0) if plan.needs_scaler() else 1.0
        if plan.loss_unit is not None and _candidates.loss_scaled(plan.loss_unit.choice):
            # an fp16 loss's own gradient is the scale: a run backs off to what it measured at
            scale = min(scale, plan.loss_unit.options["fp16"].get("loss_scale") or scale)
        plan_loss = plan.loss(self.loss_fn)

        def scaled_loss(out, target):
            return plan_loss(out, target) * scale
        loss_errs, grad_errs, times = [], [], []
        unit_errs = {}
        owners = {}
        for name, mod in m.named_modules():
            if name in plan:
                for pn, _ in mod.named_parameters():
                    owners[f"{name}.{pn}"] = name
        whole_step(m, self.batches[0], scaled_loss, plan.autocast, device)   # warm-up
        for k, batch in enumerate(self.batches):
            ref_loss, ref_grads, _ = ref[k]
            loss, grads, t = whole_step(m, batch, scaled_loss, plan.autocast, device)
            loss /= scale
            grads = {n: g / scale for n, g in grads.items()}
            times.append(t)
            loss_errs.append(abs(loss - ref_loss) / max(abs(ref_loss), 1e-12)
                             if math.isfinite(loss) else math.inf)
            grad_errs.append(rel_error([grads.get(n) for n in ref_grads],
                                       list(ref_grads.values())) or 0.0)
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

    # ---- races: each pair timed turn about ----

    def race(self, entrants) -> dict:
        return race(entrants, self.batches, self.device)

    def fp32_entrant(self):
        """A :func:`race` entrant: fp32's step on the reference model."""
        return lambda: (self.ref_model, null, self.loss_fn)

    def plan_entrant(self, change=None):
        """A :func:`race` entrant: the plan's step on the working copy, after
        ``change(plan)`` (which puts the plan in the form this entrant times)."""
        def setup():
            if change is not None:
                change(self.plan)
            return self.work.under(self.plan), self.plan.autocast, self.plan.loss(self.loss_fn)
        return setup

    # ---- the decisions ----

    def back_off(self, result, objective, max_backoffs):
        """Raises the worst contributors until the whole plan fits the budget: one module per
        round for 4 rounds, then 2, 4, ... Returns the last check's result."""
        plan = self.plan
        for k in range(max_backoffs):
            over_by = over(result, self.budget)
            if over_by is None:
                break
            if over_by.key == "failed":
                self.raise_failed(result)
                result = self.run()
                continue
            for _ in range(2 ** (k // 4)):
                name = worst(plan, result, over_by)
                if name is None:
                    break
                u = plan.unit(name)
                usable = [c for c in order(self.measured[name], objective) if c not in u.rejected]
                new = raise_one(plan.decisions, self.measured, usable, name)
                plan.data["backoffs"].append({"module": name, "from": u.choice, "to": new,
                                              "why": str(over_by)})
                plan.set_choice(name, new, Reason.BACKED_OFF)
            result = self.run()
        return result

    def raise_failed(self, result):
        """Raises each unit involved in a failed check one step (RAISE_TO), and says so."""
        plan = self.plan
        names = [n for n in result["involved"] if plan.unit(n).choice != "fp32"]
        for name in names:
            u = plan.unit(name)
            new = _candidates.get(u.choice).raise_to
            plan.data["backoffs"].append({"module": name, "from": u.choice, "to": new,
                                          "why": "the whole plan raised an error"})
            plan.set_choice(name, new, Reason.BACKED_OFF)
        self.notes.append(f"the whole plan raised {result['failed']}: {len(names)} "
                          "module(s) raised one step and the plan checked again")

    def whole_low(self, result):
        """Small modules time slower in 16 bits one by one (each pays its casts) than they run
        in a model that stays in 16 bits between them. So the whole model is also measured
        with every module at its least precise candidate that fits the budget; that plan wins
        unless the modules' own choice measured clearly faster (by more than MARGIN), the two
        timed turn about."""
        plan = self.plan
        low, _ = solve_with_loss(self.measured, self.budget, "memory")   # the least precise
        if low == plan.decisions or result.get("failed"):    # a failed plan is not raced
            return result
        mine = plan.decisions
        plan.set_choices(low, Reason.WHOLE_MODEL)
        other = self.run()
        if over(other, self.budget) is not None:
            plan.set_choices(mine, Reason.SOLVED)
            return result
        ms = self.race({"mine": self.plan_entrant(lambda p: p.set_choices(mine, Reason.SOLVED)),
                        "low": self.plan_entrant(
                            lambda p: p.set_choices(low, Reason.WHOLE_MODEL))})
        # the least precise plan needs the least memory: it wins unless the modules' own
        # choice measured clearly faster (by more than MARGIN)
        if not clearly_faster(ms["mine"], ms["low"]):
            plan.set_choices(low, Reason.WHOLE_MODEL)
            self.notes.append(
                f"the modules one by one chose {count(mine)}; the whole model measured "
                f"{ms['low']:.1f} ms per step with {count(low)} against {ms['mine']:.1f} ms "
                f"(timed turn about; no more than {MARGIN:.0%} slower, less memory): taken")
            return dict(other, plan_ms=ms["low"])
        plan.set_choices(mine, Reason.SOLVED)
        return dict(result, plan_ms=ms["mine"])

    def under_ceiling(self, result, ceiling):
        """The memory objective's ceiling on the whole step: the plan measured more than
        ``ceiling`` times fp32's step (the units' casts, the ops outside them), so the two are
        timed turn about; while the plan is still over, first the ops outside the units go to
        fp32, then the units that measured slower alone than in fp32, then every unit. Each
        change only raises precision: errors are measured again, and fall. Returns (result,
        fp32 ms)."""
        plan, measured = self.plan, self.measured

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
                result = self.run()
            ms = self.race({"fp32": self.fp32_entrant(), "plan": self.plan_entrant()})
            first = first or ms
            if ms["plan"] <= ceiling * ms["fp32"] or plan.dtype == "fp32":
                break
        if done:
            self.notes.append(
                f"the whole plan measured {first['plan']:.1f} ms per step against fp32's "
                f"{first['fp32']:.1f} ms (timed turn about), over the {ceiling:g}x ceiling: "
                + ", then ".join(done))
        return dict(result, plan_ms=ms["plan"]), ms["fp32"]

    def fastest(self, result):
        """The time objective, for the whole model: the ops outside the units in fp32 only
        when that measured clearly faster (by more than MARGIN, within the budget) than at
        the region dtype; and fp32 throughout only when fp32 measured clearly faster than
        the plan. Each pair is timed turn about. Returns (result, fp32 ms)."""
        plan = self.plan
        plan.data["rest"] = "fp32"
        other = self.run()
        plan.data["rest"] = plan.dtype
        if over(other, self.budget) is None:
            ms = self.race({"region": self.plan_entrant(lambda p: p.data.update(rest=p.dtype)),
                            "fp32": self.plan_entrant(lambda p: p.data.update(rest="fp32"))})
            if clearly_faster(ms["fp32"], ms["region"]):
                plan.data["rest"] = "fp32"
                result = other
            else:
                plan.data["rest"] = plan.dtype
        ms = self.race({"fp32": self.fp32_entrant(), "plan": self.plan_entrant()})
        fp32_ms = ms["fp32"]
        result = dict(result, plan_ms=ms["plan"])
        if clearly_faster(fp32_ms, result["plan_ms"]):
            self.notes.append(f"the whole plan measured {result['plan_ms']:.1f} ms per step "
                              f"against {fp32_ms:.1f} ms for fp32: every module kept in fp32")
            plan.set_choices(dict.fromkeys(plan.decisions, "fp32"), Reason.ALL_FP32)
            result = dict(result, plan_ms=fp32_ms, loss_err=0.0, grad_err=0.0, wgrad_err=0.0,
                          wgrad_worst=None)
        return result, fp32_ms

    def fastest_under_bytes(self, result, peak_of, can_free=None):
        """A byte budget's plan is lowered from the fastest plan by the units' own times, yet
        its whole step can run far slower than its parts (16-bit ops outside the units where
        16-bit matmuls are slow, casts between the units). So its forms of higher precision
        are measured too: the ops outside the units in fp32, then every unit in fp32 keeping
        its saved tensors' code (the step's moves kept, and the gradients freed where
        ``can_free()`` says the plan now can: no fp16 module's loss scaler). A form whose
        step's peak (from ``peak_of()``, a memory report) fits the budget, or where the plan
        was over it, the plan's own peak and MARGIN more, and that runs clearly faster (timed
        turn about) is taken: it only raises precision, so its errors are measured again and fall. Returns
        (result, the report of the plan's step as it stands, or None where nothing was
        measured: no form but the plan's own)."""
        plan = self.plan
        units = {u.module: u for u in plan.every_unit}
        rest, freed, why = plan.data.get("rest"), plan.step.grads_freed, plan.step.why
        up = {n: _candidates.in_fp32(u.choice) for n, u in units.items()}
        forms = {"as chosen": Form(None, rest)}
        if plan.rest != "fp32":
            forms["the ops outside the modules in fp32"] = Form(None, "fp32")
        # only where each module's fp32 form was measured (a search whose candidates leave out
        # fp32+8b has no figures for it, and a plan never holds a choice it did not measure)
        if (any(up[n] != u.choice for n, u in units.items())
                and all(up[n] in u.options for n, u in units.items())):
            forms["every module in fp32"] = Form(up, "fp32")
        if len(forms) == 1 or result.get("failed"):
            return result, None

        def put(name):
            form = forms[name]
            for n, u in units.items():
                c = u.choice if form.choices is None else form.choices[n]
                if plan.unit(n).choice != c:
                    plan.set_choice(n, c, u.reason if c == u.choice else Reason.WHOLE_MODEL)
            plan.data["rest"] = form.rest
            if form.rest is None:
                del plan.data["rest"]
            plan.set_step(grads_freed=freed, why=why)
            if not freed and form.choices is not None and can_free is not None and can_free():
                plan.set_step(grads_freed=True, why={
                    **why, "grads freed": f"taken with {name}: no fp16 module left"})
        mine = peak_of()
        # over the budget anyway, a form may cost a little more than the plan (MARGIN) for
        # the time it saves
        budget = plan.peak.budget
        limit = budget if mine.peak <= budget else mine.peak * (1 + MARGIN)
        fits, peaks = {"as chosen": mine}, {}
        for name in list(forms)[1:]:
            put(name)
            try:
                rep = peak_of(limit)    # a form over it in its forward alone stops there
            except Exception:    # noqa: BLE001 (a form the model cannot run is not raced)
                continue
            peaks[name] = ("at least " if isinstance(rep, Floor) else "") + f"{rep.peak / MiB:.1f}"
            if rep.peak <= limit:
                fits[name] = rep
        put("as chosen")
        if len(fits) == 1:
            self.notes.append("under the byte budget the plan's forms of higher precision were "
                              "over it: " + ", ".join(f"{n} {b} MiB" for n, b in peaks.items()))
            return result, mine
        ms = self.race({n: self.plan_entrant(lambda p, n=n: put(n)) for n in fits})
        best = min(fits, key=ms.get)
        if best == "as chosen" or not clearly_faster(ms[best], ms["as chosen"]):
            best = None
        put(best or "as chosen")
        self.notes.append(
            "under the byte budget the whole step measured " + ", ".join(
                f"{ms[n]:.1f} ms {n}" + ("" if n == "as chosen" else
                                         f" ({fits[n].peak / MiB:.1f} MiB)") for n in fits)
            + f" (timed turn about): {best or 'the plan as chosen'} taken")
        if best is None:
            return dict(result, plan_ms=ms["as chosen"]), mine
        return dict(self.run(), plan_ms=ms[best]), fits[best]


def check_whole(model, batches, loss_fn, plan, measured, budget, objective, device, max_backoffs,
                peak_of=None, can_free=None):
    """The whole plan measured against fp32, backed off until it fits (else all fp32); for
    the time objective its fastest form, under a byte budget the fastest of its forms that
    fit (``peak_of``: the step's memory report; ``can_free``: whether the plan can free its
    gradients). The figures go to ``plan.data["measured"]``; returns the step's memory
    report under a byte budget, else None."""
    check = Check(model, batches, loss_fn, plan, measured, budget, device)
    notes, ceiling = check.notes, plan.data.get("ceiling")
    goal = _objectives.get(objective)
    if not goal.by_speed and ceiling is None:
        check.ref_model = None        # only the time objective and the ceiling race fp32
    fp32_ms = 1e3 * min(r[2] for r in check.ref)
    result = check.run()
    if goal.by_speed:
        result = check.whole_low(result)
    result = check.back_off(result, objective, max_backoffs)
    if over(result, budget):
        # fp32 throughout fits any budget: never hand back a plan known to be over it
        notes.append(f"the whole plan was still over the budget ({over(result, budget)}) "
                     f"after {max_backoffs} rounds of back-off: every module kept in fp32")
        plan.set_choices(dict.fromkeys(plan.decisions, "fp32"), Reason.ALL_FP32)
        result = dict(result, loss_err=0.0, grad_err=0.0, wgrad_err=0.0, wgrad_worst=None,
                      plan_ms=fp32_ms)
    if goal.by_speed and plan.dtype != "fp32":
        result, fp32_ms = check.fastest(result)
    report = None
    if peak_of is not None:
        result, report = check.fastest_under_bytes(result, peak_of, can_free)
    if ceiling is not None and plan.dtype != "fp32" and result["plan_ms"] > ceiling * fp32_ms:
        before = plan.decisions
        result, fp32_ms = check.under_ceiling(result, ceiling)
        if plan.decisions != before:
            report = None       # measured before the ceiling raised modules
    note = wgrad_note(result, plan, measured, budget)
    if note:
        notes.append(note)
    result.pop("unit_wgrad")
    result.pop("failed", None)
    result.pop("involved", None)
    result["fp32_ms"] = fp32_ms
    plan.data["measured"] = result
    return report


def solve_with_loss(measured, budget, objective, ceiling=None):
    """``solve``, then the loss back at fp32 where lowering it buys too little
    (``_loss.keep_fp32``): the reason goes to its rejected candidates."""
    choice, rejected = solve(measured, budget, objective, ceiling)
    why = _loss.keep_fp32(measured, choice, objective)
    if why is not None:
        rejected[_loss.NAME][choice[_loss.NAME]] = why
        choice[_loss.NAME] = "fp32"
    return choice, rejected


def count(choices):
    counts = {}
    for c in choices.values():
        counts[c] = counts.get(c, 0) + 1
    return ", ".join(f"{n} {c}" for c, n in sorted(counts.items()))


def over(result, budget):
    """Which whole-plan error is over the budget (an :class:`Over`), or None: the loss error
    against the fixed loss budget, the error of all weight gradients together against the
    grad budget or ``noise_fraction`` of fp32's batch-to-batch spread of them. (One unit's
    weight-gradient error in the whole plan also carries every later unit's dgrad error:
    it is held to the budget by :func:`wgrad_note`, and the units' own wgrad errors one
    by one, in the search.)"""
    if result.get("failed"):
        return Over("failed", math.inf, 0.0)
    if not (result["loss_err"] <= budget.loss):
        return Over("loss_err", result["loss_err"], budget.loss)
    limit = budget.limit("grad_err", result.get("grad_noise"))
    if not (result["grad_err"] <= limit):
        return Over("grad_err", result["grad_err"], limit)
    return None


def wgrad_note(result, plan, measured, budget):
    """A note for each unit whose weight gradient, in the whole plan, is over its limit (the
    wgrad budget or ``noise_fraction`` of its own batch-to-batch spread), or None when none
    is. The whole-plan back-off holds loss and grad; this says plainly what it left."""
    if plan.dtype == "fp32":
        return None        # fp32 throughout: nothing is off (the figures are an earlier plan's)
    out = []
    for name, e in result.get("unit_wgrad", {}).items():
        noise = measured[name]["fp32"].get("wgrad_noise")
        limit = budget.limit("wgrad_err", noise)
        if not (e <= limit):
            out.append(f"{name} {e:.2g} > {limit:.2g}")
    if not out:
        return None
    return (f"in the whole plan {len(out)} module(s) have weight-gradient errors over their "
            f"limit (wgrad budget or {budget.noise_fraction:g} of fp32's batch-to-batch "
            f"spread): " + ", ".join(out[:5]) + (" ..." if len(out) > 5 else ""))


def worst(plan, result, over_by):
    """The unit below fp32 that contributes most to what is over the budget."""
    low = [u for u in plan.every_unit if u.choice != "fp32"]
    if not low:
        return None
    key = "loss_err" if over_by.key == "loss_err" else "dgrad_err"

    def contribution(u):
        r = u.figures()
        return (r.get(key) or 0.0, r.get("wgrad_err") or 0.0)
    return max(low, key=contribution).module
