"""A byte budget for a training step's peak (search's ``peak_bytes``): the fastest plan,
within the error budget, whose step measures under it.

A unit's bytes at a candidate (what it saves for the backward and its weights,
``_measure.unit_bytes``) say which choices save memory and about how much; a block (a
transformer layer, a ResNet block) recomputed in the backward saves what its modules saved
in the last measured step. But the peak is what a step measures: the ops outside the units
save tensors of their own, a unit's input may be held anyway by the op before it. So the
plan's step is measured (``ampc.memory.report`` on a copy, with the optimizer the search was
given); the moves that save the most bytes for the least time are taken until the predicted
saving covers what is over, and the step is measured again, the prediction scaled by what
the last round's moves really saved: at most ROUNDS rounds.
"""
from __future__ import annotations

import copy
import math
import warnings

import torch
from torch import nn

from . import _candidates
from ._apply import recomputed, sliced
from .._numerics.model import call_model, logits_of
from ._solve import _err, summed_errors
from ._units import Reason

ROUNDS = 4
MiB = float(1 << 20)
FN = "ampc.autoprecision.search"


def check_args(peak_bytes, optimizer, objective):
    """Raises, before anything is measured, on a budget search cannot take."""
    if peak_bytes is None:
        return
    if objective != "memory":
        raise ValueError(f"{FN}: peak_bytes is a budget of the memory objective; pass "
                         f"objective='memory' (got {objective!r})")
    if not (isinstance(peak_bytes, (int, float)) and not isinstance(peak_bytes, bool)
            and 0 < peak_bytes < math.inf):
        raise ValueError(f"{FN}: peak_bytes must be a positive number of bytes, got "
                         f"{peak_bytes!r}")
    if not callable(optimizer):
        raise TypeError(f"{FN}: optimizer must be a callable that takes the parameters and "
                        f"returns an optimizer (such as torch.optim.AdamW), got "
                        f"{type(optimizer).__name__}")


class _Under(torch.nn.Module):
    """The model run inside the plan's region (the report calls a module)."""

    def __init__(self, model, region):
        super().__init__()
        self.model = model
        self.region = region

    def forward(self, *args, **kwargs):
        with self.region():
            return self.model(*args, **kwargs)


def step_peak(model, plan, batch, loss_fn, optimizer):
    """The ``ampc.memory.report`` of a training step of ``plan`` applied to a copy of
    ``model``, with ``optimizer(params)`` (its module names begin ``model.``)."""
    from ..memory import report
    work = copy.deepcopy(model)
    plan.apply(work)
    with torch.random.fork_rng(devices=[]):
        # warmup=0: the optimizer's state from a step on zero gradients, not a whole
        # training step (the same bytes; half the time of each measurement)
        return report(_Under(work, plan.autocast), optimizer(list(work.parameters())), batch,
                      plan.loss(loss_fn), warmup=0)


def _frees_grads(optimizer, plan):
    """Whether the step can free each gradient in the backward instead: ``optimizer`` makes
    ampc's Adam or AdamW (``step_in_backward``, which fp16's loss scaler and several ranks
    rule out), not doing so already."""
    if plan.needs_scaler() or (torch.distributed.is_available() and
                               torch.distributed.is_initialized() and
                               torch.distributed.get_world_size() > 1):
        return False
    import ampc.optim
    probe = optimizer([nn.Parameter(torch.zeros(1))])
    return isinstance(probe, ampc.optim.Adam) and not probe.step_in_backward


def freeing(optimizer):
    """``optimizer`` as it would be made with ``step_in_backward=True``: each parameter
    stepped, and its gradient freed, as soon as the backward completes it (its groups and
    options kept)."""
    def make(params):
        opt = optimizer(params)
        options = {k: v for k, v in opt.defaults.items() if k != "differentiable"}
        return type(opt)([dict(g) for g in opt.param_groups], step_in_backward=True, **options)
    return make


SLICED = "sliced head"     # the move that defers a head's logits to the loss


def heads(model, batch, units):
    """{unit: bytes its logits take in fp32} for the Linear units whose output is the model's
    output (its logits): the head, whose logits (with their fp32 copy and log-softmax) the
    loss can make a slice at a time instead (ampc.memory.sliced_head)."""
    work = copy.deepcopy(model)
    seen, hooks = {}, []
    for n in units:
        m = work.get_submodule(n)
        if type(m) is nn.Linear:
            hooks.append(m.register_forward_hook(
                lambda mod, args, out, n=n: seen.__setitem__(id(out), n)))
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            out = call_model(work, batch[0])
    finally:
        for h in hooks:
            h.remove()
    logits = logits_of(out)
    name = None if logits is None else seen.get(id(logits))
    return {} if name is None else {name: 3 * 4 * logits.numel()}


