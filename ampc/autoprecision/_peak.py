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
import functools
import time
import warnings
from dataclasses import replace

import torch
from torch import nn

from . import _candidates, _step
from ._apply import recomputed, sliced
from .._numerics.model import call_model, logits_of
from ..memory import batch_size, why_not_split
from ._solve import _err, summed_errors
from ._step_peak import FN, MiB, _ampc_adam, _optimizer_ms, can_free, step_peak
from ._units import Reason

ROUNDS = 8
# a whole-step move is kept only where it lowers the step's peak by at least this share of
# it: none is free in time (freed gradients step each tensor alone in the backward, a sliced
# head runs its loss a slice at a time; on a 1.65M GPT each cost 3-7% of the step)
MATERIAL = 0.01
MAX_MICRO = 16      # the most micro-batches a batch is split into


def free_moves(plan, model, batch, loss_fn, optimizer, rep, stop=None, head_bytes=None):
    """The whole-step moves that cost little time, each measured and kept where the step's
    peak falls by MATERIAL of it or more, until it is under ``stop``: each gradient freed in
    the backward (no gradient of the whole model), the lean state (bf16 weights, 8-bit
    moments: 6 B a parameter against fp32 AdamW's 16), the head's logits sliced.
    ``plan.step.why`` says why each was taken or left; ``head_bytes``: :func:`heads`, where
    the caller found them. Returns the report of the step as it stands."""
    why = dict(plan.step.why)
    if head_bytes is None:
        head_bytes = heads(model, batch, [u.module for u in plan])

    def attempt(name, change, undo, cannot_lower=None):
        """Measures the step with ``change`` and keeps it where the peak falls; where
        ``cannot_lower`` says why it could not, that is the reason, and nothing is measured."""
        nonlocal rep
        if stop is not None and rep.peak <= stop:
            why.setdefault(name, "not needed: the step was under the budget")
            return
        if cannot_lower:
            why[name] = f"left: {cannot_lower}"
            return
        plan.set_step(**change)
        try:
            new = step_peak(model, plan, batch, loss_fn, optimizer)
        except Exception as e:     # noqa: BLE001 (a move the model cannot take is left)
            plan.set_step(**undo)
            why[name] = f"left: the step raised {type(e).__name__}: {str(e).splitlines()[0][:120]}"
            return
        if new.peak < rep.peak * (1 - MATERIAL):
            why[name] = f"taken: the step's peak {rep.peak / MiB:.1f} -> {new.peak / MiB:.1f} MiB"
            rep = new
            return True
        plan.set_step(**undo)
        why[name] = (f"left: the step's peak did not fall by {MATERIAL:.0%} "
                     f"({rep.peak / MiB:.1f} -> {new.peak / MiB:.1f} MiB)")

    cannot = can_free(optimizer, plan)
    if cannot:
        why["grads freed"] = f"left: {cannot}"
    elif not plan.step.grads_freed:
        # a peak where no gradient is alive (in the forward, the batch whole) keeps its bytes
        # with the gradients freed: it cannot fall
        attempt("grads freed", {"grads_freed": True}, {"grads_freed": False},
                cannot_lower=None if rep.parts.get("grads") else
                f"no gradient is alive at the step's peak (in its {rep.phase}): freeing them "
                "cannot lower it")
    if plan.step.state == "fp32":
        if _ampc_adam(optimizer) is None:
            why["state"] = "fp32: the optimizer is not Adam or AdamW"
        else:
            before = plan.step.bytes_per_param()
            if attempt("state", {"state": "lean"}, {"state": "fp32"}):
                fp32_ms = _optimizer_ms(model, _step.Step(), optimizer)
                lean_ms = _optimizer_ms(model, plan.step, optimizer)
                why["state"] += (f"; lean: {plan.step.bytes_per_param():.2f} B a parameter of "
                                 f"weights, state and grads against {before:.2f}; its optimizer "
                                 f"step {lean_ms:.1f} ms against {fp32_ms:.1f} ms here; quality "
                                 f"{_step.QUALITY['lean']}")
    for h in head_bytes:
        u = plan.unit(h)
        if h in plan.step.sliced_head:
            continue
        # the loss keeps a sliced head's input whole (a code would only add a copy), and an
        # fp8 Linear computes another way: such a head takes the fastest candidate measured
        # that can be sliced (a bf16 head on a CPU without AVX-512 BF16 would cost more
        # than the slice saves in time), kept only with the slice
        up = u.choice
        if not _sliceable(up, sliced=True):
            can = [c for c, o in u.options.items() if _sliceable(c, sliced=True)
                   and not o.get("error") and o.get("ms") and c not in u.rejected]
            if not can:
                continue
            up = min(can, key=lambda c: u.options[c]["ms"])
        if up != u.choice:
            plan.set_choice(h, up, Reason.PEAK)
        if not attempt(f"sliced head {h}", {"sliced_head": plan.step.sliced_head + (h,)},
                       {"sliced_head": plan.step.sliced_head}):
            plan.set_choice(h, u.choice, u.reason)
    plan.set_step(why=why)
    return rep


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


