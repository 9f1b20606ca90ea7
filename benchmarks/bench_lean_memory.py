"""Peak memory of a whole training step of a GPT-2-shaped model: torch.amp, ampc master weights and
state="lean", in one run; and the persistent state bytes a parameter of every lean setting.

    python benchmarks/bench_lean_memory.py [--width 512] [--layers 4] [--vocab 8192] [--context 128] [--batch 4]

Model: transformers' GPT2LMHeadModel from a fresh GPT2Config (dropout 0; defaults: vocab 8192, width 512,
4 layers, 8 heads, context 128, about 21M params), random tokens. Each arm takes two steps (so its optimizer
state exists), then a third under torch.profiler(profile_memory=True). Peak = the tensor bytes alive when the
step starts (model params and optimizer state, grads set to None, from ampc.lean_state.state_bytes) + the highest running
sum of every CPU allocation and free the profiler records, in time order, from zero_grad to the end of optimizer.step()
(forward, loss, backward, step). Allocator caching and the process's own memory are not counted: it is the
bytes of live tensors, the CPU analogue of torch.cuda.max_memory_allocated.
"""
import argparse
import gc

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

import _harness as H

ampc = H.import_ampc()
from ampc.lean_state import state_bytes  # noqa: E402
from bench_lean_quality import LEAN      # noqa: E402

# name -> None (torch.amp) or ampc.prepare options: the lean settings of bench_lean_quality
ARMS = {"torch.amp + fused AdamW": None, **{("ampc master" if k == "master" else k): v for k, v in LEAN.items()}}
PEAK_ARMS = ("torch.amp + fused AdamW", "ampc master", 'state="lean"')


def gpt2(args):
    from transformers import GPT2Config, GPT2LMHeadModel
    cfg = GPT2Config(vocab_size=args.vocab, n_positions=args.context, n_embd=args.width, n_layer=args.layers,
                     n_head=args.width // 64, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                     bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(cfg)


def arm_step(name, args):
    torch.manual_seed(0)
    model = gpt2(args)
    opts = ARMS[name]
    if opts is None:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
        region = lambda: torch.autocast("cpu", dtype=torch.bfloat16)   # noqa: E731
    else:
        model, opt = ampc.prepare(model, ampc.optim.AdamW, torch.bfloat16, lr=1e-3, **opts)
        region = lambda: torch.autocast("cpu", enabled=False)         # noqa: E731
    x = torch.randint(0, args.vocab, (args.batch, args.context), generator=torch.Generator().manual_seed(0))

    def step():
        opt.zero_grad(set_to_none=True)
        with region():
            logits = model(input_ids=x).logits
        F.cross_entropy(logits.float()[:, :-1].reshape(-1, args.vocab), x[:, 1:].reshape(-1)).backward()
        opt.step()
    return model, opt, step


def peak_bytes(model, opt, step):
    """(persistent bytes at the step's start, peak bytes during the step)."""
    step()
    step()
    opt.zero_grad(set_to_none=True)   # freed before the profiler starts: it records no free of a block it saw no allocation of
    gc.collect()
    base = state_bytes(model, opt)["bytes"]
    start = sum(base.values())
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    # every allocation (+) and free (-) on its own, in time order (prof.events() folds those made
    # inside an op into the op)
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]")
    run = top = 0
    for _, nbytes in events:
        run += nbytes
        top = max(top, run)
    return start, start + top


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--batch", type=int, default=4)
    args = p.parse_args()
    hdr = H.machine("cpu")
    print(" | ".join(f"{k} {v}" for k, v in hdr.items()))
    n = sum(q.numel() for q in gpt2(args).parameters())
    print(f"GPT-2-shaped: {n / 1e6:.1f}M params, width {args.width}, {args.layers} layers, vocab {args.vocab}, "
          f"batch {args.batch} x context {args.context}")
    print(f"{'arm':24} {'state B/param':>13} {'(w/g/master|comp/moments/scales)':>34} {'state MiB':>9} "
          f"{'peak MiB':>9} {'peak vs amp':>11}")
    amp_peak = None
    for name in ARMS:
        model, opt, step = arm_step(name, args)
        if name in PEAK_ARMS:
            start, peak = peak_bytes(model, opt, step)
        else:
            step()
            start, peak = sum(state_bytes(model, opt)["bytes"].values()), None
        per = state_bytes(model, opt)["per_param"]
        parts = "/".join(f"{per[k]:.2f}" for k in ("weights", "grads")) + "/" + \
            f"{per['masters'] + per['compensation']:.2f}/{per['moments']:.2f}/{per['scales']:.3f}"
        amp_peak = peak if amp_peak is None else amp_peak
        print(f"{name:24} {sum(per.values()):13.2f} {parts:>34} {start / 2**20:9.1f} "
              + (f"{peak / 2**20:9.1f} {peak / amp_peak:11.2f}" if peak else f"{'-':>9} {'-':>11}"), flush=True)
        del model, opt, step
        gc.collect()


if __name__ == "__main__":
    main()
