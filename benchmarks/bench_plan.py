"""ampc.autoprecision's bookkeeping against the number of units: Plan.apply, find_units, the solver.

    python benchmarks/bench_plan.py [--sizes 1000,10000] [--reps 3] [--json]

A plan is bookkeeping around the model: applying it or finding its units should cost time
in proportion to the number of modules, so that a model of 10,000 Linears (a deep MoE, a
large vision backbone) is planned as easily as a small one. Each size builds a model of
that many tiny units (blocks of Linear(8, 8) + LayerNorm(8), one level deep: find_units
looks inside every block) and a saved-format plan for it (units alternating bf16 and fp32),
then times, interleaved rep by rep, ``Plan.from_json(text).apply(model)`` on a fresh copy
of the model (parsing included) and ``find_units(model)``. There is no torch counterpart;
linearity is read from the time per unit across sizes. ``solve`` takes measurements drawn
at random (seeded) whose summed errors are over the budget when each unit takes its
cheapest candidate, so that the solver makes about one move per unit.
"""
import random
import json
import statistics
import time

import torch.nn as nn

import _harness as H

ampc = H.import_ampc()
from ampc.autoprecision import Plan  # noqa: E402  (after the harness finds ampc)
from ampc.autoprecision._solve import Budget, solve  # noqa: E402
from ampc.autoprecision._units import find_units  # noqa: E402


def model_of(units):
    return nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8)) for _ in range(units // 2)])


def plan_text(model):
    names = [(n, type(m).__name__, "norm" if isinstance(m, nn.LayerNorm) else "gemm")
             for n, m in find_units(model).items()]
    units = [{"module": n, "type": t, "kind": k, "choice": ("bf16", "fp32")[i % 2],
              "options": {"fp32": {"ms": 0.01, "bytes": 4}, "bf16": {"ms": 0.01, "bytes": 2}},
              "rejected": {}} for i, (n, t, k) in enumerate(names)]
    return json.dumps({"version": 1, "device": "cpu", "objective": "time",
                       "budget": {"loss": 0.05, "grad": 0.25, "wgrad": 0.05},
                       "candidates": ["fp32", "bf16"], "units": units})


def measured_of(units, seed=0):
    """{unit: {candidate: figures}}: bf16 cheaper than fp32, its errors summing to about
    three times the budget over all units."""
    rng = random.Random(seed)
    bar = 3 * 0.05 / units ** 0.5
    return {str(k): {"fp32": {"loss_err": 0.0, "dgrad_err": 0.0, "wgrad_err": 0.0, "ms": 1.0, "bytes": 4},
                     "bf16": {"loss_err": bar * rng.uniform(0.5, 1.5), "dgrad_err": bar * rng.random(),
                              "wgrad_err": 0.01, "ms": rng.uniform(0.3, 0.9), "bytes": 2}}
            for k in range(units)}


def main():
    p = H.common_args(__doc__)
    p.add_argument("--sizes", default="1000,10000")
    args = H.parse(p)
    reps = args.reps or 3
    rows = []
    Plan.from_json(plan_text(model_of(2))).apply(model_of(2))   # first use loads ampc.fp8: not timed
    for n in [int(s) for s in args.sizes.split(",")]:
        text = plan_text(model_of(n))
        measured = measured_of(n)
        t_apply, t_find, t_solve = [], [], []
        for _ in range(reps):
            model = model_of(n)
            t0 = time.perf_counter()
            applied = Plan.from_json(text).apply(model)
            t_apply.append(time.perf_counter() - t0)
            applied.remove()
            t0 = time.perf_counter()
            found = find_units(model)
            t_find.append(time.perf_counter() - t0)
            assert len(found) == n, (len(found), n)
            t0 = time.perf_counter()
            choice, _ = solve(measured, Budget(), "time")
            t_solve.append(time.perf_counter() - t0)
            assert "fp32" in choice.values() and "bf16" in choice.values()
        for what, ts in (("Plan.apply", t_apply), ("find_units", t_find), ("solve", t_solve)):
            med = statistics.median(ts)
            rows.append({"case": what, "units": n, "median_s": med, "min_s": min(ts), "max_s": max(ts),
                         "us_per_unit": 1e6 * med / n, "reps": reps})
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    print(f"# {H.platform.processor() or 'cpu'}; torch {H.torch.__version__}; "
          f"CPU capability {H.torch.backends.cpu.get_cpu_capability()}")
    print(f"{'case':<12}{'units':>8}{'median s':>11}{'min-max s':>20}{'us/unit':>10}")
    for r in rows:
        print(f"{r['case']:<12}{r['units']:>8}{r['median_s']:>11.4f}"
              f"{r['min_s']:>10.4f}-{r['max_s']:<9.4f}{r['us_per_unit']:>10.1f}")


if __name__ == "__main__":
    main()
