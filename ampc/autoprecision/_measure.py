"""Per-unit sensitivity and cost, measured one unit at a time with the rest in fp32.

One fp32 forward and backward of the whole model records, for every unit, its inputs,
its output and the gradient of the loss at its output. Each unit is then run alone on
those recorded inputs at each candidate precision, and its output is back-propagated
with the recorded output gradient (scaled by the loss scale for fp16, as GradScaler
would). Against the unit's own fp32 run this gives, separately:

  loss err   the loss change its output error causes, to first order: per example
             |<dL/dy, y_c - y>|, summed, over |L| (the Taylor estimate ModelOpt uses for
             inference, here per example so that errors of opposite sign do not cancel)
  dgrad err  ||dx_c - dx|| / ||dx||, the gradient it passes to the layers before it
  wgrad err  ||dw_c - dw|| / ||dw||, over its own parameters
  noise      the batch-to-batch spread of the unit's fp32 input and weight gradients
             over the batches (ampc._numerics.noise): what an error is judged against
  fp16       the fractions of its activations and scaled gradients that overflow
             (|v| > 65504) or underflow (non-zero, rounding to zero)

and the time of its forward and backward at that precision, casts at its boundary
included. Every unit is measured on its own copy: the model is not changed.

A batch on which a unit's output, or the gradient at it, is all zero or not finite cannot
show an error (against zeros every error reads 0: a zero-initialised head zeroes every
gradient below it). Such batches are skipped; a unit silent on all of them is "not
measured". The search first looks for such units (:func:`silent_in`, in its first fp32 pass over the
batches) and, by default,
measures a copy of the model after a few fp32 optimizer steps (:func:`warm_if_silent`).
"""
import contextlib
import copy
import math

import torch

import ampc      # its fp8 attribute loads ampc.fp8 (and torch._dynamo) on first use only
from . import _candidates, _loss, _units
from .._numerics.capture import Call, capture
from .._numerics.errors import fp16_loss_scale, fp16_range, loss_error, rel_error, silent
from .._numerics.model import call_model, float_tensors
from .._numerics.noise import Spread
from .._numerics.unit import run_unit


def loss_scale_for(step):
    """The loss scale GradScaler settles near: the largest power of two at which the
    largest gradient of a captured step (unit output gradients and parameter gradients)
    stays under half of fp16's largest value; between 1 and 2**24."""
    top = 0.0
    for t in [c.grad for c in step.calls.values() if c.grad is not None] + list(step.grads.values()):
        if t.numel():
            top = max(top, float(t.detach().abs().max()))
    return fp16_loss_scale(top)


def unit_silent(rec: Call):
    """Why a recorded call cannot show a precision's error (its output or the gradient at
    its output all zero or not finite: a zero-initialised head zeroes every gradient below
    it), or None."""
    return silent([("output", rec.out), ("output gradient", rec.grad)])


def silent_in(model, batch, loss_fn, units):
    """{name: why or None} for one fp32 step of ``model`` on ``batch``: why each unit
    cannot show an error there (None: it can, or it was not called)."""
    step = capture(model, batch, loss_fn, list(units))
    return {name: (None if rec is None or not rec.returned else unit_silent(rec))
            for name, rec in ((n, step.calls.get(n)) for n in units)}


def silent_on_all(per_batch):
    """{name: why} of the units silent on every batch, from :func:`silent_in`'s results."""
    out = {}
    for found in per_batch:
        for name, why in found.items():
            if why is None:
                out[name] = None            # it showed something on this batch
            else:
                out.setdefault(name, why)
    return {n: why for n, why in out.items() if why is not None}


WARMUP_STEPS = 3
WARMUP_LR = 1e-3


def warmed_up(model, batches, loss_fn, steps=WARMUP_STEPS, lr=WARMUP_LR):
    """A copy of ``model`` after ``steps`` fp32 AdamW steps over the batches in turn. Adam's
    first steps move every parameter with a gradient by about ``lr``, whatever its scale:
    a zero-initialised layer then passes gradients to the layers below it."""
    model = copy.deepcopy(model)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)                   # the same dropout draws every search
        for k in range(steps):
            inputs, target = batches[k % len(batches)]
            opt.zero_grad(set_to_none=True)
            loss_fn(call_model(model, inputs), target).backward()
            opt.step()
    opt.zero_grad(set_to_none=True)
    return model


def _some(whys, k=3):
    """'why: a, b, c and 2 more; why: d' from {name: why}, at most ``k`` names a reason."""
    names = {}
    for n, w in whys.items():
        names.setdefault(w, []).append(n)
    return "; ".join(f"{w}: {', '.join(ns[:k])}" + (f" and {len(ns) - k} more" if len(ns) > k
                                                      else "") for w, ns in names.items())


