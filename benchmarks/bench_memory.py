"""Peak memory and step time of a GPT-2-shaped (or ResNet-18) training step, side by side in one run: torch's
step, torch's whole-block checkpointing, ampc's lean state, and ampc's lean state with chosen modules recomputed,
saved activations in 8 bits and gradients freed in the backward.

    python benchmarks/bench_memory.py [--model gpt2|resnet18]
                                      [--sizes 4x128,16x256] [--reps 5] [--compute fp32|bf16]
                                      [--recompute transformer.h.*.mlp.act] [--compress transformer.h.*]
                                      [--report-dir DIR] [--compile]
                                      [--width 512] [--layers 4] [--vocab 8192]

Model: bench_lean_memory.py's (transformers' GPT2LMHeadModel, width 512, 4 layers, vocab 8192, dropout 0), with
its KV cache off (a training step does not use it; on, it holds every layer's keys and values), random tokens,
next-token cross-entropy. Arms:
- torch: torch.optim.AdamW(fused=True); with --compute bf16 the forward under torch.autocast(bf16) (torch.amp).
- torch + block checkpoint: the same, every transformer block run through torch.utils.checkpoint (non-reentrant).
- ampc lean: ampc.optim.AdamW(state="lean") (8-bit moments) on the fp32 weights; with --compute bf16,
  ampc.prepare(model, AdamW, bf16, state="lean") (bf16 weights, no master copy).
- ampc lean + recompute: the same, and ampc.memory.recompute(model, the --recompute patterns).
- ampc lean + 8-bit saved: ampc lean, and ampc.memory.compress(model, the --compress patterns, "8bit"): what those
  modules save for the backward kept in 8 bits; "+ recompute": both; "+ grads freed": and the optimizer steps
  each parameter in the backward and frees its gradient there (AdamW(step_in_backward=True)); "+ sliced head": and
  the head's matmul with the loss a slice of tokens at a time (ampc.memory.linear_cross_entropy).
--compute fp32 (the default) because on a CPU without native bf16 (AVX2 only) a bf16 matmul is emulated and a
step takes ~10x longer. Peak: ampc.memory.report (the live-tensor bytes at the step's highest point, measured from
the tensors and the profiler's allocations, not the allocator's cache), after one warm-up step. Time: the step
alone (no profiler), reps interleaved across the arms, median and quartiles; beside it the 1-minute load average
at the end of the timed reps (another process on the machine slows every arm).

--compile: every arm's model through torch.compile (after its memory handles are set; the warm-up step compiles).

--model resnet18: torchvision's resnet18(num_classes=10) on random 64x64 images, random labels, cross-entropy;
--sizes are batch sizes (default 32). Its arms: torch (fused AdamW; torch.amp with --compute bf16); torch + layer
checkpoint (each of layer1..layer4 through torch.utils.checkpoint, non-reentrant); ampc lean; + recompute
(ampc.memory.recompute of layer1..layer4); + 8-bit saved (ampc.memory.compress of the stem and layer1..layer4);
+ grads freed; + recompute (layers both compressed and recomputed keep only their inputs, in 8 bits). A 10-class
head has nothing to slice. A recomputed (checkpointed) layer's batch norms update their running statistics twice
a step, as with torch's checkpoint anywhere.
"""
import argparse
import functools
import os
import statistics
import time

import torch
import torch.nn.functional as F
import torch.utils.checkpoint

import _harness as H

ampc = H.import_ampc()
import ampc.memory  # noqa: E402
from bench_lean_memory import gpt2  # noqa: E402

ARMS = {"gpt2": ("torch", "torch + block checkpoint", "ampc lean", "ampc lean + recompute", "ampc lean + 8-bit saved",
                 "ampc lean + 8-bit saved + recompute", "ampc lean + 8-bit saved + recompute + grads freed",
                 "ampc lean + 8-bit saved + recompute + grads freed + sliced head"),
        "resnet18": ("torch", "torch + layer checkpoint", "ampc lean", "ampc lean + recompute",
                     "ampc lean + 8-bit saved", "ampc lean + 8-bit saved + grads freed",
                     "ampc lean + 8-bit saved + recompute + grads freed")}
