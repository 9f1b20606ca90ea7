"""What ampc.autoprecision.search costs on bench_lean_memory.py's GPT-2-shaped model (17M
parameters: width 512, 4 layers, vocab 8,192) at batch 16 x 256, and where the time goes.

Two batches of random tokens (bench_peak_budget.py's), the search's default candidates for the objective; the phases
timed: the fp32 pass before measuring (the failure and zero-gradient checks), the warm-up
(only when some unit cannot show an error), the units' measurement, the solver and the
whole-plan check. Then the plan's table.

    python benchmarks/bench_search_cost.py [--objective memory] [--batch 16] [--context 256]
        [--examples auto|N|all]
"""
import argparse
import functools
import os
import time

import torch

import _harness as H

ampc = H.import_ampc()
import ampc.autoprecision._measure as measure_mod  # noqa: E402
import ampc.autoprecision._search as search_mod  # noqa: E402
from ampc.autoprecision import search  # noqa: E402
from bench_peak_budget import batches, fresh, lm_loss  # noqa: E402  (bench_lean_memory's GPT-2)

PHASES = ((search_mod.failures, "first_run", "fp32 pass (failure and zero-gradient checks)"),
          (measure_mod, "warm_if_silent", "warm-up (when some unit is silent)"),
          (measure_mod, "measure", "units measured"),
          (search_mod, "_first_plan", "solver"),
          (search_mod, "check_whole", "whole-plan check"))


def timed(spent):
    """Wraps each phase's function so that its seconds add up in ``spent``."""
    for module, name, label in PHASES:
        inner = getattr(module, name)

        @functools.wraps(inner)
        def wrapper(*args, _inner=inner, _label=label, **kwargs):
            t0 = time.perf_counter()
            try:
                return _inner(*args, **kwargs)
            finally:
                spent[_label] = spent.get(_label, 0.0) + time.perf_counter() - t0
        setattr(module, name, wrapper)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--objective", default="memory")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--examples", default="auto",
                   help="examples of each batch measured: auto, a number, or all (whole batches)")
    args = p.parse_args()
    examples = ({"auto": "auto", "all": None}[args.examples] if args.examples in ("auto", "all")
                else int(args.examples))
    model = fresh(args)
    spent = {}
    timed(spent)
    load = os.getloadavg()[0]
    t0 = time.perf_counter()
    plan = search(model, batches(args, 2), lm_loss, objective=args.objective, examples=examples)
    took = time.perf_counter() - t0
    print(" | ".join(f"{k} {v}" for k, v in H.machine("cpu").items()))
    print(f"{sum(q.numel() for q in model.parameters()) / 1e6:.1f}M params, batch {args.batch} x "
          f"{args.context}, {args.objective}, examples={args.examples}; load {load:.1f} before, {os.getloadavg()[0]:.1f} after")
    print(f"search took {took:.1f} s: " + ", ".join(f"{k} {v:.1f} s" for k, v in spent.items()))
    print(plan.table())


if __name__ == "__main__":
    main()
