"""What compare() and layers() hand back: a plain-text table, a JSON file and a PNG.

matplotlib is optional: without it ``save`` says so and writes the table and JSON only.
"""
from __future__ import annotations  # "X | None" hints on Python 3.9 too; none evaluated at import

import math
import statistics
import warnings
from collections.abc import Sequence
from typing import Any

from ._run import (TAIL, Run, _finite, mean_interval, rel_gap, smooth, t95, tail_gap,
                   tail_spread)


from .._outputs import fmt, format_table, write_outputs


# Above this, fp32's own run-to-run spread is too wide to judge a setup by its point
# estimate alone: a broken mixed-precision run (a sound one ends within about 1% of fp32)
# would still pass. Short runs of small-batch models (20 steps of ResNet-18: 20%) give such
# spreads; there only an interval of paired gaps that clears it decides.
MAX_SPREAD = 0.05
# A setup trained from one seed is judged against one fp32 pair's difference: two draws of
# about the same size when the setup is sound, so a gap just past the spread says nothing
# (a sound setup lands there half the time). Past this many spreads it is called outside
# (a sound setup lands there about one time in five; a broken one, at 1-10% against a
# spread of tenths of a percent, lands far beyond); in between it is "unsure".
ONE_SEED_FACTOR = 3.0


def verdict_word(row: dict[str, Any], yes: str = "yes", no: str = "NO") -> str:
    """A row's verdict in a word: ``yes``, ``no``, or why none ("unsure: 1 seed", "spread too
    wide", "-" without a spread)."""
    if row["within_spread"] is not None:
        return yes if row["within_spread"] else no
    return {"no spread": "-", "one seed": "unsure: 1 seed"}.get(row["undecided"], row["undecided"])


