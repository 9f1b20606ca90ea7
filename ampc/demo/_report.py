"""What the demo prints and writes: the plan's choices, the table of runs, the files."""
from __future__ import annotations  # "X | None" hints on Python 3.9 too; none evaluated at import

import os
from collections import Counter

from ampc.lean_state import state_bytes
from ampc._outputs import NO_MATPLOTLIB, fmt, format_table, write_outputs

LABELS = {"fp32": "fp32", "torch.amp": "torch.amp", "ampc": "ampc drop-in",
          "ampc.master": "ampc master weights", "ampc.auto": "ampc auto",
          "ampc.memory": "ampc memory", "ampc.lean": "ampc lean"}
HEADER = ["setup", "tokens/s", "step ms", "peak MiB", "state B/param", "train loss", "val loss",
          "speed vs torch.amp", "memory vs torch.amp"]


def _counts(plan):
    """How many modules the plan puts at each choice: "2 bf16, 12 fp32"."""
    return ", ".join(f"{n} {c}" for c, n in sorted(Counter(plan.choices.values()).items()))


def describe_plan(plan, search_s, dname, ratio, log):
    """A few lines on what ampc.autoprecision chose here and why."""
    m = plan.data.get("measured") or {}
    log(f"ampc.autoprecision: {len(plan.units)} modules in {search_s:.1f} s: {_counts(plan)}"
        + f"; ops outside them {plan.rest}"
        + (f"; the loss {plan.loss_unit.choice}" if plan.loss_unit is not None else "")
        + (f"; whole model forward + backward {m['plan_ms']:.0f} ms against fp32's "
           f"{m['fp32_ms']:.0f} ms" if m else ""))
    for note in plan.data.get("notes", []):
        log(f"  {note}")
    fp32 = [u for u in plan.units if u["choice"] == "fp32"]
    for reason, match in (("for accuracy", lambda w: " err " in w or "not finite" in w),
                          ("for speed", lambda w: w.startswith("too slow"))):
        kept = [u for u in fp32 if any(match(w) for w in u["rejected"].values())]
        if kept:
            u = kept[0]
            why = "; ".join(f"{c}: {w}" for c, w in u["rejected"].items() if match(w))
            log(f"  kept in fp32 {reason}: {len(kept)} modules, e.g. {u['module']} ({why})")
    if set(plan.choices.values()) == {"fp32"}:
        log(f"  {dname} matmuls run {1 / ratio:.0f}x slower than fp32 here" if ratio < 1 else
            f"  no 16-bit choice measured faster here")
        log("  so the plan keeps every module in fp32: the auto arm trains at fp32's speed "
            "with fp32's accuracy, where the uniform 16-bit arms pay for slow matmuls")


def describe_memory_plan(plan, amp_peak, fraction, search_s, log):
    """A few lines on the plan searched for memory: the peak asked for and the peak
    measured, against torch.amp's step, and how it got there."""
    d, mib, step = plan.peak, 2 ** 20, plan.step
    log(f"ampc.autoprecision, objective=\"memory\": a step's peak asked at {fraction:g}x "
        f"torch.amp's ({amp_peak / mib:.1f} MiB of tensors), "
        + ("met" if d.met else "not met") + f" at {d.bytes / mib:.1f} MiB "
        f"({d.bytes / amp_peak:.2f}x torch.amp's) in {search_s:.1f} s: {_counts(plan)}"
        + (f"; {len(step.recompute)} block(s) recomputed" if step.recompute else "")
        + ("; the head's logits sliced" if step.sliced_head else "")
        + (f"; the {step.state} state" if step.state != "fp32" else "")
        + ("; gradients freed in the backward" if step.grads_freed else ""))
    why = next((n for n in plan.data.get("notes", []) if n.startswith("peak budget")), None)
    if why and not d.met:
        log(f"  {why}")


