"""ampc.autocast vs torch.autocast: forward plus backward of an MLP and a transformer block.

    python benchmarks/bench_autocast.py [--device cpu|cuda] [--dtype bf16|fp16] [--threads 1] [--reps N] [--json]

Each case times one training step (zero the grads, forward under the autocast, an fp32 loss,
backward) under torch.autocast, under ampc.autocast and without autocast (fp32), interleaved
in one run. "ops" counts the calls ampc's mode intercepts in one step (every torch function,
method and functional call, listed or not); "us/op" is ampc's extra time per step over
torch.autocast divided by that count: the per-op price of dispatching in Python. The small
cases are dominated by that price, the realistic ones by the matmuls. Before timing, each
case checks that both autocasts give the same output dtype and close gradients.

"ampc .to-casts" is a diagnostic, not a mode users get: ampc.autocast with each cast done by
Tensor.to (whose autograd node is C++) instead of ampc's kernel under a Python
autograd.Function. The gap between the two columns is the price of that Python node and
the kernel call; what is left over torch is the mode's dispatch.
"""
import sys

import torch
import torch.nn as nn

import _harness as H

ampc = H.import_ampc()
_ac = sys.modules["ampc.autocast"]   # the module (ampc.autocast the attribute is the class)


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
]


def step_fn(model, x, ctx):
    def step():
        for p in model.parameters():
            p.grad = None
        with ctx():
            out = model(x)
        out.float().square().mean().backward()
    return step


class torch_casts:
    """Diagnostic: ampc.autocast with its casts done by Tensor.to (C++ autograd node) instead
    of ampc's kernel under a Python autograd.Function, to split ampc's extra time between
    the mode's dispatch and the cast path."""

    def __init__(self, *args, **kwargs):
        self.region = ampc.autocast(*args, **kwargs)

    def __enter__(self):
        self.real, _ac.cast_tensors = _ac.cast_tensors, lambda ts, dt: [t.to(dt) for t in ts]
        return self.region.__enter__()

    def __exit__(self, *exc):
        _ac.cast_tensors = self.real
        return self.region.__exit__(*exc)


def count_ops(step):
    """Calls that reach ampc's mode in one step (a Python composite and each call inside it)."""
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
               "ampc .to": step_fn(model, x, lambda: torch_casts(dev, dtype=dt))}
        ops = count_ops(fns["ampc"])
        print(f"{case}: same dtypes and gradients, {ops} intercepted ops per step, timing", file=sys.stderr)
        ms = H.time_ms(fns, dev, args.reps, warm=True)
        rows.append({"case": case, "torch ms": ms["torch"], "ampc ms": ms["ampc"],
                     "ampc/torch": ms["ampc"] / ms["torch"], "ops": ops,
                     "us/op": (ms["ampc"] - ms["torch"]) * 1e3 / ops, "fp32 ms": ms["fp32"],
                     "ampc .to-casts ms": ms["ampc .to"], "its ratio": ms["ampc .to"] / ms["torch"]})
    hdr = {"torch": torch.__version__, "device": dev, "threads": torch.get_num_threads(),
           "dtype": args.dtype}
    H.report(hdr, rows, args.json, ["ampc/torch < 1 means ampc is faster; targets: <= 1.3 on the "
                                    "small cases, <= 1.05 on the realistic ones",
                                    "us/op = (ampc ms - torch ms) / ops"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