class Comparison:
    """The runs of :func:`ampc.validate.compare` and how each one compares with fp32.

    The verdict's statistic is a setup's ``gap``: the mean, over the last ``TAIL`` (25%) of
    the steps, of its loss minus fp32's at each step, relative to fp32's loss there, taken
    between the two runs of one seed (same weights, same batches, so that batch-to-batch
    and init-to-init differences cancel) and averaged over the seeds the setup trained
    from, with a 95% interval when there are two or more. ``fp32 spread``: between fp32
    from the first seed and from each other seed (the largest), the larger of that
    statistic and the RMS of their smoothed curves' relative difference over the same steps
    (curves that cross can have a mean difference near 0 by chance). A
    setup is ``within`` when its interval lies inside the spread (capped at ``MAX_SPREAD``),
    outside (``NO``) when it lies beyond; otherwise its gap decides against the spread,
    unless the spread is over ``MAX_SPREAD``: then the verdict reads "spread too wide"
    (``within_spread`` None), a warning says what to change, and :meth:`ok` holds the setup
    to MAX_SPREAD. A setup from one seed whose gap is past the spread but within
    ``ONE_SEED_FACTOR`` spreads is "unsure" (None, ``undecided`` "one seed"): train it
    from more seeds (``paired=True``) to decide. ``final gap`` and ``max gap`` (the curves smoothed over a tenth of the
    run) are shown beside it.
    """

    def __init__(self, base: Run, runs: list[Run], spread_runs: list[Run], config: dict[str, Any],
                 paired_runs: list[list[Run]] | None = None) -> None:
        self.base, self.runs, self.spread_runs, self.config = base, runs, spread_runs, config
        # per setup, its runs from fp32's other seeds (none: judged on the first seed only)
        self.paired_runs = paired_runs or [[] for _ in runs]
        self.window = max(1, len(base.losses) // 10)
        self.fp32 = {r.seed: r for r in spread_runs}    # a paired run's partner, by seed
        self.spread = None
        if spread_runs:
            self.spread = max(tail_spread(r.losses, base.losses, self.window)
                              for r in spread_runs)
        self.rows = [self._row(r, p) for r, p in zip(runs, self.paired_runs)]
        undecided = [r for r in self.rows if r["undecided"] == "spread too wide"]
        self.too_wide = bool(undecided)
        self.advice = self._advice(undecided) if undecided else None
        if self.too_wide:
            warnings.warn(f"ampc.validate.compare: fp32's run-to-run spread is "
                          f"{100 * self.spread:.1f}%, over the {100 * MAX_SPREAD:g}% within "
                          "which it tells a sound setup from a broken one, and the gap paired "
                          "per seed does not decide for "
                          + ", ".join(r["setup"] for r in undecided) + ": " + self.advice,
                          stacklevel=3)

    def _row(self, run, paired):
        ref = smooth(self.base.losses, self.window)
        gap = rel_gap(smooth(run.losses, self.window), ref)
        ratios = [a / b for a, b, k in zip(run.grad_norms, self.base.grad_norms, range(len(gap)))
                  if _finite(a) and _finite(b) and b > 0 and k not in run.skipped]
        paired_gap, half = mean_interval([tail_gap(run.losses, self.base.losses)] +
                                         [tail_gap(r.losses, self.fp32[r.seed].losses)
                                          for r in paired])
        verdict, why = self._verdict(paired_gap, half)
        val_gap = None
        if _finite(run.val_loss) and _finite(self.base.val_loss):
            val_gap = abs(run.val_loss - self.base.val_loss) / abs(self.base.val_loss)
        return {
            "setup": run.name,
            "final_loss": smooth(run.losses, self.window)[-1],
            "final_gap": gap[-1],
            "max_gap": max(gap),
            "gap": paired_gap,
            "gap_interval": half,
            "seeds_paired": 1 + len(paired),
            "within_spread": verdict,
            "undecided": why,
            "val_loss": run.val_loss,
            "val_gap": val_gap,
            "grad_norm_ratio_median": statistics.median(ratios) if ratios else None,
            "grad_norm_ratio_min": min(ratios) if ratios else None,
            "grad_norm_ratio_max": max(ratios) if ratios else None,
            "skipped_steps": len(run.skipped),
            "step_ms": run.median_ms() if run.step_ms else None,
            "final_scale": run.scales[-1] if run.scales and run.scales[-1] != 1.0 else None,
        }

    def _verdict(self, gap, half):
        """(True: within fp32's spread, False: outside, or None; why None: "no spread",
        "spread too wide" or "one seed")."""
        if self.spread is None:
            return None, "no spread"
        if not math.isfinite(gap):
            return False, None
        bound = min(self.spread, MAX_SPREAD)
        if half is not None and math.isfinite(bound):
            if abs(gap) + half <= bound:
                return True, None
            if abs(gap) - half > bound:
                return False, None
        if self.spread > MAX_SPREAD:
            return None, "spread too wide"
        # the gap itself, where the spread is narrow enough that a broken setup could not
        # end inside it; from one seed, only far past it is outside
        if abs(gap) <= self.spread:
            return True, None
        if half is None and abs(gap) <= ONE_SEED_FACTOR * self.spread:
            return None, "one seed"
        return False, None

    def _advice(self, undecided):
        """What would give a verdict: more seeds (how many, from the interval's width),
        more steps, a lower lr."""
        seeds = len(self.config.get("seeds", ())) or 1
        if any(r["seeds_paired"] < 2 for r in undecided):
            more = (f"train each setup from every seed (paired=True) and from more of them "
                    f"(seeds=tuple(range({max(3, seeds)})))")
        else:
            needs = [_seeds_to_decide(r["gap"], r["gap_interval"], r["seeds_paired"])
                     for r in undecided]
            more = ("more seeds will hardly narrow the interval enough" if None in needs else
                    f"give more seeds (seeds=tuple(range({max(needs)}))) to narrow the interval")
        return (f"{more}; train more steps, so that fp32's seeds converge; or lower lr, "
                "for smoother curves")

    def ok(self) -> bool:
        """True when every setup is judged within fp32's spread; one that cannot be judged is
        held, by its paired gap, to 2% without a spread, else to MAX_SPREAD (a spread too
        wide, or "unsure" from one seed)."""
        limit = 0.02 if self.spread is None else MAX_SPREAD
        return all(r["within_spread"] or (r["within_spread"] is None and _finite(r["gap"])
                                          and abs(r["gap"]) <= limit) for r in self.rows)

    def table(self) -> str:
        """The comparison as plain text: one row per setup against fp32."""
        rows = []
        for r in self.rows:
            within = verdict_word(r)
            gap = fmt(100 * r["gap"], "+.2f")
            if r["gap_interval"] is not None:
                gap += f" +- {fmt(100 * r['gap_interval'], '.2f')}"
            ratio = "-"
            if r["grad_norm_ratio_median"] is not None:
                # one precision for all three: rounding keeps the median inside its range
                ratio = (f"{r['grad_norm_ratio_median']:.3f} ({r['grad_norm_ratio_min']:.3f}"
                         f"-{r['grad_norm_ratio_max']:.3f})")
            rows.append([r["setup"], fmt(r["final_loss"]), fmt(100 * r["final_gap"], ".2f"),
                         fmt(100 * r["max_gap"], ".2f"), gap, r["seeds_paired"], within,
                         fmt(r["val_loss"]),
                         fmt(None if r["val_gap"] is None else 100 * r["val_gap"], ".2f"),
                         ratio, r["skipped_steps"], fmt(r["final_scale"], ".0f"),
                         fmt(r.get("step_ms"), ".2f")])
        b = self.base
        head = (f"fp32 baseline: final loss {smooth(b.losses, self.window)[-1]:.4f}"
                + (f", step {b.median_ms():.2f} ms" if b.step_ms else "")
                + (f", val loss {b.val_loss:.4f}" if b.val_loss is not None else "")
                + (f"; fp32 run-to-run spread (seeds {self.config['seeds']}): "
                   f"{100 * self.spread:.2f}%" if self.spread is not None else "")
                + f"; gaps: the mean loss difference over the last {100 * TAIL:g}% of the steps,"
                  " paired per seed (95% interval)"
                + (f"\nover {100 * MAX_SPREAD:g}%, the spread is too wide to judge a setup by "
                   f"unless its interval clears it: {self.advice}" if self.too_wide else "")
                + (f"\nunsure: from one seed, a gap past fp32's spread but within "
                   f"{ONE_SEED_FACTOR:g}x it is as likely from a sound setup as not; train each "
                   "setup from every seed (paired=True) to decide"
                   if any(r["undecided"] == "one seed" for r in self.rows) else ""))
        table = format_table(["setup", "loss", "final gap %", "max gap %", "gap %", "seeds",
                              "within spread",
                              "val loss", "val gap %", "grad-norm ratio (range)", "skipped",
                              "loss scale", "step ms"], rows)
        return "\n".join([head, table] + self._monitor_lines())

    def _monitor_lines(self) -> list[str]:
        """What a plan run's monitor saw (spikes) and did (modules raised or named), one line
        a watched run."""
        lines = []
        for run in self.runs + [r for p in self.paired_runs for r in p]:
            m = run.monitor
            if m is None:
                continue
            spikes = m["spikes"]
            seen = (f"{len(spikes)} spike(s) at step(s) "
                    + ", ".join(str(k["step"]) for k in spikes[:8])
                    + (" ..." if len(spikes) > 8 else "") if spikes else "no spike")
            did = ("; ".join(f"step {d['step']}: {d['module']} {d['from']} -> {d['to']}"
                             if d["action"] == "raise" else
                             f"step {d['step']}: {d['module']} named ({d['from']})"
                             for d in m["decisions"][:4])
                   + (" ..." if len(m["decisions"]) > 4 else "")) or "no module over its allowance"
            lines.append(f"monitor on {run.name}: {seen}; {did}")
        return lines

    def as_dict(self) -> dict[str, Any]:
        return {"config": self.config, "smoothing_window": self.window,
                "fp32_spread": self.spread, "spread_too_wide": self.too_wide,
                "max_spread": MAX_SPREAD, "tail": TAIL, "summary": self.rows,
                "runs": [r.as_dict() for r in [self.base] + self.spread_runs + self.runs],
                "paired_runs": [r.as_dict() for p in self.paired_runs for r in p]}

    def save(self, out_dir: str, stem: str = "compare",
             throughput: dict[str, float] | None = None) -> dict[str, str | None]:
        """Writes STEM.txt, STEM.json and STEM.png (loss curves, gap to fp32, grad-norm
        ratio, loss scale, and given ``throughput`` {setup: tokens/s}, a bar chart of it)."""
        return write_outputs(out_dir, stem, self.table(), self.as_dict(),
                             lambda plt, path: self.plot(plt, path, throughput))

    def plot(self, plt: Any, path: str, throughput: dict[str, float] | None = None,
             memory: dict[str, dict[str, int]] | None = None) -> None:
        """The loss curves, the gap to fp32, the grad-norm ratio and the loss scale; with
        ``throughput`` ({setup: tokens/s}) a bar of it, and with ``memory`` ({setup: {kind:
        bytes}}, such as ``ampc.memory.report(...).by_kind()``) a step's peak by kind."""
        if throughput:
            fig, axes = plt.subplots(2, 3, figsize=(15, 7.5))
            (loss_ax, gap_ax, speed_ax), (ratio_ax, memory_ax, scale_ax) = axes
            if memory:
                _plot_memory(memory_ax, memory)
            else:
                memory_ax.axis("off")
        else:
            fig, axes = plt.subplots(2, 2, figsize=(11, 7.5))
            (loss_ax, gap_ax), (ratio_ax, scale_ax) = axes
        w = self.window
        ref = smooth(self.base.losses, w)
        every = [self.base] + self.spread_runs + self.runs
        color = {id(r): f"C{i}" for i, r in enumerate(every)}
        for run in every:
            style = dict(color=color[id(run)], label=run.name,
                         linestyle=":" if run in self.spread_runs else "-")
            loss_ax.plot(smooth(run.losses, w), **style)
            if run is not self.base:
                gap_ax.plot([100 * g for g in rel_gap(smooth(run.losses, w), ref)], **style)
        for run in self.runs:
            ratios = [a / b if b else float("nan")
                      for a, b in zip(run.grad_norms, self.base.grad_norms)]
            ratio_ax.plot(smooth(ratios, w), color=color[id(run)], label=run.name)
        loss_ax.set(title=f"train loss (mean of {w} steps)", xlabel="step")
        gap_ax.set(title="gap to fp32's loss, % (dotted: fp32 from another seed)", xlabel="step")
        ratio_ax.set(title="grad-norm ratio to fp32", xlabel="step")
        for ax in (loss_ax, gap_ax, ratio_ax):
            ax.legend(fontsize=7)
            ax.grid(alpha=0.3)
        if throughput:
            names = list(throughput)
            speed_ax.barh(names, [throughput[n] for n in names],
                          color=[color[id(r)] for r in [self.base] + self.runs][:len(names)])
            speed_ax.invert_yaxis()
            speed_ax.set(title="throughput, tokens/s")
            speed_ax.grid(alpha=0.3, axis="x")
        for run in self.runs:
            if any(s != 1.0 for s in run.scales):
                scale_ax.plot(run.scales, color=color[id(run)], label=run.name)
        scale_ax.set(title="loss scale", xlabel="step")
        scale_ax.grid(alpha=0.3)
        if scale_ax.lines:
            scale_ax.set_yscale("log")
            scale_ax.legend(fontsize=7)
        elif throughput:
            scale_ax.set_title("")      # bf16: no loss scale to draw
            scale_ax.axis("off")
        else:
            scale_ax.text(0.5, 0.5, "no loss scaling (bf16)", ha="center",
                          transform=scale_ax.transAxes)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)


