"""Does the lean training state train as well as fp32? Final train and validation loss of each lean setting
of ampc.optim.AdamW against fp32 AdamW's seed-to-seed spread, next to torch.amp and ampc master weights.

    python benchmarks/bench_lean_quality.py [--steps 300] [--seeds 2] [--models char,gpt2,cnn] [--json]

Models (sized to train in minutes on a CPU):
  char   the demo's character-level GPT (ampc.demo: width 64, 2 layers, context 32, batch 8) on the
         running Python's standard library, every tenth file held out for validation
  gpt2   transformers' GPT2LMHeadModel from a fresh GPT2Config of the same size (dropout 0), one
         character a token, on the same text
  cnn    a 3-conv CNN classifying 16x16 images of 10 classes: each class a fixed random pattern, drawn
         at a random position and contrast under noise (learnable, not trivially)
Arms (AdamW, lr 2e-3, weight decay 0.01; same batches for all; arms other than fp32 start from seed 0's
weights):
  fp32 seed k   fp32 weights, torch.optim.AdamW(fused=True)          (the spread: seeds 0..k-1)
  torch.amp     fp32 weights, torch.autocast(bf16), torch fused AdamW
  master        ampc.prepare(bf16): fp32 master weights, fp32 moments
  the lean settings, all through ampc.prepare(bf16, ...): bf16 moments + SR; Kahan + bf16 moments;
  Kahan + 8-bit; master + 8-bit; state="lean" (SR + 8-bit)
Reported: state bytes a parameter (ampc.lean_state.state_bytes after the last step), train loss (mean of
the last 20 steps), validation loss (8 held-out batches), and the gap to the fp32 seeds' mean in units of
their spread (max - min over the seeds, seed 0 included): |gap| <= 1 spread "holds", else "drifts".
"""
import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

import _harness as H

ampc = H.import_ampc()
from ampc.demo._model import GPT, batch_maker      # noqa: E402
from ampc.demo._text import CHARS, load_text      # noqa: E402
from ampc.lean_state import state_bytes           # noqa: E402

LR, WD, WINDOW, VAL = 2e-3, 0.01, 20, 8
WIDTH, LAYERS, HEADS, CONTEXT, BATCH = 64, 2, 2, 32, 8
LEAN = {  # arm -> ampc.prepare options
    "master": {},
    "master + 8bit": dict(moments="8bit"),
    "SR + bf16 moments": dict(master_weights=False, stochastic_rounding=True, moments="bf16"),
    "Kahan + bf16 moments": dict(master_weights=False, kahan_summation=True, moments="bf16"),
    "Kahan + 8bit": dict(master_weights=False, kahan_summation=True, moments="8bit"),
    'state="lean"': dict(state="lean"),
}


class CNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(3, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
            nn.Conv2d(32, 32, 3, padding=1, stride=2), nn.BatchNorm2d(32), nn.ReLU(),
            nn.Conv2d(32, 64, 3, padding=1, stride=2), nn.BatchNorm2d(64), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10))

    def forward(self, x):
        return self.net(x)


def image_batches(seed, batch=32):
    """make_batch(step) of the synthetic image task; the patterns are the same for every seed."""
    patterns = torch.randn(10, 3, 8, 8, generator=torch.Generator().manual_seed(1234))

    def make(step):
        g = torch.Generator().manual_seed(seed * 1_000_003 + step)
        y = torch.randint(0, 10, (batch,), generator=g)
        x = 0.7 * torch.randn(batch, 3, 16, 16, generator=g)
        pos = torch.randint(0, 9, (batch, 2), generator=g)
        amp = 0.5 + torch.rand(batch, generator=g)
        for i in range(batch):
            r, c = pos[i].tolist()
            x[i, :, r:r + 8, c:c + 8] += amp[i] * patterns[y[i]]
        return x, y
    return make


class GPT2(nn.Module):
    """GPT2LMHeadModel returning its logits, so it trains like the others."""

    def __init__(self):
        super().__init__()
        from transformers import GPT2Config, GPT2LMHeadModel
        cfg = GPT2Config(vocab_size=len(CHARS), n_positions=CONTEXT, n_embd=WIDTH, n_layer=LAYERS,
                         n_head=HEADS, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                         bos_token_id=0, eos_token_id=0)
        self.lm = GPT2LMHeadModel(cfg)

    def forward(self, idx):
        return self.lm(input_ids=idx).logits


def ce(out, target):
    return F.cross_entropy(out.float().reshape(-1, out.shape[-1]), target.reshape(-1))


