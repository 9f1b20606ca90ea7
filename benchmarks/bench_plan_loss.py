"""What the loss unit of ampc.autoprecision buys on a large vocabulary: the plan's choice for the
loss, and a training step's peak memory and time with the loss at fp32 against at that choice.

    python benchmarks/bench_plan_loss.py [--vocab 50257] [--width 256] [--layers 2] [--context 128] [--batch 4]

Model: bench_lean_memory's GPT2LMHeadModel (a fresh GPT2Config, dropout 0, a head a 64 wide), random tokens. search() with the
memory objective (fp32 and bf16) picks every module's precision and the loss's; the step is then run twice
per arm, the modules as the plan chose, the loss at fp32 (what torch.amp does: autocast keeps cross-entropy in
fp32) and at the plan's choice: peak = the tensor bytes alive at the step's start + the highest running sum of
the allocations the profiler records during it (bench_lean_memory.peak_bytes); time = the median [q1, q3] of
interleaved reps of forward + loss + backward + AdamW step.
"""
import argparse
import gc
import statistics
import time

import torch
import torch.nn.functional as F

import _harness as H

ampc = H.import_ampc()
from bench_lean_memory import gpt2, peak_bytes  # noqa: E402


def lm_loss(out, tokens):
    logits = out.logits
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def batch(args, k):
    x = torch.randint(0, args.vocab, (args.batch, args.context), generator=torch.Generator().manual_seed(k))
    return x, x


def arm(plan, choice, args):
    """(model, optimizer, step) with the plan's modules and the loss at ``choice``."""
    torch.manual_seed(0)
    model = gpt2(args)
    plan.apply(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    loss_fn = ampc.autoprecision._loss.AtPrecision(lm_loss, choice, "cpu")
    x, y = batch(args, 0)

    def step():
        opt.zero_grad(set_to_none=True)
        with plan.autocast():
            out = model(input_ids=x)
        loss = loss_fn(out, y)
        loss.backward()
        opt.step()
        return loss
    return model, opt, step


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--vocab", type=int, default=50257)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--reps", type=int, default=8)
    args = p.parse_args()
    hdr = H.machine("cpu")
    print(" | ".join(f"{k} {v}" for k, v in hdr.items()))
    torch.manual_seed(0)
    model = gpt2(args)
    n = sum(q.numel() for q in model.parameters())
    print(f"GPT-2-shaped: {n / 1e6:.1f}M params, width {args.width}, {args.layers} layers, vocab {args.vocab}, "
          f"batch {args.batch} x context {args.context}")
    t0 = time.perf_counter()
    plan = ampc.autoprecision.search(model, [batch(args, 100 + k) for k in range(2)], lm_loss,
                                     candidates=("fp32", "bf16"), objective="memory", repeats=1)
    print(f"search {time.perf_counter() - t0:.1f} s; modules: "
          + ", ".join(f"{sum(c == k for c in plan.choices.values())} {k}" for k in ("bf16", "fp32")))
    u = plan.loss_unit
    for c, r in u.options.items():
        print(f"  loss at {c}: loss err {r['loss_err']:.2e}, dgrad err {r['dgrad_err']:.2e} "
              f"(fp32's batch-to-batch spread {r['dgrad_noise']:.2f}), {r['bytes'] / 2**20:.1f} MiB of logits, "
              f"{r['ms']:.1f} ms" + (f"  rejected: {u.rejected[c]}" if c in u.rejected else ""))
    print(f"  chosen: {u.choice}")
    arms = {"loss fp32": "fp32", f"loss {u.choice} (plan)": u.choice}
    steps, peaks, losses = {}, {}, {}
    for name, c in arms.items():
        m, opt, step = arm(plan, c, args)
        start, peak = peak_bytes(m, opt, step)
        peaks[name] = (start, peak)
        steps[name] = step
        losses[name] = float(step().detach())
        gc.collect()
    times = {name: [] for name in arms}
    for _ in range(args.reps):                      # interleaved: a busy machine slows both alike
        for name, step in steps.items():
            t = time.perf_counter()
            step()
            times[name].append(1e3 * (time.perf_counter() - t))
    print(f"{'arm':22} {'peak MiB':>9} {'vs fp32':>8} {'step ms median [q1, q3]':>26} {'loss':>9}")
    base = peaks["loss fp32"][1]
    for name in arms:
        q = statistics.quantiles(times[name], n=4)
        print(f"{name:22} {peaks[name][1] / 2**20:9.1f} {peaks[name][1] / base:8.2f} "
              f"{statistics.median(times[name]):10.1f} [{q[0]:.1f}, {q[2]:.1f}]    {losses[name]:9.4f}")


if __name__ == "__main__":
    main()