def recompute_candidates(model, units):
    """What may be recomputed: the blocks (:func:`blocks`), then each block's children that
    hold two units or more (a transformer layer's attention and its MLP): a part costs
    less time than its block, and the MLP holds most of a layer's saved bytes; then the
    modules inside a block that hold no parameters and no module (:func:`leaves`)."""
    found = blocks(model, units)
    parts = []
    for b in found:
        for k, _ in model.get_submodule(b).named_children():
            name = f"{b}.{k}"
            if sum(_inside(u, name) for u in units) >= 2:
                parts.append(name)
    return found + parts + leaves(model, units)


def leaves(model, units):
    """The modules inside the blocks (:func:`blocks`) that hold no parameters and no module (an
    activation such as GPT-2's tanh GELU, whose ops each save a tensor as wide as the MLP):
    recomputed alone they cost only their own elementwise forward, where a part costs a
    third of its matmuls. One that works in place is left out (``ampc.memory.recompute``
    refuses it)."""
    out = []
    for b in blocks(model, units):
        for k, m in model.get_submodule(b).named_modules():
            name = f"{b}.{k}"
            if (k and next(m.children(), None) is None and next(m.parameters(), None) is None
                    and getattr(m, "inplace", False) is not True and name not in units):
                out.append(name)
    return out


class LeafCosts:
    """What recomputing each leaf module (:func:`leaves`) costs: ``ms``, its forward's
    milliseconds (all its calls in a forward, timed by hooks in the plan's model under its
    region, the faster of two forwards: a recomputation runs them once more), and ``kept``,
    the bytes of its tensor inputs, which the recomputation keeps in place of what its ops
    saved."""

    def __init__(self, model, plan, batch, names):
        self.ms, self.kept = {}, {}
        if not names:
            return
        work = copy.deepcopy(model)
        plan.apply(work)
        runs, start, hooks = [], {}, []

        def before(n, args, kwargs):
            self.kept[n] = self.kept.get(n, 0) + sum(
                a.numel() * a.element_size() for a in (*args, *kwargs.values())
                if isinstance(a, torch.Tensor))
            start[n] = time.perf_counter()

        def after(n):
            runs[-1][n] = runs[-1].get(n, 0.0) + time.perf_counter() - start[n]
        for n in names:
            m = work.get_submodule(n)
            hooks.append(m.register_forward_pre_hook(
                lambda mod, args, kwargs, n=n: before(n, args, kwargs), with_kwargs=True))
            hooks.append(m.register_forward_hook(lambda mod, args, out, n=n: after(n)))
        try:
            with torch.random.fork_rng(devices=[]):
                for _ in range(2):
                    runs.append({})
                    self.kept = {}
                    with plan.autocast():
                        out = call_model(work, batch[0])
                    del out
        finally:
            for h in hooks:
                h.remove()
        self.ms = {n: 1e3 * min(r.get(n, 0.0) for r in runs) for n in runs[-1]}

    def saved(self, rep, names):
        """:func:`_block_saved` with each leaf's inputs taken off (kept when recomputed: a
        leaf that saves only its input, such as torch's GELU, saves nothing recomputed)."""
        out = _block_saved(rep, names)
        for n, kept in self.kept.items():
            if n in out:
                out[n] = max(out[n] - kept, 0)
        return out


