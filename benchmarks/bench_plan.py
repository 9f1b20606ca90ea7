"""ampc.autoprecision's bookkeeping against the number of units: Plan.apply, find_units, the solver;
and with --gpt2, search() itself on a GPT-2-shaped model.

    python benchmarks/bench_plan.py [--sizes 1000,10000] [--reps 3] [--json]
    python benchmarks/bench_plan.py --gpt2 [--layers 12] [--seq 64] [--batch 2] [--objectives memory,time] [--load]

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

--gpt2 builds transformers' GPT2LMHeadModel from a fresh GPT2Config (GPT-2 small's shape: 768 wide,
12 heads, a 50,257-word tied head; --layers of them) and times ``search`` on two batches of random
tokens, candidates fp32 and bf16, with the memory objective (no timing inside: the same plan every time)
and the time objective; then one Monitor check of two modules on the applied plan (its time and the bytes
it copies against the model's). With --load the time-objective search runs a second time beside a
process that keeps one core busy, and the two plans are compared unit by unit.
"""
import multiprocessing
import random
import json
import statistics
import time

import torch.nn as nn

import _harness as H

ampc = H.import_ampc()
from ampc.autoprecision import Plan, search  # noqa: E402  (after the harness finds ampc)
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


def _burn(seconds):
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def gpt2(args):
    """search() on a GPT-2-shaped model; the figures as a dict."""
    import torch
    import transformers
    from transformers.pytorch_utils import Conv1D
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=args.layers, n_positions=max(args.seq, 64),
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = transformers.GPT2LMHeadModel(cfg)
    g = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(2):
        ids = torch.randint(0, cfg.vocab_size, (args.batch, args.seq + 1), generator=g)
        batches.append((ids[:, :-1], ids[:, 1:]))
    kw = dict(candidates=("fp32", "bf16"), repeats=2, units=(Conv1D, torch.nn.Linear, torch.nn.LayerNorm))
    out = {"model": f"GPT2LMHeadModel, {args.layers} layers, n_embd {cfg.n_embd}, vocab {cfg.vocab_size}, "
                    f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters",
           "batches": f"2 x ({args.batch} x {args.seq} random tokens)"}
    plans = {}
    for objective in args.objectives.split(","):
        t0 = time.perf_counter()
        plans[objective] = search(model, batches, objective=objective, **kw)
        out[f"search_s_{objective}"] = time.perf_counter() - t0
        out[f"choices_{objective}"] = _counts(plans[objective])
    if args.load:
        burner = multiprocessing.Process(target=_burn, args=(3600,))
        burner.start()
        try:
            t0 = time.perf_counter()
            loaded = search(model, batches, objective="time", **kw)
            out["search_s_time_loaded"] = time.perf_counter() - t0
        finally:
            burner.terminate()
            burner.join()
        quiet = plans["time"]
        out["choices_time_loaded"] = _counts(loaded)
        out["units_differing_under_load"] = [n for n in quiet.choices
                                             if quiet.choices[n] != loaded.choices[n]]
        out["rest_quiet_loaded"] = [quiet.rest, loaded.rest]
    plan = plans.get("memory") or plans["time"]
    monitor = plan.apply(model).monitor(every=1, sample=2)
    out["model_mb"] = sum(t.numel() * t.element_size()
                          for t in list(model.parameters()) + list(model.buffers())) / 2**20
    units = [u.module for u in plan]
    # a check of the first two modules, and of the last two (the final norm and the head,
    # whose weight is the tied 50,257 x 768 embedding: the largest a check copies)
    for where, names in (("first", units[:2]), ("last", units[-2:])):
        t0 = time.perf_counter()
        monitor.measure(batches[0], names)
        out[f"monitor_check_{where}"] = (f"{names}: {time.perf_counter() - t0:.2f} s, copied "
                                         f"{monitor.copied_bytes / 2**20:.2f} MiB")
    return out


def _counts(plan):
    counts = {}
    for c in plan.choices.values():
        counts[c] = counts.get(c, 0) + 1
    return counts


def main():
    p = H.common_args(__doc__)
    p.add_argument("--sizes", default="1000,10000")
    p.add_argument("--gpt2", action="store_true", help="time search() on a GPT-2-shaped model instead")
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--objectives", default="memory,time", help="with --gpt2: the objectives to time")
    p.add_argument("--load", action="store_true", help="with --gpt2: search again beside a busy core")
    args = H.parse(p)
    if args.gpt2:
        out = dict(H.machine(args.device), **gpt2(args))
        print(json.dumps(out, indent=1) if args.json else
              "\n".join(f"{k}: {v:.2f}" if isinstance(v, float) else f"{k}: {v}"
                        for k, v in out.items()))
        return
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
