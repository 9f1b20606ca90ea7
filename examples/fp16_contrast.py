"""Where fp16 without loss scaling fails, torch.amp's GradScaler and an autoprecision plan
hold: a small regression MLP whose objective is weighted 1e-6 (an auxiliary loss weight).
AdamW does not see the weight, so fp32 trains as usual, but the gradients at the output
(~1e-9) are under fp16's smallest subnormal, 2**-24 (6e-8), and flush to zero unscaled.

    python examples/fp16_contrast.py      # about a minute on one CPU core

Also prints ampc.validate.fp16_ready on the same model and on one with a planted layer
whose outputs pass fp16's largest value, 65504.
"""
import platform
import warnings

import torch
import torch.nn.functional as F
from torch import nn

import ampc
from ampc import validate

W = torch.randn(16, 16, generator=torch.Generator().manual_seed(99))


def make_model():
    return nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16))


def make_batch(step, batch=256):
    g = torch.Generator().manual_seed(step)
    x = torch.randn(batch, 16, generator=g)
    return x, x @ W + 0.5 * torch.randn(batch, 16, generator=g)


def mse(out, y):
    return F.mse_loss(out.float(), y)


def tiny_loss(out, y):
    return 1e-6 * mse(out, y)


class Boost(nn.Module):
    """A layer whose outputs bf16 and fp32 hold and fp16 does not."""

    def forward(self, x):
        return x * 1e5


def main():
    print(f"torch {torch.__version__}, {platform.processor() or platform.machine()}, "
          f"CPU capability {torch.backends.cpu.get_cpu_capability()}")
    torch.manual_seed(0)
    plan = ampc.autoprecision.search(make_model(), [make_batch(1000 + k) for k in range(3)],
                                     tiny_loss, candidates=("fp32", "fp16"), objective="memory")
    print(plan.table())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        report = validate.compare(make_model, make_batch, tiny_loss, steps=300, lr=3e-3,
                                  device="cpu", progress=False,
                                  setups=("torch.amp@fp16", "torch.amp.noscale@fp16",
                                          "pure@bf16", plan))
    print(report.table())
    for run in [report.base] + report.spread_runs + report.runs:
        print(f"{run.name:>24}: loss {run.losses[0]:.3e} -> {run.losses[-1]:.3e}")

    batches = [make_batch(2000 + k) for k in range(2)]
    print(validate.fp16_ready(make_model(), batches, tiny_loss).table())
    torch.manual_seed(0)
    planted = nn.Sequential(nn.Linear(16, 64), Boost(), nn.LayerNorm(64), nn.Linear(64, 16))
    print(validate.fp16_ready(planted.to(torch.bfloat16),
                              [(x.bfloat16(), y) for x, y in batches], tiny_loss).table())


if __name__ == "__main__":
    main()