def blocks(model, units):
    """Modules worth recomputing whole, outermost only: each child of a ModuleList or
    Sequential that holds at least two units (a transformer's layers, a ResNet's blocks).
    One unit alone saves nothing recomputed: its input is kept."""
    found = []
    for parent, m in model.named_modules():
        if not isinstance(m, (nn.ModuleList, nn.Sequential)):
            continue
        for k, _ in m.named_children():
            name = f"{parent}.{k}" if parent else k
            if (sum(_inside(u, name) for u in units) >= 2
                    and not any(_inside(name, b) for b in found)):
                found.append(name)
    return found


def _inside(name, block):
    return name.startswith(block + ".")


class _Lowering:
    """The plan's choices as the greedy lowers them: unit moves (a candidate with fewer bytes)
    and block moves (recompute a block: the bytes its modules saved in the last measured step,
    for about a third of its units' forward + backward time), best first by time added per
    byte saved; a move is open only while the units' summed errors stay within their limits."""

    def __init__(self, plan, usable, measured, budget, recompute, saved, banned=(),
                 head_bytes=None):
        self.choice, self.usable, self.measured = plan.decisions, usable, measured
        # (unit, candidate), (block, None) or (head, SLICED): saved nothing
        self.banned = set(banned)
        self.limits, self.totals = summed_errors(measured, self.choice, budget)
        self.recompute, self.saved = list(recompute), saved
        self.sliced, self.head_bytes = list(sliced(plan)), head_bytes or {}

    def _ms(self, n, c):
        return self.measured[n][c].get("ms") or 0.0

    def _fits(self, n, a):
        now, r = self.measured[n][self.choice[n]], self.measured[n][a]
        return all(self.totals[k] + _err(r, k) ** 2 - _err(now, k) ** 2 <= self.limits[k]
                   for k in self.limits)

    def moves(self):
        out = []
        for n, c in self.choice.items():
            if any(_inside(n, b) for b in self.recompute):
                continue                      # saves nothing: the block keeps only its input
            for a in self.usable[n]:
                saved = (self.measured[n][c].get("bytes") or 0) - (self.measured[n][a].get("bytes") or 0)
                if saved > 0 and (n, a) not in self.banned and self._fits(n, a):
                    extra = max(self._ms(n, a) - self._ms(n, c), 0.0)
                    out.append((extra / saved, -saved, n, a))
        for b, saved in self.saved.items():
            if b not in self.recompute and saved > 0 and (b, None) not in self.banned:
                ms = sum(self._ms(n, c) for n, c in self.choice.items() if _inside(n, b)) / 3
                out.append((ms / saved, -saved, b, None))
        for h, saved in self.head_bytes.items():
            # the loss takes the head's gradients slice by slice: no time added, none recomputed
            if h not in self.sliced and (h, SLICED) not in self.banned:
                out.append((0.0, -saved, h, SLICED))
        return sorted(out, key=lambda m: m[:3])

    def take(self, target):
        """Takes the best moves until their bytes reach ``target``; (units changed, blocks
        recomputed, bytes predicted)."""
        changed, new_blocks, got = {}, [], 0
        while got < target:
            moves = self.moves()
            if not moves:
                break
            _, minus_saved, n, a = moves[0]
            got -= minus_saved
            if a == SLICED:
                self.sliced.append(n)
                c = self.choice[n]
                if _candidates.saved(c):          # its input is kept whole for the loss
                    self._move(n, _candidates.get(c).raise_to, changed)
                continue
            if a is None:
                new_blocks.append(n)
                self.recompute.append(n)
                # its modules' 8-bit codes would only add a copy: nothing inside is saved
                for u, c in self.choice.items():
                    if _inside(u, n) and _candidates.saved(c):
                        self._move(u, _candidates.get(c).raise_to, changed)
                continue
            self._move(n, a, changed)
        return changed, new_blocks, got

    def _move(self, n, a, changed):
        for k in self.limits:
            self.totals[k] += (_err(self.measured[n][a], k) ** 2
                               - _err(self.measured[n][self.choice[n]], k) ** 2)
        self.choice[n] = changed[n] = a


def _block_saved(rep, names):
    """{block: bytes its modules saved for the backward} in the measured step."""
    return {b: sum(v for k, v in rep.saved.items()
                   if k == "model." + b or _inside(k, "model." + b)) for b in names}