def result_rows(report, tokens):
    """One row a run: throughput, step time, memory, state bytes a parameter and losses,
    against torch.amp's run. State bytes: the weights, grads and optimizer state the trained
    run holds, measured from its tensors (ampc.lean_state.state_bytes). The auto arm's
    search is a cost paid once, not a step's: ``search_payback`` weighs it."""
    amp = next(r for r in report.runs if r.kind == "torch.amp")
    amp_tps = tokens / (amp.median_ms() / 1e3)
    rows = []
    for r in [report.base] + report.runs:
        ms = r.median_ms()
        tps = tokens / (ms / 1e3)
        rows.append({"kind": r.kind,
                     "setup": LABELS[r.kind] + ("" if r.kind == "fp32" else f" {r.dtype}"),
                     "tokens_per_s": tps, "step_ms": ms, "peak_mib": r.peak_mib,
                     "state_bytes_per_param": state_bytes(r.model, r.optimizer)["total_per_param"],
                     "train_loss": sum(r.losses[-report.window:]) / report.window,
                     "val_loss": r.val_loss, "speed_vs_torch_amp": tps / amp_tps,
                     "memory_vs_torch_amp": (r.peak_mib / amp.peak_mib
                                             if r.peak_mib and amp.peak_mib else None)})
    return rows


def search_payback(rows, search_s, steps, all_fp32):
    """(a line on what the auto arm's search cost against the time its plan saves a step,
    the steps after which it has paid for itself against the faster of fp32 and torch.amp,
    or None where the plan saves nothing). ``all_fp32``: the plan keeps every module in
    fp32, so any step time it saves against fp32 is noise."""
    if all_fp32:
        return (f"ampc auto's search took {search_s:.1f} s and found nothing faster than fp32 "
                "here: its plan is fp32's step (what the search bought is knowing that)"), None
    by_kind = {row["kind"]: row for row in rows}
    auto = by_kind["ampc.auto"]
    best = min(("fp32", "torch.amp"), key=lambda k: by_kind[k]["step_ms"])
    saved = by_kind[best]["step_ms"] - auto["step_ms"]
    if saved <= 0:
        return (f"ampc auto's search took {search_s:.1f} s and its plan's step is no faster "
                f"than {best}'s here ({auto['step_ms']:.1f} against "
                f"{by_kind[best]['step_ms']:.1f} ms): the search does not pay for itself on "
                "this machine and model"), None
    payback = int(1e3 * search_s / saved) + 1
    return (f"ampc auto's search took {search_s:.1f} s; its plan saves {saved:.1f} ms a step "
            f"against {best} (the faster of fp32 and torch.amp), so it has paid for itself "
            f"after {payback:,} steps (this demo trains {steps})"), payback


def results_table(rows):
    return format_table(HEADER, [
        [row["setup"], f"{row['tokens_per_s']:,.0f}", f"{row['step_ms']:.1f}",
         fmt(row["peak_mib"], ".1f"), f"{row['state_bytes_per_param']:.2f}",
         f"{row['train_loss']:.4f}", fmt(row["val_loss"]),
         f"{row['speed_vs_torch_amp']:.2f}x", fmt(row["memory_vs_torch_amp"], ".2f")]
        for row in rows])


def write_all(out, lines, data, report, layer_report, plans, log):
    """OUT/demo.{txt,json,png}, OUT/layers.*, OUT/NAME.{json,txt} of each plan in
    ``plans`` ({NAME: plan}), and where they went."""
    throughput = {row["setup"]: row["tokens_per_s"] for row in data["table"]}
    paths = write_outputs(out, "demo", "\n".join(lines), data,
                          lambda plt, path: report.plot(plt, path, throughput,
                                                        data.get("peak_by_kind")))
    layer_paths = layer_report.save(out)
    written = []
    for name, plan in plans.items():
        written += [plan.save(os.path.join(out, f"{name}.json")), os.path.join(out, f"{name}.txt")]
        with open(written[-1], "w") as f:
            f.write(plan.table() + "\n\n" + plan.python() + "\n")
    log()
    if paths["png"]:
        log(f"picture: {os.path.abspath(paths['png'])} (loss curves, gap to fp32, "
            "grad-norm ratio, throughput, a step's peak by kind)")
    else:
        log(NO_MATPLOTLIB)
    log(f"wrote {paths['txt']}, {paths['json']}, {layer_paths['txt']}, {layer_paths['json']}, "
        + ", ".join(written) + (f", {layer_paths['png']}" if layer_paths["png"] else ""))
