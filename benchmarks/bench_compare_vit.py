"""How long ampc.validate.compare takes to a verdict on a small torchvision ViT, and which.

The model: VisionTransformer(image_size=32, patch_size=4, num_layers=4, num_heads=4,
hidden_dim=128, mlp_dim=256, num_classes=10), 0.8M parameters. The task: each of 10 classes
is a fixed random 3x32x32 image seen through Gaussian noise (standard deviation --noise),
with 30% of the labels replaced at random (a loss floor well above zero, so that relative
gaps mean something to the end); fresh batches every step.

    python benchmarks/bench_compare_vit.py --steps 120 --seeds 0,1 --setups torch.amp@bf16
"""
import argparse
import os
import time
import warnings

import torch

import ampc


def make_model():
    from torchvision.models import VisionTransformer
    return VisionTransformer(image_size=32, patch_size=4, num_layers=4, num_heads=4,
                             hidden_dim=128, mlp_dim=256, num_classes=10)


def task(batch, noise, flip=0.3):
    templates = torch.randn(10, 3, 32, 32, generator=torch.Generator().manual_seed(123))

    def make_batch(step):
        g = torch.Generator().manual_seed(1000 + step)
        y = torch.randint(0, 10, (batch,), generator=g)
        x = templates[y] + noise * torch.randn(batch, 3, 32, 32, generator=g)
        y = torch.where(torch.rand(batch, generator=g) < flip,
                        torch.randint(0, 10, (batch,), generator=g), y)
        return x, y
    return make_batch


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--seeds", default="0,1")
    p.add_argument("--setups", default="torch.amp@bf16")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--noise", type=float, default=2.0)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    a = p.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    seeds = tuple(int(s) for s in a.seeds.split(","))
    load = os.getloadavg()
    t0 = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = ampc.validate.compare(make_model, task(a.batch, a.noise), steps=a.steps,
                                       setups=tuple(a.setups.split(",")), seeds=seeds, lr=a.lr,
                                       device="cpu", progress=False)
    took = time.perf_counter() - t0
    print(f"steps {a.steps}, batch {a.batch}, seeds {list(seeds)}, lr {a.lr}, "
          f"threads {torch.get_num_threads()}, {torch.backends.cpu.get_cpu_capability()}; "
          f"compare took {took:.0f} s; load average {load[0]:.1f} before, "
          f"{os.getloadavg()[0]:.1f} after, on {os.cpu_count()} cores")
    print(report.table())
    for w in caught:
        print("warning:", w.message)
    for r in report.rows:
        print(f"{r['setup']}: verdict {r['within_spread']}, gap {100 * r['gap']:+.3f}% "
              f"+- {100 * (r['gap_interval'] or 0):.3f}, fp32 spread {100 * report.spread:.2f}%")


if __name__ == "__main__":
    main()