def _inside(name, block):
    return name.startswith(block + ".")


class _Lowering:
    """The plan's choices as the greedy lowers them: unit moves (a candidate with fewer bytes)
    and block moves (recompute a block: the bytes its modules saved in the last measured step,
    for about a third of its units' forward + backward time), best first by time added per
    byte saved; a move is open only while the units' summed errors stay within their limits."""

    def __init__(self, plan, usable, measured, budget, recompute, saved, banned=(),
                 head_bytes=None, leaf_ms=None):
        self.choice, self.usable, self.measured = plan.decisions, usable, measured
        # (unit, candidate), (block, None) or (head, SLICED): saved nothing
        self.banned = set(banned)
        self.limits, self.totals = summed_errors(measured, self.choice, budget)
        self.recompute, self.saved = list(recompute), saved
        self.leaf_ms = leaf_ms or {}     # a leaf module's recomputation: its forward
        self.sliced, self.head_bytes = list(sliced(plan)), head_bytes or {}
        # gradients freed in the backward: no choice may need the loss scaler's whole look
        self.scaled_ok = not plan.step.grads_freed

    def _ms(self, n, c):
        return self.measured[n][c].get("ms") or 0.0

    def _bytes(self, n, c):
        return self.measured[n][c].get("bytes") or 0

    def _unscaled_as_small(self, n, a):
        """Whether another usable candidate of unit n saves as many bytes as ``a`` without a
        loss scaler (bf16 beside fp16): fp16 would cost the plan a scaler and its freed
        gradients for no byte more, so it is not offered."""
        return any(not _candidates.loss_scaled(b) and self._bytes(n, b) <= self._bytes(n, a)
                   and self._fits(n, b) for b in self.usable[n] if b != a)

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
                if n in self.sliced and not _sliceable(a, sliced=True):
                    continue
                if _candidates.loss_scaled(a) and (not self.scaled_ok
                                                   or self._unscaled_as_small(n, a)):
                    continue

                saved = self._bytes(n, c) - self._bytes(n, a)
                if saved > 0 and (n, a) not in self.banned and self._fits(n, a):
                    extra = max(self._ms(n, a) - self._ms(n, c), 0.0)
                    out.append((extra / saved, -saved, n, a))
        for b, saved in self.saved.items():
            if any(_inside(b, r) for r in self.recompute):
                continue                      # a part of a block recomputed whole
            if b not in self.recompute and saved > 0 and (b, None) not in self.banned:
                ms = (sum(self._ms(n, c) for n, c in self.choice.items() if _inside(n, b)) / 3
                      + self.leaf_ms.get(b, 0.0))
                out.append((ms / saved, -saved, b, None))
        for h, saved in self.head_bytes.items():
            # the loss takes the head's gradients slice by slice: no time added, none recomputed
            if (h not in self.sliced and (h, SLICED) not in self.banned
                    and _sliceable(self.choice[h])):
                out.append((0.0, -saved, h, SLICED))
        return sorted(out, key=lambda m: m[:3])

    def take(self, target, most=None):
        """Takes the best moves until their bytes reach ``target`` (or ``most`` moves are
        taken); (units changed, blocks recomputed, bytes predicted). ``self.taken`` lists the
        moves as (unit, candidate), (block, None) or (head, SLICED)."""
        changed, new_blocks, got = {}, [], 0
        self.taken = []
        while got < target and (most is None or len(self.taken) < most):
            moves = self.moves()
            if not moves:
                break
            _, minus_saved, n, a = moves[0]
            self.taken.append((n, a))
            got -= minus_saved
            if a == SLICED:
                self.sliced.append(n)
                c = self.choice[n]
                if _candidates.saved(c):          # its input is kept whole for the loss
                    self._move(n, _up(self.measured[n], c), changed)
                continue
            if a is None:
                new_blocks.append(n)
                self.recompute_block(n, changed)
                continue
            self._move(n, a, changed)
        return changed, new_blocks, got

    def recompute_block(self, b, changed):
        """Block ``b`` recomputed, in place of its parts recomputed before (nothing where a
        block holding it is); its modules' 8-bit codes dropped (into ``changed``): nothing
        inside is saved, a code would only add a copy."""
        if any(_inside(b, r) for r in self.recompute):
            return
        self.recompute = [r for r in self.recompute if not _inside(r, b)] + [b]
        for u, c in self.choice.items():
            if _inside(u, b) and _candidates.saved(c):
                self._move(u, _up(self.measured[u], c), changed)

    def _move(self, n, a, changed):
        for k in self.limits:
            self.totals[k] += (_err(self.measured[n][a], k) ** 2
                               - _err(self.measured[n][self.choice[n]], k) ** 2)
        self.choice[n] = changed[n] = a


