"""The memory objective with a byte budget: ampc.autoprecision.search(..., objective="memory",
peak_bytes=f x fp32's peak) on a GPT-2-shaped model, for a few fractions f. Per budget: whether it was
met, the step's peak the search measured (ampc.memory.report, torch.optim.AdamW), what the plan chose
(modules per candidate, blocks recomputed), the search's time, and the plan's training step time against
fp32's (forward, backward and AdamW step; reps interleaved, median and quartiles).

    python benchmarks/bench_peak_budget.py [--fractions 0.8,0.6,0.4] [--batch 8] [--context 128]
                                           [--width 256] [--layers 2] [--vocab 4096] [--reps 5]
                                           [--optimizer torch|ampc] [--of fp32|amp]

Model: transformers' GPT2LMHeadModel (bench_lean_memory.py's, dropout 0, its KV cache off), random
tokens, next-token cross-entropy; the search gets two batches (repeats 1).
"""
import argparse
import contextlib
import statistics
import time
import warnings

import torch
import torch.nn.functional as F

import _harness as H

ampc = H.import_ampc()
import ampc.autoprecision  # noqa: E402
import ampc.memory  # noqa: E402
from bench_lean_memory import gpt2  # noqa: E402

MiB = float(1 << 20)


def lm_loss(out, y):
    return F.cross_entropy(out.logits.flatten(0, 1).float(), y.flatten())


def batches(args, n, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(0, args.vocab, (args.batch, args.context + 1), generator=g)
        out.append(({"input_ids": ids[:, :-1], "use_cache": False}, ids[:, 1:]))
    return out


def fresh(args):
    torch.manual_seed(0)
    return gpt2(args)


def optimizer_for(args):
    """What the search measures the step with: torch's AdamW, or ampc's."""
    if args.optimizer == "torch":
        return lambda ps: torch.optim.AdamW(ps, lr=1e-3)
    return lambda ps: ampc.optim.AdamW(ps, lr=1e-3)


def stepper(args, plan):
    """A training step of a fresh model with ``plan`` applied (None: fp32; "amp": torch.amp
    bf16 with torch's fused AdamW)."""
    model = fresh(args)
    region = contextlib.nullcontext
    batch = batches(args, 1, seed=1)[0]
    if plan == "amp":
        region = lambda: torch.autocast("cpu", dtype=torch.bfloat16)   # noqa: E731
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    elif plan is not None:
        # the state and gradient release the plan chose, its modules' precisions and moves;
        # the step is the plan's backward (its micro-batches, its scaler where a module runs fp16)
        model, opt = plan.prepare(model, ampc.optim.AdamW, lr=1e-3)
        scaler = plan.scaler()

        def step():
            opt.zero_grad(set_to_none=True)
            plan.backward(model, opt, batch, lm_loss, scaler=scaler)
            H.optimizer_step(opt, scaler)
        return step
    else:
        opt = optimizer_for(args)(list(model.parameters()))
    inputs, y = batch

    def step():
        opt.zero_grad(set_to_none=True)
        with region():
            out = model(**inputs)
        lm_loss(out, y).backward()
        opt.step()
    return step


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--fractions", default="0.8,0.6,0.4", help="budgets as fractions of fp32's peak")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--optimizer", choices=("torch", "ampc"), default="torch",
                   help="torch.optim.AdamW, or ampc.optim.AdamW (the search may then free the "
                        "gradients in the backward)")
    p.add_argument("--of", choices=("fp32", "amp"), default="fp32",
                   help="budgets as fractions of fp32's peak or of torch.amp bf16's (fused AdamW)")
    args = p.parse_args()
    print(H.machine("cpu"))
    print(f"model: GPT-2 width {args.width}, {args.layers} layers, vocab {args.vocab}; batch "
          f"{args.batch} x {args.context}; {sum(p.numel() for p in fresh(args).parameters()) / 1e6:.2f}M params")
    # fp32's step as the search measures it (its first batch, AdamW): the budgets follow from it
    model = fresh(args)
    fp32_peak = ampc.memory.report(model, torch.optim.AdamW(model.parameters()), batches(args, 1)[0],
                                   lm_loss).peak
    model = fresh(args)
    amp_peak = ampc.memory.report(model, torch.optim.AdamW(model.parameters(), fused=True),
                                  batches(args, 1)[0], lm_loss, autocast=torch.bfloat16).peak
    print(f"fp32 step peak: {fp32_peak / MiB:.1f} MiB; torch.amp bf16 (fused AdamW): "
          f"{amp_peak / MiB:.1f} MiB; optimizer {args.optimizer}")
    of = fp32_peak if args.of == "fp32" else amp_peak
    plans = {}
    for f in [float(x) for x in args.fractions.split(",")]:
        t0 = time.perf_counter()
        with warnings.catch_warnings(record=True):
            warnings.simplefilter("always")
            plan = ampc.autoprecision.search(fresh(args), batches(args, 2), lm_loss, objective="memory",
                                             peak_bytes=int(f * of), repeats=1,
                                             optimizer=optimizer_for(args))
        s = time.perf_counter() - t0
        d, st = plan.peak, plan.step
        plans[f] = plan
        print(f"\nbudget {f:.2f} x {args.of} = {d.budget / MiB:.1f} MiB: {'met' if d.met else 'NOT met'}, "
              f"step peak {d.bytes / MiB:.1f} MiB ({d.bytes / fp32_peak:.2f}x fp32, "
              f"{d.bytes / amp_peak:.2f}x torch.amp; the fastest plan {d.fastest / MiB:.1f}), "
              f"{d.rounds} round(s), state {st.state}, gradients freed: {st.grads_freed}, search {s:.0f} s")
        print(f"  choices: {plan!r}; recomputed: {list(st.recompute) or 'none'}; logits "
              f"sliced in the loss: {list(st.sliced_head) or 'none'}")
        print("  notes: " + " | ".join(plan.data["notes"]))
    fns = {"fp32": stepper(args, None), "torch.amp": stepper(args, "amp")}
    fns.update({f"budget {f:.2f}": stepper(args, plan) for f, plan in plans.items()})
    times = H.time_reps(fns, "cpu", reps=args.reps, warm=True)
    print(f"\nstep time (forward + backward + AdamW), {args.reps} interleaved reps, median [q1, q3] ms, "
          "ratio to fp32's and to torch.amp's median:")
    base, amp = statistics.median(times["fp32"]), statistics.median(times["torch.amp"])
    for name, t in times.items():
        q = statistics.quantiles(t, n=4)
        print(f"  {name:12s} {statistics.median(t):8.1f} [{q[0]:.1f}, {q[2]:.1f}]  "
              f"{statistics.median(t) / base:.2f}x  {statistics.median(t) / amp:.2f}x")


if __name__ == "__main__":
    main()