def fit(plan, model, batches, loss_fn, measured, rejected, budget, peak_bytes, optimizer):
    """Lowers the plan's units, and recomputes blocks, until its step's peak measures under
    ``peak_bytes`` (or nothing is left to do); the figures go to ``plan.data["peak"]``."""
    batch = batches[0]
    usable = {n: [c for c in opts if c not in rejected.get(n, {}) and not opts[c].get("error")]
              for n, opts in measured.items()}
    names = blocks(model, [u.module for u in plan])
    head_bytes = heads(model, batch, [u.module for u in plan])
    fp32_peak = step_peak(model, _all_fp32(plan), batch, loss_fn, optimizer).peak
    rep = step_peak(model, plan, batch, loss_fn, optimizer)
    first, rounds, scale = rep.peak, 0, 1.0   # scale: bytes the step saved per byte predicted
    freed = False
    if rep.peak > peak_bytes and _frees_grads(optimizer, plan):
        # the first move: no whole-model gradient, for no error and about no time
        frees = freeing(optimizer)
        new = step_peak(model, plan, batch, loss_fn, frees)
        if new.peak < rep.peak:
            rep, freed, optimizer = new, True, frees
    banned = set()
    while rep.peak > peak_bytes and rounds < ROUNDS:
        lowering = _Lowering(plan, usable, measured, budget, recomputed(plan),
                             _block_saved(rep, names), banned, head_bytes)
        before = ({u.module: u for u in plan.every_unit}, recomputed(plan), sliced(plan))
        changed, new_blocks, predicted = lowering.take((rep.peak - peak_bytes) / scale)
        if not changed and not new_blocks and len(lowering.sliced) == len(sliced(plan)):
            break
        for n, c in changed.items():
            plan.set_choice(n, c, Reason.PEAK)
        if new_blocks:
            plan.data["recompute"] = lowering.recompute
        new_heads = [h for h in lowering.sliced if h not in before[2]]
        if new_heads:
            plan.data["sliced_head"] = lowering.sliced
        rounds += 1
        new = step_peak(model, plan, batch, loss_fn, optimizer)
        if new.peak >= rep.peak:
            # the step did not fall (a bf16 copy held beside the fp32 tensor it came from
            # adds bytes): the round is undone and its moves not tried again
            _undo(plan, before)
            banned |= (set(changed.items()) | {(b, None) for b in new_blocks}
                       | {(h, SLICED) for h in new_heads})
            continue
        if predicted > 0:
            scale = min(1.0, max(0.05, (rep.peak - new.peak) / predicted))
        rep = new
    plan.data["peak"] = {"budget": int(peak_bytes), "fp32": fp32_peak, "fastest": first,
                         "bytes": rep.peak, "rounds": rounds, "grads_freed": freed}


def _undo(plan, before):
    """The plan as it was before a round: each unit's choice and reason, the blocks."""
    units, rc, heads_before = before
    for n, u in units.items():
        if plan.unit(n) != u:
            plan.set_choice(n, u.choice, u.reason)
    plan.data["recompute"] = rc
    plan.data["sliced_head"] = heads_before


def _all_fp32(plan):
    fp32 = copy.deepcopy(plan)
    fp32.set_choices(dict.fromkeys(fp32.decisions, "fp32"), Reason.ALL_FP32)
    return fp32


def settle(plan, model, batches, loss_fn, optimizer, fitted):
    """Whether the budget was met, said in the notes (and a warning when it was not); the
    step is measured again where the whole-plan check changed the choices ``fit`` left
    (``fitted``): a back-off raises units, and bytes with them."""
    d = plan.data["peak"]
    if d.get("grads_freed"):
        optimizer = freeing(optimizer)
    if plan.decisions != fitted:
        d["bytes"] = step_peak(model, plan, batches[0], loss_fn, optimizer).peak
    d["met"] = d["bytes"] <= d["budget"]
    rc = recomputed(plan)
    what = (f"peak budget {d['budget'] / MiB:.1f} MiB: {'met' if d['met'] else 'NOT met'}, the "
            f"step measured {d['bytes'] / MiB:.1f} MiB (fp32 {d['fp32'] / MiB:.1f} MiB, the "
            f"fastest plan {d['fastest'] / MiB:.1f} MiB; {d['rounds']} round(s) of lowering"
            + (f", {len(rc)} block(s) recomputed" if rc else "")
            + (f", the head's logits sliced ({', '.join(sliced(plan))})" if sliced(plan) else "")
            + ")"
            + ("; with the gradients freed in the backward: make the optimizer with "
               "step_in_backward=True" if d.get("grads_freed") else ""))
    if not d["met"]:
        why = ("the whole-plan check raised modules back to hold the error budget"
               if plan.data.get("backoffs") else
               "no module or block had a choice left that saves bytes within the error budget")
        what += (f": {why}; a larger budget, a looser error budget"
                 + ("" if sliced(plan) else ", ampc.memory.sliced_head on the head")
                 + ("" if d.get("grads_freed") else
                                       ", or ampc.optim.AdamW(..., step_in_backward=True) to "
                                       "free the gradients in the backward"))
        warnings.warn(f"{FN}: {what}", stacklevel=3)
    plan.data["notes"].append(what)
