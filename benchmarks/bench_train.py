"""End to end: a small GPT-style model trained by two like-for-like pairs, in one process.

    python benchmarks/bench_train.py [--steps 30] [--size auto|full|small] [--device cpu|cuda] [--threads N]
                                     [--json]

  drop-in pair   fp32 weights, the three-name swap:
    torch.amp      torch.autocast + torch.amp.GradScaler + torch.optim.AdamW(fused=True)
    ampc.amp       ampc.autocast + ampc.GradScaler + ampc.optim.AdamW
  master pair    bf16 weights (norm layers fp32) trained through fp32 master weights:
    torch master   torch's nearest equivalent: the grads upcast into fp32 buffers, torch.optim.AdamW(fused=True)
                   on fp32 copies of the weights, the copies cast back into the bf16 weights
    ampc master    ampc.prepare + ampc.optim.AdamW: one fused pass reads the bf16 grads and writes the weights
  fp32           context: fp32 weights, torch.optim.AdamW(fused=True), no autocast

Autocast runs bf16 on the CPU and fp16 on CUDA; the master pair is bf16 on both. All arms start from the same
seeded fp32 model and see the same data. Each step runs every arm once, in an order that rotates from step to
step, so that the drift of a shared machine hits every arm alike; ms/step is the median over the steps after
the warm-up (forward, backward and optimizer step), "optimizer ms" the median of the optimizer step alone.
Before any time is printed, each pair's losses are compared step by step: the first step's losses must be
equal bit for bit (the same forward), and every later one within LOSS_RTOL (torch's fused AdamW rounds the
last numel % 16 elements of each tensor differently, see tests/optim/test_adam.py, so the weights drift apart by
ulps). "state MiB" counts the bytes of weights, grads and optimizer state (masters, moments, torch's fp32
grad buffers) per arm.

Size: "full" is a 3.5M-parameter model (4 layers, width 256, seq 128, batch 16); "small" (2 layers, width 128,
seq 64, batch 8) keeps the run quick where torch's bf16 matmul is slow: on a CPU without AVX-512 it is about
10x slower than fp32, which is what mixed precision then costs instead of buys. "auto" picks full when
torch.backends.cpu.get_cpu_capability() reports AVX-512 (or on CUDA), small otherwise.
"""
import argparse
import contextlib
import copy
import statistics
import sys
import time

import torch
from torch import nn

import _harness as H

ampc = H.import_ampc()

SIZES = {"full": dict(vocab=512, width=256, layers=4, heads=4, seq=128, batch=16),
         "small": dict(vocab=512, width=128, layers=2, heads=4, seq=64, batch=8)}
LR = 3e-3
LOSS_RTOL = 1e-3
PAIRS = (("torch.amp", "ampc.amp"), ("torch master", "ampc master"))


class Block(nn.Module):
    def __init__(self, c):
        super().__init__()
        w, seq = c["width"], c["seq"]
        self.ln1, self.ln2 = nn.LayerNorm(w), nn.LayerNorm(w)
        self.attn = nn.MultiheadAttention(w, c["heads"], batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(w, 4 * w), nn.GELU(), nn.Linear(4 * w, w))
        self.register_buffer("mask", torch.triu(torch.full((seq, seq), float("-inf")), 1))

    def forward(self, x):
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=self.mask.to(h.dtype), need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.tok = nn.Embedding(c["vocab"], c["width"])
        self.pos = nn.Parameter(torch.randn(c["seq"], c["width"]) * 0.02)
        self.blocks = nn.Sequential(*[Block(c) for _ in range(c["layers"])])
        self.ln = nn.LayerNorm(c["width"])
        self.head = nn.Linear(c["width"], c["vocab"], bias=False)

    def forward(self, idx):
        x = self.tok(idx) + self.pos.to(self.tok.weight.dtype)
        return self.head(self.ln(self.blocks(x)))


def data(step, c, device):
    """A learnable synthetic language: each token is a fixed function of the two before it."""
    g = torch.Generator().manual_seed(step)
    vocab, seq = c["vocab"], c["seq"]
    tokens = torch.randint(0, vocab, (c["batch"], seq + 1), generator=g)
    for t in range(2, seq + 1):
        tokens[:, t] = (tokens[:, t - 1] * 7 + tokens[:, t - 2] * 3 + 1) % vocab
    return tokens[:, :-1].to(device), tokens[:, 1:].to(device)


