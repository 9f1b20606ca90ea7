"""ampc.autocast vs torch.autocast: forward plus backward of an MLP and a transformer block.

    python benchmarks/bench_autocast.py [--device cpu|cuda] [--dtype bf16|fp16] [--threads 1] [--reps N] [--json]

Each case times one training step (zero the grads, forward under the autocast, an fp32 loss,
backward) under torch.autocast, under ampc.autocast and without autocast (fp32), interleaved
in one run. Before timing, each case checks that both autocasts give the same output dtype and
close gradients.

Inside an ampc region torch's own autocast casts the activations and, on the CPU, the weights
(ampc's mode goes on only for policy changes, scope ops, check_finite or the fused weight cast).
"fused" is ampc.autocast with the fused, bucketed weight cast switched on for the CPU (on CUDA
it is the default): the mode on, every weight of a model cast in one kernel call per 25 MB
bucket under one Python autograd node. "ops" counts the calls its mode sees per step; its
ratio to torch shows what the mode and that node cost on the CPU, where one cast call per
weight (torch's C++ node) costs about the same as one per bucket.
"""
import sys

import torch
import torch.nn as nn

import _harness as H

ampc = H.import_ampc()
from ampc.amp import _weight_cache as _wc, autocast_mode as _ac  # noqa: E402  (after the harness finds ampc)


def mlp(d, layers=3):
    mods = []
    for _ in range(layers):
        mods += [nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d), nn.LayerNorm(d)]
    return nn.Sequential(*mods)


class Block(nn.Module):
    """Pre-norm transformer block: LayerNorm, self-attention, LayerNorm, MLP, residuals."""

    def __init__(self, d, heads):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        h = self.ln1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


CASES = [  # name, model, input shape
    ("mlp small d=64 b=16", lambda: mlp(64), (16, 64)),
    ("mlp realistic d=1024 b=256", lambda: mlp(1024), (256, 1024)),
    ("block small d=64 s=16 b=2", lambda: Block(64, 4), (2, 16, 64)),
    ("block realistic d=512 s=256 b=4", lambda: Block(512, 8), (4, 256, 512)),
    ("resnet18 small 32x32 b=2", lambda: resnet18(True), (2, 3, 32, 32)),
    ("resnet18 realistic 224x224 b=8", lambda: resnet18(False), (8, 3, 224, 224)),
]


def step_fn(model, x, ctx):
    def step():
        for p in model.parameters():
            p.grad = None
        with ctx():
            out = model(x)
        out.float().square().mean().backward()
    return step


class fused:
    """ampc.autocast with the fused weight cast on for the CPU too."""

    def __init__(self, *args, **kwargs):
        self.region = ampc.autocast(*args, **kwargs)

    def __enter__(self):
        self.was, _wc.FUSED["cpu"] = _wc.FUSED["cpu"], True
        return self.region.__enter__()

    def __exit__(self, *exc):
        out = self.region.__exit__(*exc)
        _wc.FUSED["cpu"] = self.was
        return out


def count_ops(step):
    """Calls that reach ampc's mode in one step."""
    n = [0]
    real = _ac._Mode.__torch_function__

    def counting(*a, **k):
        n[0] += 1
        return real(*a, **k)
    _ac._Mode.__torch_function__ = counting
    try:
        step()
    finally:
        _ac._Mode.__torch_function__ = real
    return n[0]


def check(model, x, dev, dt):
    """Same output dtype and close weight gradients under both autocasts."""
    grads, dtypes = [], []
    for ctx in (torch.autocast, ampc.autocast):
        for p in model.parameters():
            p.grad = None
        with ctx(dev, dtype=dt):
            out = model(x)
        out.float().square().mean().backward()
        dtypes.append(out.dtype)
        grads.append([p.grad.clone() for p in model.parameters()])
    if dtypes[0] != dtypes[1]:
        return f"output dtype {dtypes[1]} (ampc) vs {dtypes[0]} (torch)"
    for (name, _), a, b in zip(model.named_parameters(), *grads):
        if not torch.allclose(a, b, rtol=2e-2, atol=1e-3 * float(a.abs().max())):
            return f"grad of {name} differs"
    return ""


def resnet18(small):
    """torchvision's ResNet-18 (fresh weights) if installed, else a conv net of its shape."""
    try:
        import torchvision
        return torchvision.models.resnet18(num_classes=10 if small else 1000)
    except ImportError:
        pass
    def stage(cin, cout, stride):
        return nn.Sequential(nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(),
                             nn.Conv2d(cout, cout, 3, 1, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU())
    return nn.Sequential(nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(),
                         nn.MaxPool2d(3, 2, 1), stage(64, 64, 1), stage(64, 64, 1), stage(64, 128, 2),
                         stage(128, 128, 1), stage(128, 256, 2), stage(256, 256, 1), stage(256, 512, 2),
                         stage(512, 512, 1), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(512, 10 if small else 1000))


def main() -> int:
    p = H.common_args(__doc__)
    p.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    p.set_defaults(threads=1, cache="warm")  # one thread: steadier on a shared machine
    args = H.parse(p)
    dev, dt = args.device, H.DTYPES[args.dtype]
    torch.manual_seed(0)
    rows = []
    for case, build, shape in CASES:
        model = build().to(dev)
        x = torch.randn(shape, device=dev)
        err = check(model, x, dev, dt)
        if err:
            print(f"FAIL {case}: {err}", file=sys.stderr)
            return 1
        fns = {"torch": step_fn(model, x, lambda: torch.autocast(dev, dtype=dt)),
               "ampc": step_fn(model, x, lambda: ampc.autocast(dev, dtype=dt)),
               "fp32": step_fn(model, x, lambda: torch.autocast(dev, enabled=False)),
               "fused": step_fn(model, x, lambda: fused(dev, dtype=dt))}
        ops = count_ops(fns["fused"])
        print(f"{case}: same dtypes and gradients, timing", file=sys.stderr)
        ms = H.time_ms(fns, dev, args.reps, warm=True)
        rows.append({"case": case, "torch ms": ms["torch"], "ampc ms": ms["ampc"],
                     "ampc/torch": ms["ampc"] / ms["torch"], "fp32 ms": ms["fp32"],
                     "fused ms": ms["fused"], "fused/torch": ms["fused"] / ms["torch"], "fused ops": ops})
    hdr = {"torch": torch.__version__, "device": dev, "threads": torch.get_num_threads(),
           "dtype": args.dtype}
    H.report(hdr, rows, args.json, ["ampc/torch < 1 means ampc is faster; targets: <= 1.10 on the "
                                    "small cases, <= 1.02 on the realistic ones",
                                    "fused: the fused weight cast on for the CPU (the CUDA default); "
                                    "fused ops: calls its mode sees per step"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