def _up(options, choice):
    """The first candidate one step up from ``choice`` and on (``raise_to``) that keeps its
    saved tensors as they are and was measured without error for the unit (``options``: its
    figures by candidate); ``choice`` itself where none is."""
    c = choice
    while True:
        if not _candidates.saved(c) and c in options and not options[c].get("error"):
            return c
        up = _candidates.get(c).raise_to
        if up == c:
            return choice
        c = up


def _sliceable(choice, sliced=False):
    """Whether a head at ``choice`` can defer its logits: an fp8 head is another Linear
    (ampc.memory.sliced_head takes torch's). A head sliced already does not move to 8-bit
    saved tensors either: the loss keeps its input whole, a code would only add a copy."""
    return not _candidates.fp8_linear(choice) and not (sliced and _candidates.saved(choice))


def _block_saved(rep, names):
    """{block: bytes its modules saved for the backward} in the measured step."""
    return {b: sum(v for k, v in rep.saved.items()
                   if k == "model." + b or _inside(k, "model." + b)) for b in names}


def fit(plan, model, batches, loss_fn, measured, rejected, budget, peak_bytes, optimizer):
    """Lowers the plan's units, and recomputes blocks, until its step's peak measures under
    ``peak_bytes`` (or nothing is left to do); the figures go to ``plan.peak``."""
    batch = batches[0]
    usable = {n: [c for c in opts if c not in rejected.get(n, {}) and not opts[c].get("error")]
              for n, opts in measured.items()}
    units = [u.module for u in plan]
    names = recompute_candidates(model, units)
    head_bytes = heads(model, batch, units)
    fp32_peak = step_peak(model, _all_fp32(plan), batch, loss_fn, optimizer).peak
    rep = step_peak(model, plan, batch, loss_fn, optimizer)
    first, rounds, scale = rep.peak, 0, 1.0   # scale: bytes the step saved per byte predicted
    # first the moves that cost little time and no error: freed gradients, the state, the head
    rep = free_moves(plan, model, batch, loss_fn, optimizer, rep, stop=peak_bytes,
                         head_bytes=head_bytes)
    unlowered = _snapshot(plan)
    # the leaves timed only where the lowering has work (two forwards of the model)
    leaf = LeafCosts(model, plan, batch, leaves(model, units) if rep.peak > peak_bytes else [])
    banned, most = set(), None
    while rep.peak > peak_bytes and rounds < ROUNDS:
        lowering = _Lowering(plan, usable, measured, budget, recomputed(plan),
                             leaf.saved(rep, names), banned, head_bytes, leaf.ms)
        before = _snapshot(plan)
        changed, new_blocks, predicted = lowering.take((rep.peak - peak_bytes) / scale, most)
        if not lowering.taken:
            break
        for n, c in changed.items():
            plan.set_choice(n, c, Reason.PEAK)
        if new_blocks:
            plan.set_step(recompute=lowering.recompute)
        new_heads = [h for h in lowering.sliced if h not in before[2]]
        if new_heads:
            plan.set_step(sliced_head=lowering.sliced, why={
                **plan.step.why, **{f"sliced head {h}": "taken by the budget's lowering"
                                    for h in new_heads}})
        rounds += 1
        new = step_peak(model, plan, batch, loss_fn, optimizer)
        if new.peak >= rep.peak:
            # the step did not fall (a bf16 copy held beside the fp32 tensor it came from
            # adds bytes): the round is undone; tried again with half its moves, the best
            # first, until one move alone is found not to save, and that one is not tried again
            _undo(plan, before)
            if len(lowering.taken) > 1:
                most = len(lowering.taken) // 2
            else:
                banned |= set(lowering.taken)
                most = None
            continue
        most = None
        if predicted > 0:
            scale = min(1.0, max(0.05, (rep.peak - new.peak) / predicted))
        rep = new
    if rep.peak > peak_bytes and not plan.step.grads_freed:
        # a move left for the fastest plan may be open now (its fp16 modules lowered to
        # bf16 or fp32 need no loss scaler): tried again
        rep = free_moves(plan, model, batch, loss_fn, optimizer, rep, stop=peak_bytes,
                         head_bytes=head_bytes)
    if rep.peak > peak_bytes:
        rep = split_batch(plan, model, batch, loss_fn, optimizer, rep, peak_bytes)
        if rep.peak > peak_bytes and plan.step.micro_batches > 1:
            # the split moved the peak (smaller activations, the gradients kept): a move
            # left before may lower it now
            rep = free_moves(plan, model, batch, loss_fn, optimizer, rep, stop=peak_bytes,
                             head_bytes=head_bytes)
    if rep.peak <= peak_bytes:
        rep = drop_unneeded(plan, model, batch, loss_fn, optimizer, rep, peak_bytes,
                            unlowered[0], leaf.ms)
    plan.set_peak(_step.Peak(int(peak_bytes), fp32_peak, first, rep.peak, rounds,
                             by_kind=rep.by_kind()))