def warm_if_silent(model, batches, loss_fn, units, warmup, quiet):
    """(the model to measure, its units, a note or None). With ``warmup="auto"``, a copy of
    ``model`` after WARMUP_STEPS fp32 AdamW steps when some unit cannot show an error at its
    weights (``quiet``: {name: why}, found by :func:`silent_in` on each batch), else
    ``model``; with a number, that many steps (0: none)."""
    if warmup == "auto":
        if not quiet:
            return model, units, None
        steps = WARMUP_STEPS
        why = (f"{len(quiet)} of {len(units)} modules cannot show an error at the model's "
               f"weights ({_some(quiet)}); measured")
    elif warmup:
        steps, why = warmup, f"warmup={warmup}: measured"
    else:
        return model, units, None
    model = warmed_up(model, batches, loss_fn, steps)
    return model, {n: model.get_submodule(n) for n in units}, (
        f"{why} after {steps} fp32 AdamW steps (lr {WARMUP_LR:g}) over the batches, on a copy "
        f"of the model" + ("; warmup=0 measures at its own weights" if warmup == "auto" else ""))


def not_measured_note(measured):
    """A note naming the units nothing could be measured on (kept fp32), or None."""
    blind = {n: next(r["not_measured"] for r in opts.values() if r.get("not_measured"))
             for n, opts in measured.items() if any(r.get("not_measured") for r in opts.values())}
    if not blind:
        return None
    return (f"{len(blind)} module(s) kept fp32, not measured ("
            + _some({n: w.removeprefix("not measured: ") for n, w in blind.items()}) + ")")


@contextlib.contextmanager
def at(module, choice, device, recipe):
    """A region in which ``module`` runs at ``choice`` (fp32: no autocast at all). How the
    unit keeps its saved tensors is the module's own (``_copies`` sets it)."""
    if _candidates.full_precision(choice):
        yield
        return
    dtype, ops = _units.scope_args(module, choice)
    with contextlib.ExitStack() as stack:
        stack.enter_context(ampc.autocast(device, dtype=dtype))
        stack.enter_context(ampc.policy.scope(dtype=dtype, ops=ops))
        if _candidates.fp8_linear(choice):
            stack.enter_context(ampc.fp8.autocast(recipe=recipe, modules=()))
        yield


def run_at(module, choice, call: Call, device, recipe, scale):
    """(output, input grads, weight grads, seconds) of ``module`` run alone on ``call`` at
    ``choice`` (see ampc._numerics.unit.run_unit)."""
    return run_unit(module, call, lambda: at(module, choice, device, recipe), device, scale)


def unit_fp16_range(call: Call, ref_dw, scale):
    """(underflow, overflow) fractions, in fp16 at ``scale``, of the unit's output
    gradient and weight gradients (underflow), and of those and its activations
    (overflow)."""
    grads = [t for t in [call.grad] + list(ref_dw) if t is not None]
    return fp16_range(grads, scale, [] if call.out is None else [call.out])


def unit_bytes(rec, module, choice, per_batch=1.0):
    """Bytes of the unit's input and output activations (what it saves for the backward,
    roughly; times ``per_batch`` where ``rec`` is of a slice of the batch) plus its weights
    at ``choice``: what lower precision or 8-bit saved tensors save in memory (the memory
    objective)."""
    n = sum(t.numel() for t in float_tensors((rec.args, rec.kwargs)))
    n += 0 if rec.out is None else rec.out.numel()
    c = _candidates.get(choice)
    return round(n * per_batch) * c.saved_bytes + _units.param_bytes(module) * c.bytes


class Tally:
    """Sums of one unit's errors at one candidate over the measured batches."""

    def __init__(self):
        self.n = 0
        self.sums = {"out_err": 0.0, "loss_err": 0.0, "dgrad_err": 0.0, "wgrad_err": 0.0,
                     "underflow": 0.0, "overflow": 0.0}
        self.seen = set()
        self.times = []
        self.bytes = 0
        self.error = None      # why the candidate could not run
        self.too_slow = None   # why the candidate is not worth its time here

    def add(self, **values):
        self.n += 1
        for k, v in values.items():
            if v is not None:
                self.sums[k] += v
                self.seen.add(k)

    def result(self):
        out = {k: (self.sums[k] / self.n if k in self.seen and self.n else None) for k in self.sums}
        out["ms"] = 1e3 * min(self.times) if self.times else None
        out["bytes"] = self.bytes
        if self.error:
            out["error"] = self.error
        if self.too_slow:
            out["too_slow"] = self.too_slow
        return out