class TorchMasters:
    """torch's nearest equivalent of master-weight training, on a model prepared like ampc.prepare's (16-bit
    weights and buffers, norm layers fp32 with their inputs cast up and outputs back down): fp32 copies of the
    16-bit weights, seeded from the fp32 values, stepped by AdamW(fused=True) together with the fp32 norm
    weights, fed upcast grads and cast back after the step."""

    def __init__(self, model, low):
        self.low = [p for p in model.parameters() if p.dtype == low]
        fp32 = [p for p in model.parameters() if p.dtype == torch.float32]
        self.masters = [nn.Parameter(p.detach().float()) for p in self.low]
        self.grads32 = [torch.zeros_like(m) for m in self.masters]
        for m, g in zip(self.masters, self.grads32):
            m.grad = g
        self.opt = torch.optim.AdamW(self.masters + fp32, lr=LR, fused=True)
        self.model = model

    def zero_grad(self):
        self.model.zero_grad()

    def step(self):
        torch._foreach_copy_(self.grads32, [p.grad for p in self.low])
        self.opt.step()
        torch._foreach_copy_([p.data for p in self.low], self.masters)


def torch_prepared(model, low):
    """The model with its weights and buffers in `low` except the norm layers', as ampc.prepare leaves it; the
    fp32 weights are returned too, to seed the masters from."""
    fp32 = {id(p): p.detach().clone() for p in model.parameters()}
    model.to(low)
    for m in model.modules():
        if isinstance(m, nn.LayerNorm):
            m.float()
            m.register_forward_pre_hook(lambda mod, args: tuple(a.float() for a in args))
            m.register_forward_hook(lambda mod, args, out: out.to(low))
    return model, fp32


def make_arms(c, device):
    """{name: (model, optimizer, autocast context factory, scaler or None)}"""
    amp_dtype = torch.float16 if device == "cuda" else torch.bfloat16
    torch.manual_seed(0)
    base = TinyGPT(c).to(device)
    arms = {}
    m = copy.deepcopy(base)
    arms["fp32"] = (m, torch.optim.AdamW(m.parameters(), lr=LR, fused=True), contextlib.nullcontext, None)
    m = copy.deepcopy(base)
    arms["torch.amp"] = (m, torch.optim.AdamW(m.parameters(), lr=LR, fused=True),
                         lambda: torch.autocast(device, dtype=amp_dtype), torch.amp.GradScaler(device))
    m = copy.deepcopy(base)
    arms["ampc.amp"] = (m, ampc.optim.AdamW(m.parameters(), lr=LR),
                        lambda: ampc.autocast(device, dtype=amp_dtype), ampc.GradScaler(device))
    m, fp32 = torch_prepared(copy.deepcopy(base), torch.bfloat16)
    tm = TorchMasters(m, torch.bfloat16)
    for p, master in zip(tm.low, tm.masters):   # masters start from the fp32 values, as ampc.prepare's do
        master.data.copy_(fp32[id(p)])
    arms["torch master"] = (m, tm, contextlib.nullcontext, None)
    m, opt = ampc.prepare(copy.deepcopy(base), ampc.optim.AdamW, torch.bfloat16, lr=LR)
    arms["ampc master"] = (m, opt, contextlib.nullcontext, None)
    return arms


def train_step(arm, x, y, vocab, sync):
    """One step; returns (loss, ms for the whole step, ms for the optimizer step)."""
    model, opt, autocast, scaler = arm
    sync()
    t0 = time.perf_counter()
    opt.zero_grad()
    with autocast():
        logits = model(x)
    loss = nn.functional.cross_entropy(logits.float().reshape(-1, vocab), y.reshape(-1))
    (scaler.scale(loss) if scaler else loss).backward()
    sync()
    t1 = time.perf_counter()
    if scaler:
        scaler.step(opt)
        scaler.update()
    else:
        opt.step()
    sync()
    t2 = time.perf_counter()
    return loss.item(), (t2 - t0) * 1e3, (t2 - t1) * 1e3


