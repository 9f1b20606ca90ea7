"""The head and the loss of a language model: ampc.memory.linear_cross_entropy (logits a slice of
tokens at a time, the gradients taken in the forward) against torch's F.cross_entropy(F.linear(...)),
forward + backward under bf16 autocast, timed in interleaved reps; and the peak of live tensors of each.
The logits' rows have a standard deviation of about 1; the last case scales the weight up until most rows
spread further than 87 below their largest logit (a trained head's rows can), where torch's CPU exp of the
shifted logits leaves its normal range and takes a slow path.

    python benchmarks/bench_head_loss.py --threads 2 --reps 15
"""
import statistics

import torch
import torch.nn.functional as F

from _harness import common_args, import_ampc, parse, report, machine, time_reps

ampc = import_ampc()
from ampc.memory import linear_cross_entropy, peak  # noqa: E402

CASES = [(1024, 256, 4096, 1), (1024, 256, 8192, 1), (512, 512, 8192, 1), (4096, 512, 8192, 1),
         (2048, 512, 32768, 1), (512, 512, 8192, 40)]


def _setup(tokens, width, vocab, spread):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(tokens, width, generator=g).bfloat16()
    weight = (torch.randn(vocab, width, generator=g) * spread / width ** 0.5).bfloat16().requires_grad_()
    target = torch.randint(0, vocab, (tokens,), generator=g)
    return hidden, weight, target


def _torch_step(hidden, weight, target):
    h = hidden.detach().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = F.linear(h, weight)
    F.cross_entropy(logits.float(), target).backward()
    weight.grad = None


def _ampc_step(hidden, weight, target):
    h = hidden.detach().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = linear_cross_entropy(h, weight, target)
    loss.backward()
    weight.grad = None


def main():
    p = common_args(__doc__)
    args = parse(p)
    rows = []
    for tokens, width, vocab, spread in CASES:
        inputs = _setup(tokens, width, vocab, spread)
        fns = {"torch": lambda: _torch_step(*inputs), "ampc": lambda: _ampc_step(*inputs)}
        times = time_reps(fns, "cpu", args.reps, warm=True)
        ratios = sorted(t / a for t, a in zip(times["torch"], times["ampc"]))
        q1, med, q3 = statistics.quantiles(ratios, n=4)
        peaks = {}
        for name, fn in fns.items():
            prof = peak.start_profiler()
            fn()
            peak.stop_profiler(prof)
            peaks[name] = peak.allocated_peak(prof, torch.device("cpu")) / 2 ** 20
        rows.append({"tokens x width x vocab": f"{tokens} x {width} x {vocab}"
                     + (f", logits x {spread}" if spread != 1 else ""),
                     "torch ms": statistics.median(times["torch"]),
                     "ampc ms": statistics.median(times["ampc"]),
                     "torch/ampc median": med, "q1": q1, "q3": q3,
                     "torch peak MiB": peaks["torch"], "ampc peak MiB": peaks["ampc"]})
    hdr = machine("cpu")
    hdr["reps"] = len(times["torch"])
    report(hdr, rows, args.json, [
        "torch/ampc: torch's time over ampc's, per interleaved rep (above 1: ampc faster); "
        "peak: live tensors over one forward + backward, the inputs and weight excluded"])


if __name__ == "__main__":
    main()
