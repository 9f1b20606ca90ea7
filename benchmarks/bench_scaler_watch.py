"""What GradScaler's skip watch (explain_skips) costs a step that does not skip.

    python benchmarks/bench_scaler_watch.py [--device cpu|cuda] [--reps N]

One timed block is 50 iterations of scaler.step(optimizer) + scaler.update() on a few tiny
fp32 params (where per-step host overhead shows most), with the watch off
(explain_skips=None) and on (the default, 10), blocks interleaved. Two optimizers: torch's
AdamW(fused=True), where the watch copies the skip count to pinned host memory every 10
steps without waiting, and torch's SGD, where it counts the flag step() reads anyway.
Reported: the median microseconds per iteration and the spread (min-max over blocks).
"""
import argparse
import statistics
import time

import torch

import _harness as H

ampc = H.import_ampc()
SHAPES = [(64, 32), (64,), (16, 64), (16,)]
BLOCK = 50


def setup(make_opt, explain, dev):
    params = [torch.nn.Parameter(t) for t in H.randn_list(SHAPES, torch.float32, dev)]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    opt = make_opt(params)
    scaler = ampc.GradScaler(dev, init_scale=1.0, explain_skips=explain)
    scaler.scale(torch.ones((), device=dev))           # creates the scale on the device

    def block():
        for _ in range(BLOCK):
            scaler.step(opt)
            scaler.update()
        if dev == "cuda":
            torch.cuda.synchronize()
    return block


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--reps", type=int, default=40)
    args = p.parse_args()
    opts = {"AdamW(fused=True)": lambda ps: torch.optim.AdamW(ps, lr=1e-6, fused=True),
            "SGD": lambda ps: torch.optim.SGD(ps, lr=1e-6)}
    print(" | ".join(f"{k} {v}" for k, v in H.machine(args.device).items()))
    print("optimizer          | watch off us/it (min-max) | watch on us/it (min-max) | on/off")
    for name, make in opts.items():
        fns = {"off": setup(make, None, args.device), "on": setup(make, 10, args.device)}
        for fn in fns.values():
            fn()
        times = {k: [] for k in fns}
        for _ in range(args.reps):
            for k, fn in fns.items():
                t = time.perf_counter()
                fn()
                times[k].append((time.perf_counter() - t) * 1e6 / BLOCK)
        cell = {k: f"{statistics.median(v):7.1f} ({min(v):.1f}-{max(v):.1f})" for k, v in times.items()}
        ratio = statistics.median(times["on"]) / statistics.median(times["off"])
        print(f"{name:<18} | {cell['off']:<25} | {cell['on']:<24} | {ratio:.3f}")


if __name__ == "__main__":
    main()
