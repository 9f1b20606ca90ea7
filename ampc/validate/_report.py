"""What compare() and layers() hand back: a plain-text table, a JSON file and a PNG.

matplotlib is optional: without it ``save`` says so and writes the table and JSON only.
"""
from __future__ import annotations  # "X | None" hints on Python 3.9 too; none evaluated at import

import json
import math
import os
import statistics
import warnings
from collections.abc import Iterable, Sequence
from typing import Any

from ._run import Run, _finite, rel_gap, smooth


def format_table(header: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    """Right-aligned columns under a header, separated by ' | '."""
    cells = [list(map(str, header))] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = [" | ".join(c.rjust(w) for c, w in zip(r, widths)) for r in cells]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    return "\n".join(lines)


def fmt(value, spec=".4f", none="-"):
    if value is None:
        return none
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return format(value, spec)


def pyplot():
    """matplotlib.pyplot with a file-only backend, or None when matplotlib is missing."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


NO_MATPLOTLIB = "matplotlib is not installed: no picture (pip install matplotlib)"


def write_outputs(out_dir, stem, text, data, draw):
    """Writes STEM.txt, STEM.json and, with matplotlib, STEM.png (``draw(plt, path)``).
    Returns {"txt": path, "json": path, "png": path or None}."""
    os.makedirs(out_dir, exist_ok=True)
    paths = {k: os.path.join(out_dir, f"{stem}.{k}") for k in ("txt", "json", "png")}
    with open(paths["txt"], "w") as f:
        f.write(text + "\n")
    with open(paths["json"], "w") as f:
        json.dump(data, f, indent=1, default=_json_default)
    plt = pyplot()
    if plt is None:
        paths["png"] = None
    else:
        draw(plt, paths["png"])
    return paths


def _json_default(value):
    if isinstance(value, float):
        return str(value)
    return repr(value)


# Above this, fp32's own run-to-run spread is too wide to judge a setup by: a broken
# mixed-precision run (a sound one ends within about 1% of fp32) would still pass. Short
# runs of small-batch models (20 steps of ResNet-18: 20%) give such spreads.
MAX_SPREAD = 0.05


class Comparison:
    """The runs of :func:`ampc.validate.compare` and how each one compares with fp32.

    Curves are smoothed over a trailing window of a tenth of the run before gaps are taken
    (per-step losses jump with the batch). ``final gap``: relative gap of the smoothed
    loss at the last step; ``max gap``: its largest value over the run; ``fp32 spread``:
    the largest gap between fp32 runs from different seeds over the second half of the run;
    a setup is ``within`` fp32's spread when its final gap is no larger. A spread over
    ``MAX_SPREAD`` (5%) is too wide to judge by: a warning says so, the verdict reads "spread
    too wide" (``within_spread`` None) and :meth:`ok` holds the setups to 5% instead.
    """

    def __init__(self, base: Run, runs: list[Run], spread_runs: list[Run], config: dict[str, Any]) -> None:
        self.base, self.runs, self.spread_runs, self.config = base, runs, spread_runs, config
        self.window = max(1, len(base.losses) // 10)
        self.spread = None
        if spread_runs:
            ref = smooth(base.losses, self.window)
            half = len(ref) // 2
            self.spread = max(max(rel_gap(smooth(r.losses, self.window), ref)[half:])
                              for r in spread_runs)
        self.too_wide = self.spread is not None and not self.spread <= MAX_SPREAD
        if self.too_wide:
            warnings.warn(f"ampc.validate.compare: fp32's run-to-run spread is "
                          f"{100 * self.spread:.1f}%, over the {100 * MAX_SPREAD:g}% within "
                          "which it tells a sound setup from a broken one: no setup is judged "
                          "'within spread'; train more steps (or larger batches) for a "
                          "verdict", stacklevel=3)
        self.rows = [self._row(r) for r in runs]

    def _row(self, run):
        ref = smooth(self.base.losses, self.window)
        gap = rel_gap(smooth(run.losses, self.window), ref)
        ratios = [a / b for a, b, k in zip(run.grad_norms, self.base.grad_norms, range(len(gap)))
                  if _finite(a) and _finite(b) and b > 0 and k not in run.skipped]
        final = gap[-1]
        val_gap = None
        if _finite(run.val_loss) and _finite(self.base.val_loss):
            val_gap = abs(run.val_loss - self.base.val_loss) / abs(self.base.val_loss)
        return {
            "setup": run.name,
            "final_loss": smooth(run.losses, self.window)[-1],
            "final_gap": final,
            "max_gap": max(gap),
            "within_spread": (None if self.spread is None or self.too_wide
                              else bool(final <= self.spread)),
            "val_loss": run.val_loss,
            "val_gap": val_gap,
            "grad_norm_ratio_median": statistics.median(ratios) if ratios else None,
            "grad_norm_ratio_min": min(ratios) if ratios else None,
            "grad_norm_ratio_max": max(ratios) if ratios else None,
            "skipped_steps": len(run.skipped),
            "step_ms": run.median_ms() if run.step_ms else None,
            "final_scale": run.scales[-1] if run.scales and run.scales[-1] != 1.0 else None,
        }

    def ok(self) -> bool:
        """True when every setup ends inside fp32's spread (with one seed, within 2%; with a
        spread too wide to judge by, within MAX_SPREAD)."""
        limit = self.spread if self.spread is not None else 0.02
        limit = min(limit, MAX_SPREAD)
        return all(_finite(r["final_gap"]) and r["final_gap"] <= limit for r in self.rows)

    def table(self) -> str:
        """The comparison as plain text: one row per setup against fp32."""
        rows = []
        for r in self.rows:
            within = {None: "spread too wide" if self.too_wide else "-", True: "yes",
                      False: "NO"}[r["within_spread"]]
            ratio = "-"
            if r["grad_norm_ratio_median"] is not None:
                # one precision for all three: rounding keeps the median inside its range
                ratio = (f"{r['grad_norm_ratio_median']:.3f} ({r['grad_norm_ratio_min']:.3f}"
                         f"-{r['grad_norm_ratio_max']:.3f})")
            rows.append([r["setup"], fmt(r["final_loss"]), fmt(100 * r["final_gap"], ".2f"),
                         fmt(100 * r["max_gap"], ".2f"), within, fmt(r["val_loss"]),
                         fmt(None if r["val_gap"] is None else 100 * r["val_gap"], ".2f"),
                         ratio, r["skipped_steps"], fmt(r["final_scale"], ".0f"),
                         fmt(r.get("step_ms"), ".2f")])
        b = self.base
        head = (f"fp32 baseline: final loss {smooth(b.losses, self.window)[-1]:.4f}"
                + (f", step {b.median_ms():.2f} ms" if b.step_ms else "")
                + (f", val loss {b.val_loss:.4f}" if b.val_loss is not None else "")
                + (f"; fp32 run-to-run spread (seeds {self.config['seeds']}): "
                   f"{100 * self.spread:.2f}%" if self.spread is not None else "")
                + (f" (over {100 * MAX_SPREAD:g}%: too wide to judge a setup by; train "
                   "longer)" if self.too_wide else ""))
        table = format_table(["setup", "loss", "final gap %", "max gap %", "within spread",
                              "val loss", "val gap %", "grad-norm ratio (range)", "skipped",
                              "loss scale", "step ms"], rows)
        return head + "\n" + table

    def as_dict(self) -> dict[str, Any]:
        return {"config": self.config, "smoothing_window": self.window,
                "fp32_spread": self.spread, "spread_too_wide": self.too_wide,
                "max_spread": MAX_SPREAD, "summary": self.rows,
                "runs": [r.as_dict() for r in [self.base] + self.spread_runs + self.runs]}

    def save(self, out_dir: str, stem: str = "compare",
             throughput: dict[str, float] | None = None) -> dict[str, str | None]:
        """Writes STEM.txt, STEM.json and STEM.png (loss curves, gap to fp32, grad-norm
        ratio, loss scale, and given ``throughput`` {setup: tokens/s}, a bar chart of it)."""
        return write_outputs(out_dir, stem, self.table(), self.as_dict(),
                             lambda plt, path: self.plot(plt, path, throughput))

    def plot(self, plt: Any, path: str, throughput: dict[str, float] | None = None) -> None:
        if throughput:
            fig, axes = plt.subplots(2, 3, figsize=(15, 7.5))
            (loss_ax, gap_ax, speed_ax), (ratio_ax, scale_ax, spare) = axes
            spare.axis("off")
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
        else:
            scale_ax.text(0.5, 0.5, "no loss scaling (bf16)", ha="center",
                          transform=scale_ax.transAxes)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)


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
