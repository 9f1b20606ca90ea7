"""Converting a torch AdamW run into the lean state half-way: does it train on as if it had not converted?

    python benchmarks/bench_lean_convert.py [--steps 50] [--seeds 3] [--batch 32]

The model: torchvision's VisionTransformer(image_size=32, patch_size=4, num_layers=4, num_heads=4,
hidden_dim=128, mlp_dim=256, num_classes=10) on 32x32 images of 10 classes (each class a fixed random
pattern under noise; learnable, not trivially). Arms, the same batches for all, AdamW lr 1e-3:
  fp32 seed k   fp32 weights, torch.optim.AdamW, 2 x steps               (the spread: seeds 0..k-1)
  lean          ampc.prepare(bf16, state="lean") from seed 0's weights, 2 x steps
  converted     seed 0's fp32 run for `steps`, then ampc.prepare(bf16, state="lean") and
                opt.load_state_dict(torch_opt.state_dict()), `steps` more
  fresh state   the same conversion without loading torch's state (moments from zero)
Reported: train loss (mean of the last 10 steps) and validation loss (8 held-out batches) of each arm, and
each arm's gap to fp32 seed 0 beside the fp32 seeds' spread and lean's own gap (lean from the start).
"""
import argparse
import statistics

import torch
import torch.nn.functional as F

import _harness as H

ampc = H.import_ampc()
from torchvision.models import VisionTransformer  # noqa: E402

LR, WINDOW, VAL = 1e-3, 10, 8


def vit(seed):
    torch.manual_seed(seed)
    return VisionTransformer(image_size=32, patch_size=4, num_layers=4, num_heads=4,
                             hidden_dim=128, mlp_dim=256, num_classes=10)


PATTERNS = torch.randn(10, 3, 32, 32, generator=torch.Generator().manual_seed(7))


def batch(k, size):
    g = torch.Generator().manual_seed(1000 + k)
    y = torch.randint(0, 10, (size,), generator=g)
    x = PATTERNS[y] * 0.6 + torch.randn(size, 3, 32, 32, generator=g)
    return x, y


def steps(model, opt, start, count, size, losses):
    dtype = next(p.dtype for p in model.parameters() if p.dim() > 1)
    for k in range(start, start + count):
        x, y = batch(k, size)
        opt.zero_grad()
        loss = F.cross_entropy(model(x.to(dtype)).float(), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())


@torch.no_grad()
def validate(model, size):
    dtype = next(p.dtype for p in model.parameters() if p.dim() > 1)
    out = []
    for k in range(VAL):
        x, y = batch(10 ** 6 + k, size)
        out.append(F.cross_entropy(model(x.to(dtype)).float(), y).item())
    return statistics.mean(out)


def run(arm, n, size, seed=0):
    losses = []
    model = vit(seed)
    if arm == "lean":
        model, opt = ampc.prepare(model, ampc.optim.AdamW, torch.bfloat16, state="lean", lr=LR)
        steps(model, opt, 0, 2 * n, size, losses)
        return model, losses
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    steps(model, opt, 0, n, size, losses)
    if arm in ("converted", "fresh state"):
        saved = opt.state_dict()
        model, opt = ampc.prepare(model, ampc.optim.AdamW, torch.bfloat16, state="lean", lr=LR)
        if arm == "converted":
            opt.load_state_dict(saved)
    steps(model, opt, n, n, size, losses)
    return model, losses


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=50, help="steps before and after the conversion")
    ap.add_argument("--seeds", type=int, default=3, help="fp32 seeds for the spread")
    ap.add_argument("--batch", type=int, default=32)
    a = ap.parse_args()
    print(H.machine("cpu"))
    rows = {}
    for seed in range(a.seeds):
        model, losses = run("fp32", a.steps, a.batch, seed)
        rows[f"fp32 seed {seed}"] = (statistics.mean(losses[-WINDOW:]), validate(model, a.batch))
    for arm in ("lean", "converted", "fresh state"):
        model, losses = run(arm, a.steps, a.batch)
        rows[arm] = (statistics.mean(losses[-WINDOW:]), validate(model, a.batch))
    fp = [v for k, v in rows.items() if k.startswith("fp32")]
    spread = [max(v[i] for v in fp) - min(v[i] for v in fp) for i in (0, 1)]
    ref = rows["fp32 seed 0"]
    print(f"ViT 32x32, batch {a.batch}, {a.steps} + {a.steps} steps; fp32 seed spread: "
          f"train {spread[0]:.4f}, val {spread[1]:.4f}")
    print(f"{'arm':<14}{'train':>9}{'val':>9}{'train gap':>12}{'val gap':>10}")
    for name, (tr, va) in rows.items():
        print(f"{name:<14}{tr:>9.4f}{va:>9.4f}{tr - ref[0]:>+12.4f}{va - ref[1]:>+10.4f}")


if __name__ == "__main__":
    main()