def _plot_memory(ax, memory):
    """Stacked bars of each setup's step peak by kind, MiB."""
    names = list(memory)
    kinds = list(dict.fromkeys(k for parts in memory.values() for k in parts))
    left = [0.0] * len(names)
    for i, kind in enumerate(kinds):
        mib = [memory[n].get(kind, 0) / 2 ** 20 for n in names]
        ax.barh(names, mib, left=left, color=f"C{i}", label=kind)
        left = [a + b for a, b in zip(left, mib)]
    for y, total in enumerate(left):
        ax.text(total, y, f" {total:,.1f}", va="center", fontsize=8)
    ax.invert_yaxis()
    ax.set(title="a training step's peak by kind, MiB", xlim=(0, 1.18 * max(left)))
    ax.legend(fontsize=7, loc="lower right")
    ax.grid(alpha=0.3, axis="x")


def _seeds_to_decide(gap, half, n, most=32):
    """How many seeds would likely narrow a paired gap's 95% interval (``gap`` +- ``half``
    from ``n`` seeds) until it clears MAX_SPREAD on one side; None past ``most``."""
    distance = abs(MAX_SPREAD - abs(gap))
    sd = half * math.sqrt(n) / t95(n - 1)      # the seeds' own scatter, assumed to hold
    return next((k for k in range(n + 1, most + 1) if t95(k - 1) * sd / math.sqrt(k) < distance),
                None)


