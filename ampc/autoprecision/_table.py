"""The plan as a person reads it: a row per unit, the budget, what was measured, the notes.

By default every line fits WIDTH columns: each unit's choice, its three errors, its time and,
for the candidates it did not take, what was measured against them in a word or two
("slower", "over budget", "out of range"). ``details=True`` gives every candidate's time, the
weight gradients' noise and the reasons in full (wide).
"""
from __future__ import annotations

import math
import textwrap

from . import _candidates, _objectives
from ._solve import OVER_CEILING, clearly_faster, noise_ratio
from ._step import STATES
from ._units import Reason
from ..validate import format_table

WIDTH = 120
CUT = ".."          # marks a cell cut to fit (ASCII: any terminal prints it)

# why a unit holds a choice above a candidate that was not ruled out on its own
_HELD = {Reason.BACKED_OFF: ("backed off", "raised: the whole plan was over the budget"),
         Reason.ALL_FP32: ("whole plan fp32", "the whole plan was kept fp32 (see the notes)"),
         Reason.WHOLE_MODEL: ("whole-model time", "the whole model was timed so (see the notes)"),
         Reason.MONITOR: ("monitor", "raised by the monitor during training"),
         Reason.SET: ("set by hand", "set by hand")}


def fmt(v, spec=".1e"):
    if v is None:
        return "-"
    if isinstance(v, float) and not math.isfinite(v):
        return "inf"
    return format(v, spec)


def short(why: str) -> str:
    """What a candidate's rejection measured, in a word or two."""
    if why.startswith(("too slow", OVER_CEILING)):
        return "slower"
    if why.startswith("not measured"):
        return "not measured"
    if "not finite" in why:
        return "out of range"            # fp16's overflow: an infinite error
    if " err " in why:
        return "over budget"
    if why.startswith("saves "):
        return "saves little"            # the loss kept fp32 (see _loss.keep_fp32)
    return "fails"                       # it raised (does not run here)


def reasons(plan, u) -> dict[str, tuple[str, str]]:
    """{candidate: (short, full)} of why ``u`` did not take it: each rejected candidate, and
    each candidate using fewer bytes than its choice that was not rejected (the solver's
    summed budget, time, a back-off or a whole-model decision took it away)."""
    out = {c: (short(w), w) for c, w in u.rejected.items()}
    mine = u.figures()
    for c, r in u.options.items():
        if c == u.choice or c in out or (r.get("bytes") or 0) >= (mine.get("bytes") or 0):
            continue
        if u.reason in _HELD:
            out[c] = _HELD[u.reason]
        elif plan.peak is not None:
            out[c] = _peak_reason(plan, u)
        elif (_objectives.get(plan.data["objective"]).by_speed and r.get("ms") and mine.get("ms")
              and clearly_faster(mine["ms"], r["ms"])):
            out[c] = ("slower", f"slower: {r['ms']:.2f} ms against {mine['ms']:.2f} at "
                                f"{u.choice}")
        else:
            out[c] = ("over budget", "over the summed budget: the units' errors together "
                                     "were over it, and raising this one bought the most")
    return out


def _peak_reason(plan, u):
    """Why a unit of a plan whose step's peak was measured did not take fewer bytes."""
    if u.module.startswith(tuple(b + "." for b in plan.step.recompute)):
        return ("recomputed", "its block is recomputed in the backward: it saves nothing")
    if plan.peak.met is not False:
        return ("not needed", "the step's peak fit the byte budget without it")
    return ("not taken", "the budget's lowering did not take it: tried, it did not lower the "
                         "step's peak, or the lowering's rounds ran out")


def _grouped(why):
    """'bf16, fp16 slower; fp8 fails' from {candidate: (short, full)}."""
    groups = {}
    for c, (s, _) in why.items():
        groups.setdefault(s, []).append(c)
    return "; ".join(f"{', '.join(cs)} {s}" for s, cs in groups.items()) or "-"


def _cut(text, width, keep_end=False):
    if len(text) <= width:
        return text
    return CUT + text[len(text) - width + len(CUT):] if keep_end else text[:width - len(CUT)] + CUT


def _fit_name(name, width):
    """A module's path within ``width``: its parts from the left cut to their first letter
    and trailing digits ("encoder.layers.encoder_layer_0.mlp" -> "e.l.e0.mlp"), the last
    part whole, until it fits; then its start cut. An encoder and a decoder stay apart."""
    parts = name.split(".")
    for i in range(len(parts) - 1):
        if len(".".join(parts)) <= width:
            break
        p = parts[i]
        if not p.isdigit():
            parts[i] = p[0] + p[len(p.rstrip("0123456789")):]
    return _cut(".".join(parts), width, keep_end=True)


