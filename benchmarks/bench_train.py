"""End to end: train a small GPT-style language model three ways and compare.

    python benchmarks/bench_train.py [--steps 60] [--device cpu|cuda] [--threads N] [--json]

  fp32        fp32 weights, torch.optim.AdamW(fused=True)
  torch.amp   fp32 weights, torch.autocast(bf16 on CPU, fp16 on CUDA + torch.amp.GradScaler),
              torch.optim.AdamW(fused=True): the usual mixed-precision setup
  ampc        ampc.prepare: bf16 weights (norms fp32) with fp32 master weights in
              ampc.optim.AdamW, one fused C pass per step for the whole update (on CUDA:
              fp16 weights and ampc.GradScaler)

Each setup runs in its own process on the same seeded data, so its peak memory (max RSS on
the CPU, torch.cuda.max_memory_allocated on CUDA) is its own. Reported: median ms per
training step (forward, backward, optimizer) after warm-up, the time of the optimizer step
alone, peak memory, and the mean loss of the last 10 steps next to fp32's.
"""
import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

import torch
from torch import nn

import _harness as H

VOCAB, WIDTH, LAYERS, HEADS, SEQ, BATCH = 512, 256, 4, 4, 128, 16


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.attn = nn.MultiheadAttention(WIDTH, HEADS, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH))
        self.register_buffer("mask", torch.triu(torch.full((SEQ, SEQ), float("-inf")), 1))

    def forward(self, x):
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=self.mask.to(h.dtype), need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, WIDTH)
        self.pos = nn.Parameter(torch.randn(SEQ, WIDTH) * 0.02)
        self.blocks = nn.Sequential(*[Block() for _ in range(LAYERS)])
        self.ln = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, idx):
        x = self.tok(idx) + self.pos.to(self.tok.weight.dtype)
        return self.head(self.ln(self.blocks(x)))


def data(step, device):
    """A learnable synthetic language: each token is a fixed function of the two before it."""
    g = torch.Generator().manual_seed(step)
    seq = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    for t in range(2, SEQ + 1):
        seq[:, t] = (seq[:, t - 1] * 7 + seq[:, t - 2] * 3 + 1) % VOCAB
    return seq[:, :-1].to(device), seq[:, 1:].to(device)


def run_one(setup, steps, device):
    ampc = H.import_ampc()
    torch.manual_seed(0)
    model = TinyGPT().to(device)
    low = torch.float16 if device == "cuda" else torch.bfloat16
    scaler = None
    if setup == "ampc":
        model, opt = ampc.prepare(model, ampc.optim.AdamW, low, lr=3e-3)
        if low == torch.float16:
            scaler = ampc.GradScaler(device)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3, fused=True)
        if setup == "torch.amp" and low == torch.float16:
            scaler = torch.amp.GradScaler(device)
    autocast = setup == "torch.amp"
    losses, step_ms, opt_ms = [], [], []
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    for k in range(steps):
        x, y = data(k, device)
        sync()
        t0 = time.perf_counter()
        opt.zero_grad()
        with torch.autocast(device, dtype=low, enabled=autocast):
            logits = model(x)
        loss = nn.functional.cross_entropy(logits.float().reshape(-1, VOCAB), y.reshape(-1))
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
        losses.append(loss.item())
        step_ms.append((t2 - t0) * 1e3)
        opt_ms.append((t2 - t1) * 1e3)
    warm = steps // 3
    peak = (torch.cuda.max_memory_allocated() / 2**20 if device == "cuda"
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    return {"setup": setup, "ms/step": statistics.median(step_ms[warm:]),
            "optimizer ms": statistics.median(opt_ms[warm:]), "peak MiB": peak,
            "first loss": losses[0], "last-10 loss": sum(losses[-10:]) / len(losses[-10:]),
            "params M": sum(p.numel() for p in model.parameters()) / 1e6}


def main():
    p = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--json", action="store_true")
    p.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0: default)")
    p.add_argument("--one", help=argparse.SUPPRESS)     # run one setup in this process
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.one:
        print(json.dumps(run_one(args.one, args.steps, args.device)))
        return 0
    rows = []
    for setup in ("fp32", "torch.amp", "ampc"):
        out = subprocess.run([sys.executable, __file__, "--one", setup, "--steps", str(args.steps),
                              "--device", args.device, "--threads", str(args.threads)],
                             capture_output=True, text=True, env=dict(os.environ))
        if out.returncode != 0:
            print(f"FAIL {setup}:\n{out.stderr[-3000:]}", file=sys.stderr)
            return 1
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    base = {r["setup"]: r for r in rows}
    for r in rows:
        r["vs torch.amp"] = base["torch.amp"]["ms/step"] / r["ms/step"]
        r["loss vs fp32"] = r["last-10 loss"] / base["fp32"]["last-10 loss"]
    hdr = {"torch": torch.__version__, "device": args.device, "threads": torch.get_num_threads(),
           "model": f"{LAYERS} layers, width {WIDTH}, seq {SEQ}, batch {BATCH}", "steps": args.steps}
    notes = ["vs torch.amp: torch.amp's ms/step over this setup's (> 1: faster); "
             "loss vs fp32: last-10 mean loss over fp32's (1.0: tracks it)",
             "peak MiB: max RSS of the process on the CPU (includes torch itself), "
             "torch.cuda.max_memory_allocated on CUDA"]
    if args.json:
        print(json.dumps({"header": hdr, "rows": rows, "notes": notes}, indent=1))
        return 0
    print(" | ".join(f"{k} {v}" for k, v in hdr.items()))
    cols = list(rows[0])
    cells = [cols] + [[f"{v:.3f}" if isinstance(v, float) else str(v) for v in r.values()]
                      for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(cols))]
    for i, c in enumerate(cells):
        print(" | ".join(v.rjust(w) for v, w in zip(c, widths)))
        if i == 0:
            print("-+-".join("-" * w for w in widths))
    for n in notes:
        print(f"note: {n}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
