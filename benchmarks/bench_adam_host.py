"""Host time of ampc.optim.AdamW.step() on many params, the kernel excluded.

    python benchmarks/bench_adam_host.py [--params N] [--reps R]

A found_inf of 1 makes the kernel return at once, after the binding has taken and checked
every tensor: what is left is step()'s Python and the crossing into C, the cost that grows
with the number of params whatever the size of the update. Printed per case: the median
microseconds of one step() and per param; bf16 params with fp32 master weights, and fp32
params, of 16 elements each.
"""
import argparse
import statistics
import time

import torch

import _harness as H

ampc = H.import_ampc()


def host_us(opt, reps):
    opt.grad_scale = torch.ones(1)
    opt.found_inf = torch.ones(1)       # the kernel skips the step after every check
    opt.step()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e6


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--params", type=int, default=1000)
    p.add_argument("--reps", type=int, default=200)
    args = p.parse_args()
    print(f"{'case':<28}{'us/step':>10}{'us/param':>10}")
    for name, dtype in (("bf16 + fp32 masters", torch.bfloat16), ("fp32", torch.float32)):
        params = [torch.nn.Parameter(torch.randn(16, dtype=dtype)) for _ in range(args.params)]
        for q in params:
            q.grad = torch.randn_like(q)
        opt = ampc.optim.AdamW(params, lr=1e-3)
        opt.step()                          # the state exists before timing
        us = host_us(opt, args.reps)
        print(f"{name + f' x{args.params}':<28}{us:>10.0f}{us / args.params:>10.2f}")


if __name__ == "__main__":
    main()
