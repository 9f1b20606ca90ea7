"""A training run's record (Run) and the curve arithmetic compare() and its report share."""
from __future__ import annotations  # "X | None" hints on Python 3.9 too; none evaluated at import

import math
import statistics
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Run:
    """One training run: per-step curves and what it cost."""
    name: str
    kind: str                 # fp32 or a setup's name (torch.amp, ampc.master, ...)
    dtype: str                # fp32, fp16 or bf16
    seed: int
    losses: list = field(default_factory=list)
    grad_norms: list = field(default_factory=list)   # global L2 norm of the unscaled grads
    scales: list = field(default_factory=list)       # loss scale used at each step (1.0: none)
    skipped: list = field(default_factory=list)      # steps whose update was skipped (inf/nan)
    step_ms: list = field(default_factory=list)      # forward + backward + optimizer
    peak_mib: float = None    # memory this run added at its peak (see _PeakMemory)
    val_loss: float = None
    monitor: dict = None      # a plan run's monitor: {"spikes": [...], "decisions": [...]}
    model: object = field(default=None, repr=False)      # the trained model and its
    optimizer: object = field(default=None, repr=False)  # optimizer (not serialized)

    def median_ms(self) -> float:
        warm = self.step_ms[len(self.step_ms) // 5:] or self.step_ms
        return statistics.median(warm)

    def as_dict(self) -> dict[str, Any]:
        d = {k: v for k, v in self.__dict__.items() if k not in ("model", "optimizer")}
        d["median_step_ms"] = self.median_ms()
        return d




def smooth(values: list[float], window: int) -> list[float]:
    """Trailing moving average (window ``window``); nan and inf propagate."""
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v
        if i >= window:
            acc -= values[i - window]
        out.append(acc / min(i + 1, window))
    return out


def rel_gap(curve: list[float], base: list[float]) -> list[float]:
    """Per step |curve - base| / |base| (the absolute gap where base is 0)."""
    return [abs(a - b) / abs(b) if b else abs(a - b) for a, b in zip(curve, base)]


TAIL = 0.25    # the verdict reads the last quarter of the steps: the curve, not its last point


def tail_gap(curve: list[float], base: list[float], tail: float = TAIL) -> float:
    """Mean over the last ``tail`` of the steps of ``curve - base``, step by step, relative
    to ``base``'s mean there; signed (positive: ``curve`` trains worse). Taken on the same
    batches, the batch-to-batch jumps of the loss cancel in the difference."""
    n = max(1, round(len(base) * tail))
    diff = statistics.fmean(a - b for a, b in zip(curve[-n:], base[-n:]))
    ref = abs(statistics.fmean(base[-n:]))
    return diff / ref if ref else diff


def tail_spread(curve: list[float], base: list[float], window: int,
                tail: float = TAIL) -> float:
    """How far apart two runs are over the last ``tail`` of the steps: the larger of
    ``|tail_gap|`` and the root mean square of their curves' relative difference there
    (each smoothed over ``window`` steps). Two fp32 seeds whose curves cross can have a
    mean difference near 0 by chance; the RMS still says how far apart they ran."""
    n = max(1, round(len(base) * tail))
    gaps = rel_gap(smooth(curve, window)[-n:], smooth(base, window)[-n:])
    return max(abs(tail_gap(curve, base, tail)), math.sqrt(statistics.fmean(g * g for g in gaps)))


# Student's t at 97.5% (a two-sided 95% interval) for 1..10 degrees of freedom
_T95 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228)


def t95(df: int) -> float:
    """Student's t quantile of a two-sided 95% interval with ``df`` degrees of freedom."""
    # past the table, the first terms of t's expansion around the normal's 1.96 (to 0.005)
    return _T95[df - 1] if df <= len(_T95) else 1.96 + 2.37 / df + 2.82 / df ** 2


def mean_interval(values: list[float]) -> tuple[float, float | None]:
    """The mean of ``values`` and the half-width of its 95% interval (None for one value;
    a value not finite, a run that diverged, makes both the mean and the width that)."""
    mean = statistics.fmean(values)
    if len(values) < 2:
        return mean, None
    if not all(map(math.isfinite, values)):
        return mean, math.inf if math.isinf(mean) else math.nan
    return mean, t95(len(values) - 1) * statistics.stdev(values) / math.sqrt(len(values))


def _finite(x: float | None) -> bool:
    return x is not None and math.isfinite(x)