def _narrow(plan):
    """Columns separated by two spaces, text left and figures right, at most WIDTH wide:
    long module names shortened (:func:`_fit_name`), long types and reasons keep their
    start."""
    header = ["module", "type", "choice", "loss err", "dgrad err", "wgrad err", "ms",
              "why not lower"]
    rows = []
    for u in plan.every_unit:
        r = u.figures()
        rows.append([u.module, u.type, u.choice, fmt(r.get("loss_err")), fmt(r.get("dgrad_err")),
                     fmt(r.get("wgrad_err")), fmt(r.get("ms"), ".2f"), _grouped(reasons(plan, u))])
    cells = [header] + rows
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    widths[1] = min(widths[1], 18)
    # over WIDTH: the module names give up to a floor of 28, then the reasons
    over = sum(widths) + 2 * (len(header) - 1) - WIDTH
    widths[0] -= max(0, min(over, widths[0] - 28))
    over = sum(widths) + 2 * (len(header) - 1) - WIDTH
    widths[-1] = max(len(header[-1]), widths[-1] - max(0, over))
    left = {0, 1, 7}
    lines = []
    for row in cells:
        parts = []
        for i, (cell, w) in enumerate(zip(row, widths)):
            cell = _fit_name(cell, w) if i == 0 else _cut(cell, w)
            parts.append(cell.ljust(w) if i in left else cell.rjust(w))
        lines.append("  ".join(parts).rstrip())
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _wide(plan):
    """Every figure and every reason in full: one line per unit, as wide as it takes."""
    cands = plan.data["candidates"]
    header = (["module", "type", "choice", "loss err", "dgrad err", "wgrad err", "wgrad noise",
               "err/noise"] + [f"ms {c}" for c in cands] + ["why not lower"])
    rows = []
    for u in plan.every_unit:
        r = u.figures()
        times = [fmt(u.options[c].get("ms"), ".2f") if c in u.options else "n/a" for c in cands]
        why = "; ".join(f"{c}: {full}" for c, (_, full) in reasons(plan, u).items())
        rows.append([u.module, u.type, u.choice, fmt(r.get("loss_err")), fmt(r.get("dgrad_err")),
                     fmt(r.get("wgrad_err")), fmt(r.get("wgrad_noise")),
                     fmt(noise_ratio(r, "wgrad_err"))] + times + [why or "-"])
    return format_table(header, rows)


def _ceiling_line(plan):
    """What the memory objective's time ceiling ruled out, or None where none was in force."""
    ceiling = plan.data.get("ceiling")
    if ceiling is None:
        return None
    counts = {}
    for u in plan.every_unit:
        for c, why in u.rejected.items():
            if short(why) == "slower":
                counts[c] = counts.get(c, 0) + 1
    ruled = ", ".join(f"{c} for {n} module(s)" for c, n in counts.items()) or "nothing"
    return (f"time ceiling {ceiling:g}x: no module slower than {ceiling:g}x its fastest candidate "
            f"within the budget, no step slower than {ceiling:g}x fp32's; it ruled out {ruled} "
            f"(\"slower\")")


def state_line(plan):
    """The weights, the optimizer's state and the gradients: what the plan keeps, in bytes a
    parameter, and why it took or left each whole-step move."""
    step = plan.step
    _, w, st, g = STATES[step.state]
    line = (f"state {step.state}: weights {w:g} + optimizer state {st:g} + grads "
            + ("0 (freed in the backward)" if step.grads_freed and step.micro_batches == 1
               else f"{g:g}")
            + f" = {step.bytes_per_param():.2f} B a parameter"
            + (f"; the batch in {step.micro_batches} micro-batches (plan.backward runs them)"
               if step.micro_batches > 1 else ""))
    if step.why:
        line += "; " + "; ".join(f"{k}: {v}" for k, v in step.why.items())
    return line


def peak_line(plan):
    """The step's peak by kind, where a byte budget measured it."""
    p = plan.peak
    if p is None:
        return None
    parts = ", ".join(f"{k} {v / 2 ** 20:.1f}" for k, v in p.by_kind.items())
    return (f"step peak {p.bytes / 2 ** 20:.1f} MiB ({p.bytes / p.fp32:.2f}x fp32's "
            f"{p.fp32 / 2 ** 20:.1f})" + (f": {parts} MiB" if parts else ""))


