"""The memory objective without a byte budget: the whole-step moves that lower the step's
peak, then blocks recomputed in the time the objective's ceiling leaves, the step measured."""
from __future__ import annotations

import math

from . import _step
from ._apply import recomputed
from ._peak import (LeafCosts, _Lowering, _all_fp32, _inside, _snapshot, _undo, free_moves,
                    leaves, recompute_candidates)
from ._step_peak import MiB, step_peak
from ._units import Reason


def whole_step(plan, model, batches, loss_fn, optimizer, measured, budget, room_ms):
    """Without a byte budget (the memory objective): the moves that cost little time
    (:func:`free_moves`) taken where the step's peak falls by 1% or more, then blocks
    recomputed in the ``room_ms`` a step the time ceiling leaves
    (:func:`recompute_in_room`), and the peak measured, by kind."""
    batch = batches[0]
    fp32_peak = step_peak(model, _all_fp32(plan), batch, loss_fn, optimizer).peak
    rep = step_peak(model, plan, batch, loss_fn, optimizer)
    first = rep.peak
    rep = free_moves(plan, model, batch, loss_fn, optimizer, rep)
    rep = recompute_in_room(plan, model, batch, loss_fn, optimizer, measured, budget, rep,
                            max(room_ms, 0.0))
    plan.set_peak(_step.Peak(None, fp32_peak, first, rep.peak, by_kind=rep.by_kind()))


def room(plan, ceiling):
    """Milliseconds a step may still add under the memory objective's ceiling on a step's
    slowdown (``ceiling`` x the sum of each unit's fastest measured time), by the units'
    figures; infinite without a ceiling."""
    if ceiling is None:
        return math.inf
    fastest = sum(min((o["ms"] for o in u.options.values() if o.get("ms")), default=0.0)
                  for u in plan.every_unit)
    now = sum(u.figures().get("ms") or 0.0 for u in plan.every_unit)
    return ceiling * fastest - now


def recompute_in_room(plan, model, batch, loss_fn, optimizer, measured, budget, rep, room_ms):
    """Blocks, or their parts (a layer's attention, its MLP), recomputed, most bytes saved for
    the least time first, while their predicted time (a third of their units' forward +
    backward) fits ``room_ms``; a layer and its parts are alternatives, the first ranked is
    taken; the step measured and the blocks kept only where its peak falls
    (``plan.step.why["recompute"]`` says which)."""
    units = [u.module for u in plan]
    names = recompute_candidates(model, units)
    leaf = LeafCosts(model, plan, batch, leaves(model, units))
    low = _Lowering(plan, {n: [c] for n, c in plan.decisions.items()}, measured, budget,
                    recomputed(plan), leaf.saved(rep, names), leaf_ms=leaf.ms)
    before = _snapshot(plan)
    changed, spent, taken = {}, 0.0, []
    for cost_per_byte, minus_saved, b, a in low.moves():
        cost = cost_per_byte * -minus_saved
        if a is not None or spent + cost > room_ms:
            continue
        if any(_inside(b, r) or _inside(r, b) for r in low.recompute):
            continue
        spent += cost
        taken.append(b)
        low.recompute_block(b, changed)
    if not taken:
        plan.set_step(why={**plan.step.why, "recompute": (
            f"left: no block's recomputation fits the {room_ms:.1f} ms a step the ceiling "
            "leaves" if names else "left: no block of two units or more to recompute")})
        return rep
    for n, c in changed.items():
        plan.set_choice(n, c, Reason.PEAK)
    plan.set_step(recompute=low.recompute)
    new = step_peak(model, plan, batch, loss_fn, optimizer)
    if new.peak < rep.peak:
        plan.set_step(why={**plan.step.why, "recompute": (
            f"taken: {len(taken)} block(s), about {spent:.1f} ms a step of the {room_ms:.1f} "
            f"the ceiling leaves; the step's peak {rep.peak / MiB:.1f} -> {new.peak / MiB:.1f} MiB")})
        return new
    _undo(plan, before)
    plan.set_step(why={**plan.step.why, "recompute": (
        f"left: {len(taken)} block(s) recomputed did not lower the step's peak "
        f"({new.peak / MiB:.1f} MiB)")})
    return rep