def state_mib(arm):
    model, opt, _, _ = arm
    tensors = {id(t): t for t in model.parameters()}
    tensors.update({id(p.grad): p.grad for p in model.parameters() if p.grad is not None})
    inner = opt.opt if isinstance(opt, TorchMasters) else opt
    for group in inner.param_groups:
        for p in group["params"]:
            for t in [p, p.grad] + list(inner.state[p].values()):
                if isinstance(t, torch.Tensor):
                    tensors[id(t)] = t
    return sum(t.nbytes for t in tensors.values()) / 2**20


def check_pairs(losses) -> str:
    """"" when each pair's losses agree: the first bit for bit, the rest within LOSS_RTOL."""
    for a, b in PAIRS:
        la, lb = losses[a], losses[b]
        if la[0] != lb[0]:
            return f"{a} vs {b}: first loss {la[0]!r} vs {lb[0]!r}, expected the same bits"
        worst = max(range(len(la)), key=lambda k: abs(la[k] - lb[k]) / abs(la[k]))
        if abs(la[worst] - lb[worst]) > LOSS_RTOL * abs(la[worst]):
            return f"{a} vs {b}: loss at step {worst} is {la[worst]!r} vs {lb[worst]!r}, beyond rtol {LOSS_RTOL}"
    return ""


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5, help="steps left out of the medians")
    p.add_argument("--size", choices=["auto", *SIZES], default="auto")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--json", action="store_true")
    p.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0: torch's default)")
    args = H.parse(p)
    if args.steps <= args.warmup:
        p.error("--steps must exceed --warmup")
    isa = "cuda" if args.device == "cuda" else torch.backends.cpu.get_cpu_capability()
    size = args.size if args.size != "auto" else ("full" if "AVX512" in isa or isa == "cuda" else "small")
    c = SIZES[size]
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    arms = make_arms(c, args.device)
    names = list(arms)
    losses, step_ms, opt_ms = ({n: [] for n in names} for _ in range(3))
    for k in range(args.steps):
        x, y = data(k, c, args.device)
        r = k % len(names)
        for n in names[r:] + names[:r]:
            loss, total, opt = train_step(arms[n], x, y, c["vocab"], sync)
            losses[n].append(loss)
            step_ms[n].append(total)
            opt_ms[n].append(opt)
    err = check_pairs(losses)
    if err:
        print(f"FAIL {err}", file=sys.stderr)
        return 1
    print(f"losses agree: first step bit for bit, every step within rtol {LOSS_RTOL}", file=sys.stderr)
    med = {n: statistics.median(step_ms[n][args.warmup:]) for n in names}
    partner = {b: a for a, b in PAIRS} | {a: a for a, _ in PAIRS} | {"fp32": "fp32"}
    last = lambda n: sum(losses[n][-10:]) / len(losses[n][-10:])  # noqa: E731
    ratio = lambda n: f"{med[partner[n]] / med[n]:.3f}" if n.startswith("ampc") else "-"  # noqa: E731
    diff = lambda n: (f"{max(abs(u - v) / abs(v) for u, v in zip(losses[n], losses[partner[n]])):.1e}"  # noqa: E731
                      if n.startswith("ampc") else "-")
    rows = [{"setup": n, "ms/step": med[n], "torch/ampc": ratio(n),
             "optimizer ms": statistics.median(opt_ms[n][args.warmup:]), "state MiB": state_mib(arms[n]),
             "first loss": losses[n][0], "last-10 loss": last(n), "loss vs fp32": last(n) / last("fp32"),
             "max loss diff vs pair": diff(n)}
            for n in names]
    hdr = H.machine(args.device)
    hdr.update(size=size, model=f"{c['layers']} layers, width {c['width']}, seq {c['seq']}, batch {c['batch']}, "
                     f"{sum(p.numel() for p in arms['fp32'][0].parameters()) / 1e6:.2f}M params",
               steps=args.steps, warmup=args.warmup)
    H.report(hdr, rows, args.json, [
        "torch/ampc: the pair's torch ms/step over this row's (> 1: ampc faster); fp32 is context, no pair",
        f"pairs checked before this table is printed: first loss bit for bit, every step within rtol {LOSS_RTOL}; "
        "max loss diff vs pair: the largest relative difference seen",
        "state MiB: weights + grads + optimizer state (masters, moments, fp32 grad buffers)"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
