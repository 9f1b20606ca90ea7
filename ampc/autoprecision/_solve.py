"""The budget and the solver: the cheapest choice per unit whose summed error fits.

A multiple-choice knapsack solved greedily: every unit starts at its cheapest candidate
that fits the budget on its own; while a summed error is over its limit, the move that
buys the most error per unit of added cost is taken (a unit raised to a candidate with
less error). Errors of different units are rounding errors independent of each other, so
they add as a root sum of squares: the sum of their squares is held under the square of
the budget. Deterministic for given measurements (ties go to the earlier unit).
"""
from __future__ import annotations

import heapq
import math
from dataclasses import asdict, dataclass

from . import _candidates, _objectives

ERRORS = ("loss_err", "dgrad_err", "wgrad_err")

# Timing decisions and noise: a choice that needs more memory (a higher precision, fp32 for
# the ops outside the units, fp32 throughout) wins on time only when it measured faster by
# more than this fraction; within it the choice that needs less memory wins. Times are the
# fastest of interleaved runs, which a busy machine moves by a few percent: a choice flips
# only where two candidates' times are about MARGIN apart.
MARGIN = 0.10


def clearly_faster(ms: float, than: float, margin: float = MARGIN) -> bool:
    """Whether ``ms`` beats ``than`` by more than ``margin``: only then does a choice that
    needs more memory win on time."""
    return ms * (1 + margin) < than


@dataclass(frozen=True)
class Budget:
    """How much error a plan may add, per training step, against fp32 (relative errors).

    loss:  the per-example loss (each unit's first-order estimate, units combined as a
           root sum of squares; the whole plan's measured loss error must also stay
           under it)
    grad:  the gradient passed back to earlier layers (units' dgrad errors, combined
           the same way; the whole plan: the error of all weight gradients together)
    wgrad: any one unit's weight gradient (each unit on its own, and in the whole plan)

    noise_fraction: a gradient error (a unit's dgrad and wgrad, the whole plan's grad) also
           passes when it is at most this fraction of fp32's own batch-to-batch spread of
           that gradient over the search's batches (ampc._numerics.noise). At 0.5 the
           error adds at most a quarter to the variance SGD's gradient already has (about
           what a batch a fifth smaller would); 0 judges by the fixed figures alone.

    The defaults let a typical network run bf16 throughout (a bf16 GEMM adds about 1e-2
    to the per-example loss and 3e-3 to its gradients) and refuse what is broken: an
    output past fp16's range (infinite error), gradients that underflow (error near 1),
    a norm whose input bf16 cannot resolve (error near 1): errors the spread of a few
    batches cannot excuse (the spread is at most about 1.4, half of it 0.7).
    """
    loss: float = 0.05
    grad: float = 0.25
    wgrad: float = 0.05
    noise_fraction: float = 0.5

    def __post_init__(self):
        for k, v in asdict(self).items():
            low_ok = k == "noise_fraction" and v == 0
            if not (isinstance(v, (int, float)) and not isinstance(v, bool) and (v > 0 or low_ok)
                    and math.isfinite(v)):
                raise ValueError(f"ampc.autoprecision.Budget: {k} must be a positive number"
                                 f"{' or 0' if k == 'noise_fraction' else ''}, got {v!r}")

    def limit(self, key: str, noise: float | None = None) -> float:
        """The most ``key`` ("loss_err", "dgrad_err", "wgrad_err" or the whole plan's
        "grad_err") may be, given fp32's batch-to-batch spread ``noise`` of that gradient
        (None: not measured, the fixed figure alone)."""
        fixed = {"loss_err": self.loss, "dgrad_err": self.grad, "grad_err": self.grad,
                 "wgrad_err": self.wgrad}[key]
        if key == "loss_err" or noise is None or not math.isfinite(noise):
            return fixed
        return max(fixed, self.noise_fraction * noise)

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


@dataclass(frozen=True)
class Over:
    """A whole-plan error over its budget: which (``loss_err`` or ``grad_err``), by how much."""
    key: str
    value: float
    limit: float

    def __str__(self):
        return f"{self.key.split('_')[0]} err {self.value:.1e} > {self.limit:g}"


def _err(r, key):
    v = r.get(key)
    return 0.0 if v is None else v


def fits_alone(r, budget):
    """Why a candidate cannot be used for its unit whatever the others do, or None."""
    if r.get("not_measured"):
        return r["not_measured"]
    if r.get("too_slow"):
        return r["too_slow"]
    if r.get("error"):
        return r["error"] if r["error"].startswith("too slow") else "does not run here"  # plans saved before "too_slow"
    for key in ("loss_err", "dgrad_err", "wgrad_err"):
        v = _err(r, key)
        if not math.isfinite(v):
            return f"{key.split('_')[0]} error not finite"
        limit = budget.limit(key, r.get(key.replace("_err", "_noise")))
        if v > limit:
            return f"{key.split('_')[0]} err {v:.1e} > {limit:.2g}"
    return None


def noise_ratio(r, key):
    """A candidate's ``key`` error ("dgrad_err", "wgrad_err") over fp32's batch-to-batch
    spread of that gradient, or None where either is not measured."""
    v, noise = r.get(key), r.get(key.replace("_err", "_noise"))
    if v is None or not noise:
        return None
    return v / noise


def cost_of(r, objective):
    v = r[_objectives.get(objective).cost]
    return math.inf if v is None else v