def drop_unneeded(plan, model, batch, loss_fn, optimizer, rep, peak_bytes, before,
                  leaf_ms=None):
    """The budget met: each move that costs time undone where the step stays under the budget
    without it, the step measured each time, its forward first (most undone moves go over in
    the forward, and then the backward is not run; the lowering takes moves by predicted bytes: a
    move taken early may be needed no more once a later one saved more, and a block
    recomputed saves nothing where the peak is another block's recomputation). Micro-batches,
    the split taken last, are halved first while the step stays under the budget (a move
    taken after the split may have made it needless). Then, the costliest first by the
    units' measured times (a move undone can leave no room to undo another): each block
    recomputed (about a third of its units' forward + backward, the later first on a tie);
    the units lowered for the budget, together, back to their records in ``before``; the
    modules whose saved activations are in 8 bits, together, uncoded. Last, the moves that
    cost little time: the gradients freed; each sliced head. Returns the report of the step
    as it stands."""
    why = dict(plan.step.why)

    def attempt(name, units=(), said="dropped: the step stays under the budget without it",
                **without):
        """Undoes a move (``without``: the step's fields as they were before it; ``units``:
        records to put back) and keeps it undone where the step stays under the budget;
        returns whether it did."""
        nonlocal rep
        step, now = plan.step, [plan.unit(u.module) for u in units]
        plan.set_step(**without)
        for u in units:
            plan.set_choice(u.module, u.choice, u.reason)
        try:
            new = step_peak(model, plan, batch, loss_fn, optimizer, peak_bytes)
        except Exception:          # noqa: BLE001 (the move stays: it was measured with it)
            new = None
        if new is not None and new.peak <= peak_bytes:
            why[name] = f"{said} ({rep.peak / MiB:.1f} -> {new.peak / MiB:.1f} MiB)"
            rep = new
            return True
        plan.set_step(**{k: getattr(step, k) for k in without})
        for u in now:
            plan.set_choice(u.module, u.choice, u.reason)
        return False

    while plan.step.micro_batches > 1:
        k = plan.step.micro_batches // 2
        if not attempt("micro-batches", micro_batches=k, said=(
                f"taken: {k}, fewer than the split took: the step stays under the budget "
                f"with {k}" if k > 1 else "dropped: the step stays under the budget whole")):
            break
    # the units lowered for the budget, as they stand now (one uncoded since is not one)
    now = {n: plan.unit(n).choice for n, u in before.items() if plan.unit(n).choice != u.choice}

    def lowered():
        return [before[n] for n, c in now.items() if plan.unit(n).choice == c
                and not any(_inside(n, b) for b in recomputed(plan))]

    def uncoded():
        # saved activations in 8 bits that the fastest plan took (a tie in the units' times)
        # or the lowering left: each code costs an encode and a decode a step
        coded = [u for u in plan.every_unit if _candidates.saved(u.choice)
                 and not any(_inside(u.module, b) for b in recomputed(plan))]
        out = [replace(u, choice=_up(u.options, u.choice), reason=Reason.PEAK) for u in coded]
        return [u for u, c in zip(out, coded) if u.choice != c.choice]

    def undo_units(name, units, said="dropped: the step stays under the budget without it"):
        if units:
            attempt(name.format(len(units)), units=units, said=said)

    def undo_block(b):
        if b in recomputed(plan):
            attempt(f"recompute {b}", recompute=[x for x in recomputed(plan) if x != b])

    costly = [(_block_ms(plan, b) + (leaf_ms or {}).get(b, 0.0), i,
               functools.partial(undo_block, b))
              for i, b in enumerate(recomputed(plan))]
    costly.append((_units_ms(plan, lowered()), -1, lambda: undo_units(
        "{} module(s) lowered", lowered())))
    costly.append((_units_ms(plan, uncoded()), -2, lambda: undo_units(
        "{} module(s)' saved activations in 8 bits", uncoded(),
        said="dropped: kept as they are, the step stays under the budget")))
    for _, _, undo in sorted(costly, key=lambda c: c[:2], reverse=True):
        undo()
    if plan.step.grads_freed:
        attempt("grads freed", grads_freed=False)
    for h in sliced(plan):
        attempt(f"sliced head {h}", sliced_head=[x for x in sliced(plan) if x != h])
    plan.set_step(why=why)
    return rep