def setups(args):
    train, val, _, described = load_text(vocab_size=len(CHARS))   # one character a token
    text = lambda seed: batch_maker(train, CONTEXT, BATCH, seed)       # noqa: E731
    vtext = batch_maker(val, CONTEXT, BATCH, 99)
    return {
        "char": (lambda: GPT(WIDTH, LAYERS, HEADS, CONTEXT, vocab=len(CHARS)), text(0), [vtext(k) for k in range(VAL)]),
        "gpt2": (GPT2, text(0), [vtext(k) for k in range(VAL)]),
        "cnn": (CNN, image_batches(0), [image_batches(99)(k) for k in range(VAL)]),
    }, described


def make_arm(arm, make_model, seed):
    """(model, optimizer, autocast region) of one arm, its weights drawn from ``seed``."""
    torch.manual_seed(seed)
    model = make_model()
    region = lambda: torch.autocast("cpu", enabled=False)              # noqa: E731
    if arm.startswith("fp32") or arm == "torch.amp":
        opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD, fused=True)
        if arm == "torch.amp":
            region = lambda: torch.autocast("cpu", dtype=torch.bfloat16)   # noqa: E731
    else:
        model, opt = ampc.prepare(model, ampc.optim.AdamW, torch.bfloat16, lr=LR, weight_decay=WD,
                                  **LEAN[arm])
    return model, opt, region


def train_arm(arm, seed, make_model, make_batch, val, steps):
    model, opt, region = make_arm(arm, make_model, seed)
    model.train()
    losses, t0 = [], time.perf_counter()
    for k in range(steps):
        x, y = make_batch(k)
        opt.zero_grad(set_to_none=True)
        with region():
            loss = ce(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    secs = time.perf_counter() - t0
    model.eval()
    with torch.no_grad(), region():
        vl = statistics.mean(ce(model(x), y).item() for x, y in val)
    return {"train": statistics.mean(losses[-WINDOW:]), "val": vl, "finite": all(map(torch.isfinite,
            map(torch.tensor, losses))), "bytes_per_param": state_bytes(model, opt)["total_per_param"],
            "ms_per_step": 1e3 * secs / steps}


def verdict(rows, seeds):
    """The fp32 seeds' mean and spread, each arm's gap to the mean in spreads, and holds/drifts."""
    fp32 = [rows[f"fp32 seed {s}"] for s in range(seeds)]
    out = {}
    for key in ("train", "val"):
        vals = [r[key] for r in fp32]
        mean, spread = statistics.mean(vals), max(vals) - min(vals)
        out[key] = (mean, spread)
        for r in rows.values():
            r[f"{key}_gap_spreads"] = (r[key] - mean) / spread if spread > 0 else float("inf")
    for name, r in rows.items():
        if not name.startswith("fp32"):
            ok = r["finite"] and all(abs(r[f"{k}_gap_spreads"]) <= 1 for k in ("train", "val"))
            r["verdict"] = "holds" if ok else "drifts"
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--seeds", type=int, default=2, help="fp32 seeds (at least 2)")
    p.add_argument("--models", default="char,gpt2,cnn")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    if args.seeds < 2:
        p.error("--seeds: at least 2, for the seed-to-seed spread")
    models, described = setups(args)
    arms = [(f"fp32 seed {s}", s) for s in range(args.seeds)] + [("torch.amp", 0)] + [(a, 0) for a in LEAN]
    hdr = H.machine("cpu")
    hdr.update(text=described, steps=args.steps, lr=LR)
    result = {"header": hdr, "models": {}}
    for name in args.models.split(","):
        make_model, make_batch, val = models[name]
        n = sum(q.numel() for q in make_model().parameters())
        rows = {a: train_arm(a, s, make_model, make_batch, val, args.steps) for a, s in arms}
        result["models"][name] = {"params": n, "fp32": verdict(rows, args.seeds), "rows": rows}
        if not args.json:
            print_model(name, n, result["models"][name], args.seeds)
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        print(" | ".join(f"{k} {v}" for k, v in hdr.items()))


def print_model(name, n, res, seeds):
    (tm, ts), (vm, vs) = res["fp32"]["train"], res["fp32"]["val"]
    print(f"\n{name}: {n:,} params; fp32 over {seeds} seeds: train {tm:.4f} (spread {ts:.4f}), "
          f"val {vm:.4f} (spread {vs:.4f})")
    print(f"{'arm':22} {'B/param':>7} {'train':>7} {'gap/spr':>7} {'val':>7} {'gap/spr':>7} {'ms/step':>7}  verdict")
    for arm, r in res["rows"].items():
        print(f"{arm:22} {r['bytes_per_param']:7.2f} {r['train']:7.4f} {r['train_gap_spreads']:+7.2f} "
              f"{r['val']:7.4f} {r['val_gap_spreads']:+7.2f} {r['ms_per_step']:7.1f}  {r.get('verdict', '')}",
              flush=True)


if __name__ == "__main__":
    main()