# per model: the default --sizes, --recompute and --compress
DEFAULTS = {"gpt2": ("4x128,16x256", ["transformer.h.*.mlp.act"], ["transformer.h.*"]),
            "resnet18": ("32", ["layer*"], ["conv1", "bn1", "relu", "maxpool", "layer*"])}


class Body(torch.nn.Module):
    """The model without its head's matmul: the last hidden states, for a loss that applies the head itself."""

    def __init__(self, lm):
        super().__init__()
        self.lm = lm

    def forward(self, input_ids):
        return self.lm.transformer(input_ids=input_ids).last_hidden_state


class Checkpointed(torch.nn.Module):
    """A block (a transformer block, a ResNet layer) run through torch's non-reentrant checkpoint."""

    def __init__(self, block):
        super().__init__()
        self.block = block

    def forward(self, *args, **kwargs):
        return torch.utils.checkpoint.checkpoint(functools.partial(self.block, **kwargs), *args,
                                                 use_reentrant=False)


def gpt2_step(args, size):
    """(model, inputs, target, loss_fn, the blocks torch's arm checkpoints) of the GPT-2-shaped step."""
    batch, context = size
    model = gpt2(argparse.Namespace(vocab=args.vocab, context=context, width=args.width, layers=args.layers,
                                    batch=batch))
    model.config.use_cache = False
    x = torch.randint(0, args.vocab, (batch, context), generator=torch.Generator().manual_seed(0))

    def loss_fn(out, tokens):
        return F.cross_entropy(out.logits.float()[:, :-1].reshape(-1, args.vocab), tokens[:, 1:].reshape(-1))
    return model, {"input_ids": x}, x, loss_fn, [f"transformer.h.{i}" for i in range(args.layers)]


def resnet18_step(args, size):
    """The same for torchvision's ResNet-18: a batch of random 64x64 images, random labels."""
    import torchvision     # here: the GPT-2 runs do not need it
    (batch,) = size
    model = torchvision.models.resnet18(num_classes=10)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(batch, 3, 64, 64, generator=g), torch.randint(0, 10, (batch,), generator=g)
    return model, x, y, lambda out, y: F.cross_entropy(out.float(), y), ["layer1", "layer2", "layer3", "layer4"]


def arm(name, args, size):
    """(model, optimizer, step, batch, loss_fn) of one arm, from the same weights."""
    torch.manual_seed(0)
    model, inputs, target, loss_fn, blocks = (gpt2_step if args.model == "gpt2" else resnet18_step)(args, size)
    bf16 = args.compute == "bf16"
    if name.startswith("torch"):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
        if bf16:   # torch.amp: the model's forward under autocast, the loss outside it (as bench_lean_memory)
            model.forward = torch.autocast("cpu", dtype=torch.bfloat16)(model.forward)
        if "checkpoint" in name:
            for b in blocks:
                model.set_submodule(b, Checkpointed(model.get_submodule(b)))
    elif bf16:
        model, opt = ampc.prepare(model, ampc.optim.AdamW, torch.bfloat16, lr=1e-3, state="lean",
                                  step_in_backward="grads freed" in name)
    else:
        opt = ampc.optim.AdamW(model.parameters(), lr=1e-3, state="lean", step_in_backward="grads freed" in name)
    if "recompute" in name:
        ampc.memory.recompute(model, args.recompute)
    if "8-bit saved" in name:
        ampc.memory.compress(model, args.compress, "8bit")

    if name.endswith("sliced head"):    # the head's matmul and the loss a slice of tokens at a time
        head = model.lm_head.weight
        model = Body(model)

        def loss_fn(out, tokens):       # noqa: F811
            return ampc.memory.linear_cross_entropy(out[:, :-1], head, tokens[:, 1:])

    if args.compile:    # after ampc.memory's handles are set, as a user would compile
        model = torch.compile(model)

    def step():
        opt.zero_grad(set_to_none=True)
        out = model(**inputs) if isinstance(inputs, dict) else model(inputs)
        loss_fn(out, target).backward()
        opt.step()
    return model, opt, step, (inputs, target), loss_fn