def order(options, objective, margin=MARGIN):
    """The candidates of one unit cheapest first; with the time objective, a candidate not
    :func:`clearly_faster` than another counts as equal to it (timing noise) and the one
    using fewer bytes, then one that needs no loss scaler (bf16 before fp16: fp16's smaller
    error would cost the plan a scaler, and its freed gradients, for no byte or ms less),
    then the one with less error, goes first."""
    def key(c):
        r = options[c]
        return (r["bytes"], _candidates.loss_scaled(c),
                _err(r, "loss_err") + _err(r, "dgrad_err") + _err(r, "wgrad_err"))
    names = sorted(options, key=lambda c: (cost_of(options[c], objective), key(c)))
    if not _objectives.get(objective).by_speed or not names:
        return names
    out = []
    while names:
        best = cost_of(options[names[0]], objective)
        group = [c for c in names if not clearly_faster(best, cost_of(options[c], objective),
                                                        margin)]
        group.sort(key=key)
        out += group
        names = [c for c in names if c not in group]
    return out


CEILING = 1.25      # the memory objective's default ceiling on a step's slowdown
OVER_CEILING = "slower than the ceiling"    # how a reason the ceiling gave begins


def over_ceiling(options, ok, ceiling):
    """{candidate: why} for the candidates in ``ok`` whose time is more than ``ceiling``
    times the fastest of ``ok`` (the memory objective trades memory for time, but only so
    far: fp16 GEMMs on a CPU run several times slower than fp32)."""
    timed = {c: options[c]["ms"] for c in ok if options[c].get("ms") is not None}
    if not timed:
        return {}
    c0 = min(timed, key=timed.get)
    t0 = timed[c0]
    return {c: f"{OVER_CEILING} {ceiling:g}x: {t / t0:.1f}x the fastest ({c0} {t0:.2f} ms)"
            for c, t in timed.items() if t > ceiling * t0}


def solve(measured, budget, objective, ceiling=None):
    """{unit: choice}, and {unit: {candidate: reason}} for the candidates ruled out. With
    ``ceiling`` (the memory objective), a candidate more than ``ceiling`` times slower than
    the fastest candidate of its unit that fits the budget is ruled out too."""
    usable, rejected = {}, {}
    for name, options in measured.items():
        rejected[name] = {}
        ok = []
        for c in order(options, objective):
            why = fits_alone(options[c], budget)
            if why is None:
                ok.append(c)
            else:
                rejected[name][c] = why
        if ceiling is not None:
            slow = over_ceiling(options, ok, ceiling)
            rejected[name].update(slow)
            ok = [c for c in ok if c not in slow]
        usable[name] = ok or ["fp32"]
    choice = {n: ok[0] for n, ok in usable.items()}
    _lower_errors(choice, usable, measured, budget, objective)
    return choice, rejected


def summed_errors(measured, choice, budget):
    """({error: its budget squared}, {error: the sum of the units' squares at ``choice``}):
    the units' loss and dgrad errors add as a root sum of squares."""
    limits = {"loss_err": budget.loss ** 2, "dgrad_err": budget.grad ** 2}
    return limits, {k: math.fsum(_err(measured[n][c], k) ** 2 for n, c in choice.items())
                    for k in limits}


def _lower_errors(choice, usable, measured, budget, objective):
    """While a summed error is over its limit, takes the move that buys the most error per
    unit of added cost. The moves wait in a heap ordered by (score, unit, candidate); a
    move becomes stale when its unit moves (then its unit's moves are pushed afresh), and
    every score is rebuilt when the set of errors over the limit changes (at most twice),
    so n units cost O(n log n), not O(n) per move."""
    limits, totals = summed_errors(measured, choice, budget)
    index = {n: i for i, n in enumerate(choice)}

    def moves(n, over):
        now = measured[n][choice[n]]
        for j, alt in enumerate(usable[n]):
            r = measured[n][alt]
            gain = sum(max(0.0, _err(now, k) ** 2 - _err(r, k) ** 2) / limits[k] for k in over)
            if gain > 0:
                extra = max(cost_of(r, objective) - cost_of(now, objective), 1e-9)
                yield (-gain / extra, index[n], j, n, alt, choice[n])

    heap, heap_over = [], None
    while True:
        over = tuple(k for k in limits if totals[k] > limits[k])
        if not over:
            return
        if over != heap_over:
            heap = [m for n in choice for m in moves(n, over)]
            heapq.heapify(heap)
            heap_over = over
        while heap and heap[0][5] != choice[heap[0][3]]:
            heapq.heappop(heap)             # stale: its unit has moved since
        if not heap:
            return
        _, _, _, n, alt, _ = heapq.heappop(heap)
        for k in limits:
            totals[k] += _err(measured[n][alt], k) ** 2 - _err(measured[n][choice[n]], k) ** 2
        choice[n] = alt
        for k in limits:                    # the running sums drift: exact near the edge
            if abs(totals[k] - limits[k]) <= 1e-9 * limits[k]:
                totals[k] = math.fsum(_err(measured[m][choice[m]], k) ** 2 for m in choice)
        for m in moves(n, over):
            heapq.heappush(heap, m)


def raise_one(choice, measured, usable_order, name):
    """The next candidate of ``name`` with less total error than its current one, or fp32."""
    now = measured[name][choice[name]]
    now_err = sum(_err(now, k) for k in ERRORS)
    for c in usable_order:
        r = measured[name][c]
        if c != choice[name] and sum(_err(r, k) for k in ERRORS) < now_err:
            return c
    return "fp32"