def coded(plan):
    """The units that keep their saved activations in fewer bits."""
    return [u.module for u in plan.every_unit if _candidates.saved(u.choice)]


def all_fp32(plan):
    return plan.dtype == "fp32" and not coded(plan)


def saving(plan, times):
    """The plan's time against fp32's; an all-fp32 plan is fp32 and saves nothing (two
    timings of the same thing differ only by noise)."""
    if all_fp32(plan):
        return f"fp32 {times['fp32_ms']:.2f} ms per step; every module runs fp32: nothing saved"
    diff = times["fp32_ms"] - times["plan_ms"]
    return (f"fp32 {times['fp32_ms']:.2f} ms, plan {times['plan_ms']:.2f} ms, "
            + (f"saving {diff:.2f} ms per step" if diff >= 0 else
               f"{-diff:.2f} ms slower per step"))


def search_cost(plan):
    """What the search cost beside what it saves a step: the steps that repay it at the
    whole-model saving measured (none without one)."""
    d = plan.data
    if d.get("search_s") is None:
        return ""
    line = f"search took {d['search_s']:.1f} s"
    m = d.get("measured")
    if not m or all_fp32(plan):
        return line
    saved = m["fp32_ms"] - m["plan_ms"]
    if saved <= 0:
        return line + ": the plan saves no time a step against fp32 (measured)"
    sliced = d.get("examples")       # (examples measured, examples a batch)
    how = "measured"
    if sliced:
        saved *= sliced[1] / sliced[0]
        how = f"measured on {sliced[0]} examples, scaled to {sliced[1]}"
    return (line + f", repaid after {math.ceil(1e3 * d['search_s'] / saved):,} steps at the "
            f"{saved:.2f} ms a step it saves against fp32 ({how})")


def render(plan, details=False):
    d = plan.data
    b = d["budget"]
    lines = [f"ampc.autoprecision plan: {len(plan.units)} modules on {d['device']} "
             f"({d.get('where', '')}), objective {d['objective']}, region {plan.dtype}, "
             f"ops outside these modules {plan.rest}",
             f"budget per step: loss {b['loss']:g}, grad {b['grad']:g}, wgrad {b['wgrad']:g} "
             f"(relative to fp32), gradients also within {plan.budget.noise_fraction:g} of "
             f"fp32's batch-to-batch spread"]
    tail = []
    if not details:
        tail.append("errors: relative to fp32's, one step; ms: forward + backward at the "
                    "choice; every candidate's time and the reasons in full: "
                    "plan.table(details=True)")
    tail.append(_ceiling_line(plan))
    tail += [state_line(plan), peak_line(plan)]
    for what, names in (("saved activations in 8 bits (ampc.memory.compress)", coded(plan)),
                        ("recomputed in the backward (ampc.memory.recompute)",
                         plan.step.recompute),
                        ("logits made in the loss a slice at a time (ampc.memory.sliced_head)",
                         plan.step.sliced_head)):
        if names:
            tail.append(f"{what}: {len(names)} module(s), "
                        + ", ".join(names[:4]) + (", ..." if len(names) > 4 else ""))
    pred = d.get("predicted") or {}
    if pred:
        tail.append(f"predicted (sum over modules, forward + backward): {saving(plan, pred)}")
    m = d.get("measured")
    if m:
        tail.append(f"measured (whole model, forward + backward): {saving(plan, m)}; "
                    f"loss err {fmt(m['loss_err'])}, grad err {fmt(m['grad_err'])} (fp32's "
                    f"batch-to-batch spread {fmt(m.get('grad_noise'))}), worst wgrad err "
                    f"{fmt(m['wgrad_err'])} ({m['wgrad_worst'] or '-'})")
    for step in d.get("backoffs", []):
        tail.append(f"backed off: {step['module']} {step['from']} -> {step['to']} "
                    f"({step['why']})")
    tail += [f"note: {n}" for n in d.get("notes", [])]
    tail.append(search_cost(plan))
    table = _wide(plan) if details else _narrow(plan)
    return "\n".join(_wrap(lines) + [table] + _wrap(t for t in tail if t))


def _wrap(lines):
    return [textwrap.fill(t, WIDTH, subsequent_indent="  ", break_on_hyphens=False)
            for t in lines]