class LayerReport:
    """Per-module numerics of one mixed-precision step against fp32 (see
    :func:`ampc.validate.layers`)."""

    def __init__(self, rows: list[dict[str, Any]], suggestions: Any, config: dict[str, Any],
                 suggested: Sequence[str] = ()) -> None:
        self.rows, self.suggestions, self.config = rows, suggestions, config
        self.suggested = list(suggested)     # the modules the suggestions name

    def table(self, top: int = 15) -> str:
        """The ``top`` worst modules, and every module a suggestion names."""
        fp16 = self.config["dtype"] == "fp16"
        header = ["module", "type", "output err", "added err", "weight-grad err"]
        if fp16:
            header += ["underflow %", "overflow %"]
        rows = []
        named = set(self.suggested)
        shown = [r for i, r in enumerate(self.rows) if i < top or r["module"] in named]
        for r in shown:
            row = [r["module"], r["type"], fmt(r["output_err"], ".2e"), fmt(r["added_err"], ".2e"),
                   fmt(r["grad_err"], ".2e")]
            if fp16:
                row += [fmt(None if r["underflow"] is None else 100 * r["underflow"], ".3f"),
                        fmt(None if r["overflow"] is None else 100 * r["overflow"], ".3f")]
            rows.append(row)
        cfg = self.config
        extra = len(shown) - min(top, len(self.rows))
        head = (f"one step, {cfg['dtype']} autocast against fp32, {len(self.rows)} modules, "
                f"worst first" + (f" (top {top}" + (f", and {extra} more a suggestion names"
                                                    if extra else "") + ")"
                                  if len(self.rows) > top else "")
                + (f"; fp16 range at loss scale {cfg['loss_scale']:g}" if fp16 else ""))
        lines = [head, format_table(header, rows)]
        if self.suggestions:
            lines.append("modules whose error stands out; to keep them in fp32:")
            lines += ["  " + s for s in self.suggestions]
        else:
            lines.append("no module's error stands out from the others")
        return "\n".join(lines)

    def as_dict(self) -> dict[str, Any]:
        return {"config": self.config, "modules": self.rows, "suggestions": self.suggestions,
                "suggested_modules": self.suggested}

    def save(self, out_dir: str, stem: str = "layers") -> dict[str, str | None]:
        return write_outputs(out_dir, stem, self.table(), self.as_dict(), self.plot)

    def plot(self, plt: Any, path: str, top: int = 25) -> None:
        rows = self.rows[:top]
        fig, ax = plt.subplots(figsize=(8, 0.28 * len(rows) + 1.5))
        y = range(len(rows))
        ax.barh([i - 0.2 for i in y], [max(r["output_err"] or 0, 1e-9) for r in rows], 0.4, label="output")
        ax.barh([i + 0.2 for i in y], [max(r["grad_err"] or 0, 1e-9) for r in rows], 0.4,
                label="weight grad")
        ax.set_yticks(list(y), [r["module"] for r in rows], fontsize=7)
        ax.invert_yaxis()
        ax.set_xscale("log")
        ax.set(title=f"relative error against fp32, {self.config['dtype']}")
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
