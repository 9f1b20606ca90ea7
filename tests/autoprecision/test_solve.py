"""The solver's heap gives the moves the plain greedy loop gives (that loop, which rescans
every unit per move, is kept here as the reference), on random measurements."""
import random

import pytest

from ampc.autoprecision._solve import Budget, _err, cost_of, fits_alone, order, solve


def greedy_reference(measured, budget, objective):
    """The solver as first written: every move rescans all units and candidates."""
    usable = {n: [c for c in order(measured[n], objective) if fits_alone(measured[n][c], budget) is None]
              or ["fp32"] for n in measured}
    choice = {n: ok[0] for n, ok in usable.items()}

    def total(key):
        return sum(_err(measured[n][choice[n]], key) ** 2 for n in choice)
    limits = {"loss_err": budget.loss ** 2, "dgrad_err": budget.grad ** 2}
    while True:
        over = {k: total(k) - lim for k, lim in limits.items() if total(k) > lim}
        if not over:
            return choice
        best = None
        for n, c in choice.items():
            now = measured[n][c]
            for alt in usable[n]:
                r = measured[n][alt]
                gain = sum(max(0.0, _err(now, k) ** 2 - _err(r, k) ** 2) / limits[k] for k in over)
                if gain <= 0:
                    continue
                score = gain / max(cost_of(r, objective) - cost_of(now, objective), 1e-9)
                if best is None or score > best[0]:
                    best = (score, n, alt)
        if best is None:
            return choice
        choice[best[1]] = best[2]


def random_measured(rng, units):
    """Per unit, each candidate's errors are one factor times the unit's own profile, so
    that the candidates are ordered alike in every error, as rounding errors are (with
    errors ordered differently per key a greedy move can undo another, in both solvers)."""
    out = {}
    for k in range(units):
        loss, dgrad, wgrad = (rng.expovariate(1 / m) for m in (0.02, 0.08, 0.01))
        opts = {"fp32": {"loss_err": 0.0, "dgrad_err": 0.0, "wgrad_err": 0.0,
                         "ms": rng.uniform(0.5, 2.0), "bytes": 4}}
        for c, b in (("bf16", 2), ("fp16", 2), ("fp8", 1)):
            if rng.random() < 0.8:
                f = rng.uniform(0.2, 2.0)
                opts[c] = {"loss_err": f * loss, "dgrad_err": f * dgrad, "wgrad_err": f * wgrad,
                           "ms": rng.uniform(0.2, 2.0), "bytes": b}
        out[f"u{k}"] = opts
    return out


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("objective", ["time", "memory"])
def test_heap_solver_takes_the_greedy_moves(seed, objective):
    rng = random.Random(seed)
    measured = random_measured(rng, rng.randint(1, 60))
    budget = Budget(loss=rng.uniform(0.02, 0.1), grad=rng.uniform(0.1, 0.4))
    choice, _ = solve(measured, budget, objective)
    assert choice == greedy_reference(measured, budget, objective)


def test_the_random_cases_make_moves():
    """Most cases above are over the budget at first: the comparison covers moves."""
    moved = 0
    for seed in range(12):
        rng = random.Random(seed)
        measured = random_measured(rng, rng.randint(1, 60))
        budget = Budget(loss=rng.uniform(0.02, 0.1), grad=rng.uniform(0.1, 0.4))
        first = {n: ([c for c in order(measured[n], "time")
                      if fits_alone(measured[n][c], budget) is None] or ["fp32"])[0] for n in measured}
        moved += solve(measured, budget, "time")[0] != first
    assert moved >= 6


@pytest.mark.parametrize("objective", ["time", "memory"])
def test_at_equal_bytes_and_time_bf16_goes_before_the_more_accurate_fp16(objective):
    """fp16's smaller error would cost the plan a loss scaler (and its freed gradients) for no
    byte or ms less: where both fit, bf16 is taken; fp16 still where it is clearly faster."""
    options = {"fp32": dict(bytes=4, ms=1.0, loss_err=0.0, dgrad_err=0.0),
               "fp16": dict(bytes=2, ms=0.5, loss_err=1e-4, dgrad_err=1e-4),
               "bf16": dict(bytes=2, ms=0.5, loss_err=1e-3, dgrad_err=1e-3)}
    assert order(options, objective)[:2] == ["bf16", "fp16"]
    options["fp16"]["ms"] = 0.1                   # clearly faster: time ranks first there
    assert order(options, objective)[:2] == (["fp16", "bf16"] if objective == "time"
                                             else ["bf16", "fp16"])