def _block_ms(plan, b):
    """A block's recomputation, predicted as the lowering does: a third of its units'
    forward + backward, at their choices."""
    return sum(u.figures().get("ms") or 0.0 for u in plan.every_unit if _inside(u.module, b)) / 3


def _units_ms(plan, records):
    """Milliseconds a step the units save when put back to ``records``, by their measured
    times (0 where not measured)."""
    return max(sum((plan.unit(r.module).figures().get("ms") or 0.0) - (r.figures().get("ms") or 0.0)
                   for r in records), 0.0)


def split_batch(plan, model, batch, loss_fn, optimizer, rep, stop):
    """Where nothing else fits: the batch as 2, 4, ... micro-batches (at most MAX_MICRO, and
    no more than its examples), their gradients summed (the same update, at the time of
    smaller matmuls), each measured and kept while the peak falls, until it is under
    ``stop``. ``plan.step.why`` says why it was taken or left. Returns the step's report."""
    name, why = "micro-batches", dict(plan.step.why)
    k, first = plan.step.micro_batches, rep.peak
    cannot = why_not_split(model)
    try:
        most = min(batch_size(batch, FN), MAX_MICRO)
    except (TypeError, ValueError) as e:        # no tensor with a batch dimension to cut
        cannot, most = str(e).split(": ", 1)[-1], 1
    if cannot:
        why[name] = f"left: {cannot}"
    while not cannot and rep.peak > stop and 2 * k <= most:
        plan.set_step(micro_batches=2 * k)
        try:
            new = step_peak(model, plan, batch, loss_fn, optimizer)
        except Exception as e:     # noqa: BLE001 (a batch the model cannot take split is left)
            plan.set_step(micro_batches=k)
            why[name] = f"left: the step raised {type(e).__name__}: {str(e).splitlines()[0][:120]}"
            break
        if new.peak >= rep.peak:
            plan.set_step(micro_batches=k)
            why[name] = f"left at {k}: {2 * k} did not lower the peak ({new.peak / MiB:.1f} MiB)"
            break
        k, rep = 2 * k, new
    if k > 1:
        why[name] = (f"taken: {k}, the step's peak {first / MiB:.1f} -> {rep.peak / MiB:.1f} MiB "
                     "(their gradients summed: the same update; plan.backward runs them)")
    elif most < 2 and not cannot:
        why[name] = "left: the batch holds one example"
    plan.set_step(why=why)
    return rep