def _copies(units, options):
    """{name: {candidate: a copy of the unit to run at it}} (fp8: an ampc.fp8.Linear)."""
    copies = {}
    for name, module in units.items():
        copies[name] = {}
        for c in options[name]:
            m = copy.deepcopy(module)
            if _candidates.fp8_linear(c):
                ampc.fp8.convert(m)
            if _candidates.saved(c):
                ampc.memory.compress(m, m, _candidates.saved(c))
            copies[name][c] = m
    return copies


def _signature(module, rec):
    """What makes two units time alike: their type, parameter shapes and argument shapes."""
    return (type(module).__name__, tuple(tuple(p.shape) for p in module.parameters()),
            tuple((tuple(t.shape), t.dtype) for t in float_tensors((rec.args, rec.kwargs))))


CLEAR = 2.0    # a candidate this many times past the too-slow line after one timed round


def _warm_up(copies, tallies, rec, device, recipe, scale, slow, verdict=None, k=3):
    """A first call of each candidate (fp8's amax history starts there; a first call of a
    shape also pays for kernel selection and allocation), noting those that fail. With
    ``slow``, every candidate that ran is then timed ``k`` more times, interleaved with the
    others so that a busy machine slows all alike, and one whose fastest time is ``slow``
    times fp32's is noted too slow: warm time against warm time, never a first call (one
    past the line by CLEAR times after a round is not timed again).
    Returns that verdict ({candidate: why too slow}); given one (a unit timed alike was
    judged already), it is taken as is, so that identical units get one verdict, and the
    candidates it found too slow are not run again."""
    ran = []
    for c, m in copies.items():
        if verdict is not None and c in verdict:
            continue                    # too slow for a unit timed alike: not run again
        try:
            run_at(m, c, rec, device, recipe, scale if _candidates.loss_scaled(c) else 1.0)
            ran.append(c)
        except RuntimeError as e:
            tallies[c].error = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
    if not slow or "fp32" not in ran:
        return verdict
    if verdict is None:
        best, live = {}, ran
        for _ in range(k):
            for c, r in _interleaved(copies, live, rec, device, recipe, scale, 1).items():
                best[c] = min(best.get(c, math.inf), r[3])
            base = max(best["fp32"], 1e-4)
            # one past the line by CLEAR times after a round is not timed again
            live = [c for c in live if c == "fp32" or best[c] <= CLEAR * slow * base]
        verdict = {c: f"too slow here: {t / base:.1f}x fp32's time" for c, t in best.items()
                   if c != "fp32" and t > slow * base}
    for c, why in verdict.items():
        if c in copies and not tallies[c].error:
            tallies[c].too_slow = why
    return verdict


def _interleaved(copies, live, rec, device, recipe, scale, repeats):
    """{candidate: run_at's result} for the ``live`` candidates, each time the fastest of
    ``repeats`` runs taken round-robin over the candidates (a busy machine then slows all
    of them alike, rather than whichever ran while it was busy)."""
    out = {}
    for _ in range(repeats):
        for c in live:
            r = run_at(copies[c], c, rec, device, recipe, scale if _candidates.loss_scaled(c) else 1.0)
            out[c] = r if c not in out else out[c][:3] + (min(out[c][3], r[3]),)
    return out


def _measure_unit(copies, tallies, rec, step, device, recipe, scale, repeats):
    """Adds one batch's errors and times of every candidate of one unit to its tallies."""
    live = [c for c in copies if c == "fp32" or not (tallies[c].error or tallies[c].too_slow)]
    runs = _interleaved(copies, live, rec, device, recipe, scale, repeats)
    ref_y, ref_dx, ref_dw, t32 = runs["fp32"]
    tallies["fp32"].add(out_err=0.0, loss_err=0.0,
                        dgrad_err=0.0 if any(g is not None for g in ref_dx) else None,
                        wgrad_err=0.0 if ref_dw else None)
    tallies["fp32"].times.append(t32)
    for c, m in copies.items():
        tally = tallies[c]
        if c not in runs or c == "fp32":
            continue
        y, dx, dw, t = runs[c]
        under, over = unit_fp16_range(rec, ref_dw, scale) if _candidates.loss_scaled(c) else (None, None)
        tally.add(out_err=rel_error([y], [ref_y]),
                  loss_err=loss_error(y, ref_y, rec.grad, step.loss),
                  dgrad_err=rel_error(dx, ref_dx), wgrad_err=rel_error(dw, ref_dw),
                  underflow=under, overflow=over)
        tally.times.append(t)
    return ref_dx, ref_dw


