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
  fp16       the fractions of its activations and scaled gradients that overflow
             (|v| > 65504) or underflow (non-zero, rounding to zero)

and the time of its forward and backward at that precision, casts at its boundary
included. Every unit is measured on its own copy: the model is not changed.
"""
import contextlib
import copy
import math
import time

import torch

from . import _units
from ..validate._compare import _call as call
from ..validate._layers import _first_float as first_float

FP16_MAX = 65504.0




def _detach(value):
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, (tuple, list)):
        return type(value)(_detach(v) for v in value)
    if isinstance(value, dict):
        return {k: _detach(v) for k, v in value.items()}
    return value


def capture(model, batch, loss_fn, names):
    """One fp32 forward and backward of ``model``; returns (loss, {name: record}) with each
    unit's first call's args, kwargs, output and output gradient, and every parameter's
    gradient (the model's own .grad is left as it was)."""
    units = dict(model.named_modules())
    records = {}
    handles = []
    for name in names:
        def pre(mod, args, kwargs, name=name):
            if name not in records:
                records[name] = {"args": _detach(args), "kwargs": _detach(kwargs)}

        def post(mod, args, out, name=name):
            rec = records[name]
            if "out" in rec:
                return
            t = first_float(out)
            rec["out"] = None if t is None else t.detach().clone()
            if t is not None and t.requires_grad:
                t.register_hook(lambda g: rec.__setitem__("grad", g.detach().clone()))

        handles.append(units[name].register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(units[name].register_forward_hook(post))
    saved = [p.grad for p in model.parameters()]
    try:
        inputs, target = batch
        torch.manual_seed(0)
        loss = loss_fn(call(model, inputs), target)
        params = [p for p in model.parameters() if p.requires_grad]
        for p in params:
            p.grad = None
        loss.backward()
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()
                 if p.grad is not None}
    finally:
        for h in handles:
            h.remove()
        for p, g in zip(model.parameters(), saved):
            p.grad = g
    return loss.detach().float().item(), records, grads


def loss_scale_for(records, grads):
    """The loss scale GradScaler settles near: the largest power of two at which the
    largest gradient seen (unit output gradients and parameter gradients) stays under
    half of fp16's largest value; between 1 and 2**24."""
    top = 0.0
    for t in [r["grad"] for r in records.values() if r.get("grad") is not None] + list(grads.values()):
        if t.numel():
            top = max(top, float(t.detach().abs().max()))
    if top == 0.0 or not math.isfinite(top):
        return 65536.0
    return float(2.0 ** min(24, max(0, math.floor(math.log2(FP16_MAX / 2 / top)))))


@contextlib.contextmanager
def at(module, choice, device, recipe):
    """A region in which ``module`` runs at ``choice`` (fp32: no autocast at all)."""
    if choice == "fp32":
        yield
        return
    import ampc
    dtype, ops = _units.scope_args(module, choice)
    with contextlib.ExitStack() as stack:
        stack.enter_context(ampc.autocast(device, dtype=dtype))
        stack.enter_context(ampc.policy.scope(dtype=dtype, ops=ops))
        if choice == "fp8":
            stack.enter_context(ampc.fp8.autocast(recipe=recipe, modules=()))
        yield


def _float_leaves(value, out):
    if isinstance(value, torch.Tensor):
        if value.is_floating_point():
            out.append(value)
    elif isinstance(value, (tuple, list)):
        for v in value:
            _float_leaves(v, out)
    elif isinstance(value, dict):
        for v in value.values():
            _float_leaves(v, out)
    return out


def run_unit(module, choice, rec, device, recipe, scale):
    """Runs ``module`` alone on a recorded call at ``choice``; returns (output, input
    grads, weight grads, seconds). Gradients are unscaled."""
    args, kwargs = _detach(rec["args"]), _detach(rec["kwargs"])
    inputs = _float_leaves((args, kwargs), [])
    for t in inputs:
        t.requires_grad_(True)
    params = [p for p in module.parameters() if p.requires_grad]
    for p in params:
        p.grad = None
    if any(isinstance(m, torch.nn.Dropout) or getattr(m, "dropout", 0) for m in module.modules()):
        torch.manual_seed(0)       # the same dropout draws at every precision
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    # timed: the forward (its casts included) and the backward, not entering the region
    with at(module, choice, device, recipe):
        sync()
        t0 = time.perf_counter()
        out = first_float(module(*args, **kwargs))
        seconds = time.perf_counter() - t0
    grad = None if out is None or rec.get("grad") is None else rec["grad"] * scale
    if out is not None and out.requires_grad and grad is not None:
        sync()
        t0 = time.perf_counter()
        out.backward(grad)
        sync()
        seconds += time.perf_counter() - t0
    y = None if out is None else out.detach().float()
    dx = [None if t.grad is None else t.grad.float() / scale for t in inputs]
    dw = [None if p.grad is None else p.grad.float() / scale for p in params]
    for p in params:
        p.grad = None
    return y, dx, dw, seconds


def _rel(a, b):
    """||a - b|| / ||b|| over paired lists (None entries skipped); None when nothing to
    compare; inf when ``a`` is not finite."""
    num = den = 0.0
    seen = False
    for x, y in zip(a, b):
        if x is None or y is None:
            continue
        seen = True
        if not torch.isfinite(x).all():
            return math.inf
        num += float(torch.linalg.vector_norm((x - y).double())) ** 2
        den += float(torch.linalg.vector_norm(y.double())) ** 2
    if not seen:
        return None
    return math.sqrt(num) / math.sqrt(den) if den > 0 else math.sqrt(num)


def loss_error(y, ref, grad, loss):
    """Per example |<dL/dy, y - ref>|, summed over examples (dim 0), over |loss|."""
    if y is None or grad is None:
        return None
    if not torch.isfinite(y).all():
        return math.inf
    d = (grad.double() * (y.double() - ref.double()))
    per_example = d.reshape(d.shape[0], -1).sum(1) if d.dim() else d.reshape(1)
    return float(per_example.abs().sum()) / max(abs(loss), 1e-12)


def fp16_range(rec, ref_dw, scale):
    """(underflow, overflow) fractions, in fp16 at ``scale``, of the unit's output
    gradient and weight gradients (underflow), and of those and its activations
    (overflow)."""
    grads = [t for t in [rec.get("grad")] + [g for g in ref_dw if g is not None] if t is not None]
    total = under = over = 0
    for g in grads:
        s = (g.double() * scale).to(torch.float16)
        total += g.numel()
        under += int(((s == 0) & (g != 0)).sum())
        over += int((torch.isinf(s) & torch.isfinite(g)).sum())
    out = rec.get("out")
    if out is not None:
        total += out.numel()
        over += int((out.abs() > FP16_MAX).sum())
    return (under / total, over / total) if total else (None, None)


def unit_bytes(rec, module, choice):
    """Bytes of the unit's input and output activations plus its weights at ``choice``:
    what lower precision saves in memory (the memory objective)."""
    n = sum(t.numel() for t in _float_leaves((rec["args"], rec["kwargs"]), []))
    n += 0 if rec.get("out") is None else rec["out"].numel()
    n += _units.param_bytes(module)
    return n * _units.BYTES[choice]


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
        return out


def measure(model, batches, loss_fn, units, options, device, recipe, repeats=2, slow=None):
    """{name: {candidate: result}} for the units (name -> module) of ``model`` at their
    ``options`` (name -> candidates), and the loss scale used for fp16. Each run is timed
    ``repeats`` times per batch and the fastest kept (a busy machine only adds time). With
    ``slow``, a candidate whose first call takes ``slow`` times fp32's is not measured
    further for that unit (fp16 GEMMs on most CPUs)."""
    copies = {}
    for name, module in units.items():
        copies[name] = {}
        for c in options[name]:
            m = copy.deepcopy(module)
            if c == "fp8":
                import ampc
                ampc.fp8.convert(m)
            copies[name][c] = m
    tallies = {n: {c: Tally() for c in options[n]} for n in units}
    ref_model = copy.deepcopy(model)
    scale = None
    for k, batch in enumerate(batches):
        loss, records, grads = capture(ref_model, batch, loss_fn, list(units))
        if scale is None:
            scale = loss_scale_for(records, grads)
        for name in units:
            rec = records.get(name)
            if rec is None or "out" not in rec:
                continue               # not called on this batch
            first = k == 0
            if first:                  # a first call of each: warm-up (and fp8 history)
                warm = {}
                for c, m in copies[name].items():
                    try:
                        warm[c] = run_unit(m, c, rec, device, recipe,
                                           scale if c == "fp16" else 1.0)[3]
                    except RuntimeError as e:
                        tallies[name][c].error = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
                # a second fp32 call: the first one pays for one-time set-up
                base = run_unit(copies[name]["fp32"], "fp32", rec, device, recipe, 1.0)[3]
                for c, t in warm.items():
                    if slow and c != "fp32" and t > slow * max(base, 1e-4):
                        tallies[name][c].error = f"too slow here: {t / base:.0f}x fp32's time"
            ref_y, ref_dx, ref_dw, t32 = run_unit(copies[name]["fp32"], "fp32", rec, device,
                                                  recipe, 1.0)
            for _ in range(repeats - 1):
                t32 = min(t32, run_unit(copies[name]["fp32"], "fp32", rec, device, recipe, 1.0)[3])
            tallies[name]["fp32"].add(out_err=0.0, loss_err=0.0,
                                      dgrad_err=0.0 if any(g is not None for g in ref_dx) else None,
                                      wgrad_err=0.0 if ref_dw else None)
            tallies[name]["fp32"].times.append(t32)
            for c, m in copies[name].items():
                tally = tallies[name][c]
                if first:
                    tally.bytes = unit_bytes(rec, m, c)
                if c == "fp32" or tally.error:
                    continue
                s = scale if c == "fp16" else 1.0
                y, dx, dw, t = run_unit(m, c, rec, device, recipe, s)
                for _ in range(repeats - 1):
                    t = min(t, run_unit(m, c, rec, device, recipe, s)[3])
                under = over = None
                if c == "fp16":
                    under, over = fp16_range(rec, ref_dw, scale)
                tally.add(out_err=_rel([y], [ref_y]),
                          loss_err=loss_error(y, ref_y, rec.get("grad"), loss),
                          dgrad_err=_rel(dx, ref_dx), wgrad_err=_rel(dw, ref_dw),
                          underflow=under, overflow=over)
                tally.times.append(t)
    return {n: {c: t.result() for c, t in tallies[n].items()} for n in units}, scale or 65536.0