def _snapshot(plan):
    """What :func:`_undo` puts back: each unit, the blocks, the heads sliced and why."""
    return ({u.module: u for u in plan.every_unit}, recomputed(plan), sliced(plan),
            plan.step.why)


def _undo(plan, before):
    """The plan as it was at :func:`_snapshot`: each unit's choice and reason, the blocks,
    the heads sliced and why."""
    units, rc, heads_before, why = before
    for n, u in units.items():
        if plan.unit(n) != u:
            plan.set_choice(n, u.choice, u.reason)
    plan.set_step(recompute=rc, sliced_head=heads_before, why=why)


def _all_fp32(plan):
    fp32 = copy.deepcopy(plan)
    fp32.set_choices(dict.fromkeys(fp32.decisions, "fp32"), Reason.ALL_FP32)
    fp32.set_step(state="fp32", grads_freed=False, recompute=(), sliced_head=())
    return fp32


def settle(plan, model, batches, loss_fn, optimizer, fitted, report=None):
    """Whether the budget was met, said in the notes (and a warning when it was not); the
    step's peak is ``report``'s (the whole-plan check measured it), else measured again where
    the check changed the choices ``fit`` left (``fitted``): a back-off raises units, and
    bytes with them."""
    d = plan.peak
    rep = report
    if rep is None and plan.decisions != fitted:
        rep = step_peak(model, plan, batches[0], loss_fn, optimizer)
    if rep is not None:
        d = replace(d, bytes=rep.peak, by_kind=rep.by_kind())
    d = replace(d, met=d.bytes <= d.budget)
    plan.set_peak(d)
    rc, step = recomputed(plan), plan.step
    what = (f"peak budget {d.budget / MiB:.1f} MiB: {'met' if d.met else 'NOT met'}, the "
            f"step measured {d.bytes / MiB:.1f} MiB (fp32 {d.fp32 / MiB:.1f} MiB, the "
            f"fastest plan {d.fastest / MiB:.1f} MiB; {d.rounds} round(s) of lowering"
            + (f", {len(rc)} block(s) recomputed" if rc else "")
            + (f", the head's logits sliced ({', '.join(sliced(plan))})" if sliced(plan) else "")
            + (f", the {step.state} state" if step.state != "fp32" else "")
            + (", the gradients freed in the backward" if step.grads_freed else "")
            + (f", the batch in {step.micro_batches} micro-batches (plan.backward runs them)"
               if step.micro_batches > 1 else "")
            + "); plan.prepare(model, ampc.optim.AdamW, ...) makes all of it")
    if not d.met:
        why = ("the whole-plan check raised modules back to hold the error budget"
               if plan.data.get("backoffs") else
               f"the lowering stopped after its {ROUNDS} rounds" if d.rounds >= ROUNDS else
               "no module or block had a choice left that saves bytes within the error budget")
        left = [f"{k} {w}" for k, w in step.why.items() if w.startswith("left")]
        what += f": {why}" + (f" ({'; '.join(left)})" if left else "") + \
            "; a larger budget or a looser error budget"
        warnings.warn(f"{FN}: {what}", stacklevel=3)
    plan.data["notes"].append(what)