def _pool_times(out, groups):
    """Gives the units of each group (one type, parameter shapes and argument shapes: the
    same work) the fastest time any of them measured at each candidate: the minimum over
    all their runs, which a busy machine moves far less than one unit's few, and one
    choice for them all."""
    for names in groups:
        for c in out[names[0]]:
            times = [out[n][c]["ms"] for n in names if c in out[n] and out[n][c]["ms"] is not None]
            for n in names:
                if times and c in out[n] and out[n][c]["ms"] is not None:
                    out[n][c]["ms"] = min(times)


def measure(model, batches, loss_fn, units, options, device, recipe, repeats=2, slow=None,
            loss=None, per_batch=1.0):
    """{name: {candidate: result}} for the units (name -> module) of ``model`` at their
    ``options`` (name -> candidates), and the loss scale used for fp16. Each run is timed
    ``repeats`` times per batch, interleaved over the candidates, and the fastest kept (a
    busy machine only adds time). With ``slow``, a candidate whose warm time (fastest of a
    few interleaved runs after a first call) is ``slow`` times fp32's is not measured
    further for that unit (fp16 GEMMs on most CPUs); units of one type, parameter shapes
    and argument shapes are judged once, the first of them for all, share the fastest
    time any of them measured (the repeated blocks of a transformer), and only the first
    repeats its runs: the others run each candidate once a batch, for their errors.

    With ``loss`` (an ``_loss.Tally``), the loss is measured as a unit too, on each step's
    recorded output, and its figures come back under ``_loss.NAME``; not when the model
    returns a loss it computed itself (the loss then ran inside the model).

    ``per_batch``: whole batches over the batches given (these a slice of the examples of
    each): activation bytes are scaled by it."""
    copies = _copies(units, options)
    tallies = {n: {c: Tally() for c in options[n]} for n in units}
    # fp32's own batch-to-batch spread of the unit's input and weight gradients
    spreads = {n: {"dgrad_noise": Spread(), "wgrad_noise": Spread()} for n in units}
    ref_model = copy.deepcopy(model)
    scale = None
    verdicts = {}      # _signature -> the too-slow verdict of the first unit timed alike
    alike = {}         # _signature -> the units timed alike
    first_alike = {}   # name -> whether it is the first of its units timed alike
    quiet = {}         # name -> why a batch could not show its error
    for batch in batches:
        step = capture(ref_model, batch, loss_fn, list(units), keep_output=loss is not None)
        if scale is None:
            scale = loss_scale_for(step)
        for name in units:
            rec = step.calls.get(name)
            if rec is None or not rec.returned:
                continue               # not called on this batch
            if not tallies[name]["fp32"].bytes:
                for c, m in copies[name].items():
                    tallies[name][c].bytes = unit_bytes(rec, m, c, per_batch)
            why = unit_silent(rec)
            if why is not None:
                quiet.setdefault(name, why)     # errors against zeros would all read 0
                continue
            fp32 = tallies[name]["fp32"]
            if not fp32.n and not fp32.error:    # the first batch it is measured on
                sig = _signature(units[name], rec)
                alike.setdefault(sig, []).append(name)
                first_alike[name] = alike[sig][0] == name
                verdicts[sig] = _warm_up(copies[name], tallies[name], rec, device, recipe, scale,
                                         slow, verdicts.get(sig))
            if fp32.error:
                continue                        # it does not run alone: nothing to compare
            # the errors need one run a candidate; the time is pooled over the units timed
            # alike, so only the first of them repeats its runs for it
            ref_dx, ref_dw = _measure_unit(copies[name], tallies[name], rec, step, device, recipe,
                                           scale, repeats if first_alike[name] else 1)
            spreads[name]["dgrad_noise"].add(ref_dx)
            spreads[name]["wgrad_noise"].add(ref_dw)
        if loss is not None and not _loss.owns_loss(step.output):
            loss.add(step, scale)
    out = {n: {c: t.result() for c, t in tallies[n].items()} for n in units}
    for n in units:
        if not tallies[n]["fp32"].n:      # nothing measured: silent, failed alone or not called
            why = (f"{quiet[n]} on every batch" if n in quiet
                   else tallies[n]["fp32"].error or "never called on the batches")
            for c, r in out[n].items():
                if c != "fp32":
                    r["not_measured"] = f"not measured: {why}"
    _pool_times(out, alike.values())
    for n in units:
        noise = {k: s.value() for k, s in spreads[n].items()}
        for r in out[n].values():
            r.update(noise)
    if loss is not None and loss.times["fp32"]:
        out[_loss.NAME] = loss.result()
    return out, scale or 65536.0
