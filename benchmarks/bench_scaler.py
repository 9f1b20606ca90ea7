"""ampc.GradScaler vs torch.amp.GradScaler: the work of one training step after backward.

    python benchmarks/bench_scaler.py [--device cpu|cuda] [--cache cold|warm] [--reps N] [--json]

One timed call is what a training loop does between backward() and the next forward, on
fp32 params and grads of the workload's shapes, Python included:
  step        scaler.step(AdamW(fused=True)) + scaler.update(), the same torch optimizer
              on both sides: torch checks the grads with its in-place unscale kernel
              (multiplying by 1), ampc with a read-only pass (8 vs 4 B/param of check)
  clip+step   the same ampc.optim.AdamW on both sides; torch: scaler.unscale_ +
              torch.nn.utils.clip_grad_norm_ + step + update; ampc: scaler.clip_grad_norm_ +
              step + update, where one read-only pass measures and checks the still-scaled
              grads and the optimizer applies unscale and clip factor in its step (torch:
              8 + 4 + 8 B/param before the optimizer, ampc: 4)
  (b)         torch's usual recipe against ampc's: unscale_ + clip_grad_norm_ +
              torch.optim.AdamW(fused=True), vs ampc's clip+step above
  live ms     ampc's step (or clip+step) handing the optimizer the scaler's live scale
              tensor instead of torch's grad_scale, a new tensor scale * 1 that later
              updates leave alone: what the product costs (one 1-element multiply)
The scale is 1 and max_norm is huge, so repeated calls leave the grads as they are (the
clip multiplies by 1) and every call does the full work; the params move with each step.
Ratios are torch ms / ampc ms (> 1: ampc faster). GB/s counts ampc's bytes: the check's
4 B/param plus Adam's 28 (see bench_adam.py). Before timing, both sides are run on copies
with an inf planted and compared (step: params bit for bit; clip+step: rel 1e-5).
"""
import copy
import sys

import torch

import _harness as H

ampc = H.import_ampc()

ADAM_BYTES, CHECK_BYTES = 28, 4
TINY = [(64, 32), (64,), (16, 64), (16,)]           # where per-step overhead shows most


class LiveScaleGradScaler(ampc.GradScaler):
    """Hands the optimizer the live scale tensor (what ampc did before it followed torch)."""

    def _grad_scale_for(self, optimizer, state):
        product = super()._grad_scale_for(optimizer, state)
        return product if product is None else self._scale


def make_params(shapes, dev):
    params = [torch.nn.Parameter(t) for t in H.randn_list(shapes, torch.float32, dev)]
    for p, g in zip(params, H.randn_list(shapes, torch.float32, dev)):
        p.grad = g * 1e-3
    return params


def one_step(scaler, opt, clip, torch_way):
    """The work between backward and the next forward."""
    if clip is not None and torch_way:
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_([p for g in opt.param_groups for p in g["params"]], clip)
    elif clip is not None:
        scaler.clip_grad_norm_(opt, clip)
    scaler.step(opt)
    scaler.update()


def setups(params, dev, init_scale=1.0):
    """{name: (scaler, optimizer, clip, torch_way)} over the same params (each optimizer
    keeps its own moments)."""
    def scaler(cls):
        s = cls(dev, init_scale=init_scale, growth_interval=10 ** 9)
        s.scale(torch.ones((), device=dev))
        return s

    def fused():
        return torch.optim.AdamW(params, lr=1e-4, fused=True)

    def ours():
        return ampc.optim.AdamW(params, lr=1e-4)

    return {"step torch": (scaler(torch.amp.GradScaler), fused(), None, True),
            "step ampc": (scaler(ampc.GradScaler), fused(), None, False),
            "step ampc-live": (scaler(LiveScaleGradScaler), fused(), None, False),
            "clip+step torch": (scaler(torch.amp.GradScaler), ours(), 1e30, True),
            "clip+step ampc": (scaler(ampc.GradScaler), ours(), 1e30, False),
            "clip+step ampc-live": (scaler(LiveScaleGradScaler), ours(), 1e30, False),
            "clip+step torch-fused": (scaler(torch.amp.GradScaler), fused(), 1e30, True)}


def validate(dev):
    """"" when each pair gives the same params on copies, with an inf planted at step 1."""
    shapes = [(37, 5), (1000,), (3, 3, 3), (4096,)]
    start = make_params(shapes, dev)
    results = {}
    for clip in (None, 1e-2):
        for name in ("torch", "ampc", "ampc-live"):
            params = copy.deepcopy(start)
            s = setups(params, dev, init_scale=1024.0)[f"{'clip+step' if clip else 'step'} {name}"]
            for step in range(3):
                for p, q in zip(params, start):          # as if backward ran again
                    p.grad = q.grad.clone()
                if step == 1:
                    params[2].grad.view(-1)[4] = float("inf")
                one_step(s[0], s[1], clip, s[3])
            results[(clip, name)] = [p.detach().clone() for p in params]
    for clip in (None, 1e-2):
        for a, b in zip(results[(clip, "ampc")], results[(clip, "torch")]):
            same = a.equal(b) if clip is None else torch.allclose(a, b, rtol=1e-5, atol=1e-6)
            if not same:
                return f"{'clip+step' if clip else 'step'}: params differ from torch's"
        if not all(a.equal(b) for a, b in zip(results[(clip, "ampc")],
                                              results[(clip, "ampc-live")])):
            return f"{'clip+step' if clip else 'step'}: the live scale changes the params"
    return ""


def main() -> int:
    args = H.parse(H.common_args(__doc__))
    dev = args.device
    err = validate(dev)
    print(f"FAIL {err}" if err else "ampc matches torch", file=sys.stderr)
    if err:
        return 1
    roof = H.Roofline(args, patterns=("mul_",))
    hdr = H.header(args, roof)
    hdr["op"] = "GradScaler step fp32"
    rows = []
    for case, shapes in [("tiny MLP 4 tensors", TINY)] + H.workloads(4, dev)[1:]:
        params = make_params(shapes, dev)
        s = setups(params, dev)
        fns = {name: (lambda v=v: one_step(*v)) for name, v in s.items()}
        ms, roof_gbs = roof.measure(fns, args.reps)
        numel = sum(p.numel() for p in params)
        gb = numel * (ADAM_BYTES + CHECK_BYTES) / 1e9
        for what, baseline in (("step", "step torch"), ("clip+step", "clip+step torch"),
                               ("clip+step vs (b)", "clip+step torch-fused")):
            ours = "step ampc" if what == "step" else "clip+step ampc"
            rows.append(H.row(f"{case} {what}", ms[ours], ms[baseline], gb, roof_gbs, "mul_",
                              tensors=len(params), **{"live ms": ms[ours + "-live"]}))
        del params, s, fns
    H.report(hdr, rows, args.json, [
        "step: the same torch.optim.AdamW(fused=True) on both sides; clip+step: the same "
        "ampc.optim.AdamW, after torch's unscale_ + clip_grad_norm_ or folding both; (b): "
        "torch's usual recipe, torch.optim.AdamW(fused=True) after unscale_ + clip_grad_norm_",
        f"ampc GB/s counts {CHECK_BYTES} B/param of check + {ADAM_BYTES} of Adam",
        "live ms: ampc handing the optimizer its live scale tensor instead of torch's "
        "product (ampc ms)"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