def run_size(args, size):
    arms, rows = {}, []
    label = " x ".join(map(str, size))
    for name in ARMS[args.model]:
        model, opt, step, data, loss_fn = arm(name, args, size)
        r = ampc.memory.report(model, opt, data, loss_fn, warmup=1)
        arms[name] = (step, r)
        if args.report_dir:     # each arm's memory report: the table and the picture
            arm_name = name.replace(" ", "_").replace("+", "and")
            stem = f"{args.report_dir}/{args.model}_{label.replace(' ', '')}_{arm_name}"
            with open(stem + ".txt", "w") as f:
                f.write(f"{name}, {args.model} {args.size_key} {label}, {args.compute} compute\n{r.table(12)}\n")
            r.plot(stem + ".png", 12, title=f"{args.model}, {label}, {args.compute}: {name}")
        print(f"  {name}: peak {r.peak / 2**20:.1f} MiB measured", flush=True)
    times = {name: [] for name in arms}
    for _ in range(args.reps):                 # interleaved: a busy machine slows every arm alike
        for name, (step, _) in arms.items():
            t = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - t)
    load = os.getloadavg()[0]
    base_peak, base_t = arms["torch"][1].peak, statistics.median(times["torch"])
    for name, (_, r) in arms.items():
        q = statistics.quantiles(times[name], n=4) if len(times[name]) > 1 else times[name] * 3
        rows.append({args.size_key: label, "arm": name, "peak MiB": r.peak / 2**20,
                     "peak vs torch": r.peak / base_peak, "saved act MiB": sum(r.saved.values()) / 2**20,
                     "peak in": r.phase, "step s (median)": q[1], "q1": q[0], "q3": q[2],
                     "time vs torch": q[1] / base_t, "load 1m": load})
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", choices=tuple(ARMS), default="gpt2")
    p.add_argument("--sizes", help="batch x context pairs, comma-separated (default 4x128,16x256); "
                   "with --model resnet18 batch sizes of 64x64 images (default 32)")
    p.add_argument("--reps", type=int, default=5, help="timed steps per arm and size")
    p.add_argument("--compute", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--recompute", action="append", help="module patterns the last arm recomputes "
                   "(repeatable; default: transformer.h.*.mlp.act; resnet18: layer*)")
    p.add_argument("--compress", action="append", help="module patterns the 8-bit arms compress (repeatable; "
                   "default: transformer.h.*, each block; resnet18: conv1, bn1, relu, maxpool, layer*)")
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--report-dir", help="write each arm's memory report (table .txt and picture .png) here")
    p.add_argument("--compile", action="store_true",
                   help="every arm's model through torch.compile (its memory handles set first)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    sizes, recompute, compress = DEFAULTS[args.model]
    args.sizes, args.recompute = args.sizes or sizes, args.recompute or recompute
    args.compress = args.compress or compress
    args.size_key = "batch x context" if args.model == "gpt2" else "batch (64x64)"
    hdr = H.machine("cpu")
    hdr.update(model=args.model, compute=args.compute, compiled=args.compile, recompute=",".join(args.recompute),
               compress=",".join(args.compress), reps=args.reps)
    rows = []
    for size in args.sizes.split(","):
        size = tuple(int(v) for v in size.split("x"))
        print(" x ".join(map(str, size)) + ":", flush=True)
        rows += run_size(args, size)
    H.report(hdr, rows, args.json, [])


if __name__ == "__main__":
    main()
