"""ampc's fused master-weight AdamW step vs the torch ways of doing the same job.

    python benchmarks/bench_adam.py [--dtype bf16|fp16] [--device cpu|cuda] [--cache cold|warm] [--threads N]
                                    [--json]

One optimizer step over the workload's parameters, timed with the optimizers' own step()
(Python included), in one run, interleaved:
  ampc     ampc.optim.AdamW on fp16/bf16 params with fp32 master weights: one pass, 28 B/param
           (grad 2 read, master 4+4, moments 8+8, param 2 written)
  (a)      the torch composition that does the same job: upcast the grads into fp32 buffers
           (_foreach_copy_), torch.optim.AdamW(fused=True) on fp32 masters, copy the masters back
           into the low-precision params (_foreach_copy_): 40 B/param in three passes
  (b)      torch.optim.AdamW(fused=True) on as many fp32 params, no master weights: the same 28 B/param
  (c)      torch.optim.AdamW(foreach=True) on as many fp32 params
  ampc32   ampc.optim.AdamW on those fp32 params (no master weights), for a like-for-like with (b)
Ratios are torch ms / ampc ms (> 1: ampc faster). ampc GB/s counts its 28 B/param; "% roofline" compares
that with the op of the same access pattern (read and write the same lines), an in-place mul_ over a large
fp32 tensor timed interleaved with the case (see _harness.py). Before timing, two steps of each ampc arm are
checked against torch: ampc against (a) (master weights bit for bit, except torch's scalar tails of
numel % 16 elements, and the model weights as the masters rounded to nearest), ampc32 against (b)
(params and moments bit for bit, except those tails).
"""
import sys

import torch

import _harness as H

ampc = H.import_ampc()

BYTES_PER_PARAM = 28


class TorchComposition:
    """fp32 masters stepped by torch's fused AdamW, fed upcast grads, copied back."""

    def __init__(self, params, lr):
        self.params = params
        self.masters = [torch.nn.Parameter(p.detach().float()) for p in params]
        self.grads32 = [torch.empty_like(m) for m in self.masters]
        for m, g in zip(self.masters, self.grads32):
            m.grad = g
        self.opt = torch.optim.AdamW(self.masters, lr=lr, fused=True)

    def step(self):
        torch._foreach_copy_(self.grads32, [p.grad for p in self.params])
        self.opt.step()
        torch._foreach_copy_([p.data for p in self.params], self.masters)


def low_params(shapes, dtype, dev):
    params = [torch.nn.Parameter(t) for t in H.randn_list(shapes, dtype, dev)]
    for p, g in zip(params, H.randn_list(shapes, dtype, dev)):
        p.grad = g.mul_(0.01)
    return params


def fp32_params(shapes, dev, seed=None):
    params = [torch.nn.Parameter(t) for t in H.randn_list(shapes, torch.float32, dev)]
    g = None if seed is None else torch.Generator(device=dev).manual_seed(seed)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g, device=dev).mul_(0.01)
    return params


SHAPES = [(n,) for n in (1, 17, 1000, 4099, 65536 + 5)] + [(33, 65)]


def differs(got, want, what) -> str:
    """"" when got equals want bit for bit except the last numel % 16 elements (torch's scalar tail), which
    must be within 1e-6."""
    got, want = got.detach().reshape(-1), want.detach().reshape(-1)
    body = got.numel() - got.numel() % 16
    if not H.same(got[:body], want[:body]):
        return f"{what} differs from torch's"
    if not torch.allclose(got[body:], want[body:], rtol=1e-6, atol=1e-7):
        return f"{what} tail differs from torch's beyond 1e-6"
    return ""


def validate(dt, dev) -> str:
    """Two steps of ampc against the composition (a) and of ampc32 against (b), on an odd-sized list."""
    mine, theirs = low_params(SHAPES, dt, dev), low_params(SHAPES, dt, dev)
    opt = ampc.optim.AdamW(mine, lr=1e-3)
    ref = TorchComposition(theirs, lr=1e-3)
    mine32, theirs32 = fp32_params(SHAPES, dev, seed=3), fp32_params(SHAPES, dev, seed=3)
    opt32 = ampc.optim.AdamW(mine32, lr=1e-3)
    fused = torch.optim.AdamW(theirs32, lr=1e-3, fused=True)
    for o in (opt, ref, opt32, fused, opt, ref, opt32, fused):
        o.step()
    for i, (p, q, m) in enumerate(zip(mine, theirs, ref.masters)):
        err = (differs(opt.state[p]["master"], m, f"master weight {i}")
               or differs(p, q, f"model weight {i}"))
        if err:
            return err
        if not H.same(p.detach(), opt.state[p]["master"].to(dt)):
            return f"model weight {i} is not its master rounded to nearest"
    for i, (p, q) in enumerate(zip(mine32, theirs32)):
        err = differs(p, q, f"fp32 param {i}") or next(
            (e for k in ("exp_avg", "exp_avg_sq")
             for e in [differs(opt32.state[p][k], fused.state[q][k], f"fp32 {k} {i}")] if e), "")
        if err:
            return err
    return ""


def main() -> int:
    p = H.common_args(__doc__)
    p.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    args = H.parse(p)
    dt, dev = H.DTYPES[args.dtype], args.device
    err = validate(dt, dev)
    if err:
        print(f"FAIL: {err}", file=sys.stderr)
        return 1
    print("ampc matches torch's AdamW on fp32 masters, ampc32 torch's fused AdamW", file=sys.stderr)
    roof = H.Roofline(args, patterns=("mul_",))
    hdr = H.header(args, roof)
    hdr["op"] = f"AdamW step, {args.dtype} params + fp32 masters"
    rows = []
    for case, shapes in H.workloads(BYTES_PER_PARAM, dev):
        mine = low_params(shapes, dt, dev)
        opt = ampc.optim.AdamW(mine, lr=1e-3)
        comp = TorchComposition(low_params(shapes, dt, dev), lr=1e-3)
        fp32 = fp32_params(shapes, dev)
        fused = torch.optim.AdamW(fp32, lr=1e-3, fused=True)
        fp32_b = fp32_params(shapes, dev)
        foreach = torch.optim.AdamW(fp32_b, lr=1e-3, foreach=True)
        fp32_c = fp32_params(shapes, dev)
        mine32 = ampc.optim.AdamW(fp32_c, lr=1e-3)
        ms, roof_gbs = roof.measure({"ampc": opt.step, "a": comp.step, "b": fused.step,
                                     "c": foreach.step, "ampc32": mine32.step}, args.reps)
        numel = sum(t.numel() for t in mine)
        gb = numel * BYTES_PER_PARAM / 1e9
        gbs = gb / ms["ampc"] * 1e3
        r = {"case": case, "ampc ms": ms["ampc"], "(a) ms": ms["a"], "(a)/ampc": ms["a"] / ms["ampc"],
             "(b) ms": ms["b"], "(b)/ampc": ms["b"] / ms["ampc"], "(c) ms": ms["c"],
             "(c)/ampc": ms["c"] / ms["ampc"], "ampc32 ms": ms["ampc32"],
             "(b)/ampc32": ms["b"] / ms["ampc32"], "ampc GB/s": gbs, "roofline GB/s": roof_gbs,
             "% roofline": 100 * gbs / roof_gbs, "tensors": len(mine), "Mparams": numel / 1e6}
        rows.append(r)
        del mine, opt, comp, fp32, fused, fp32_b, foreach, fp32_c, mine32
    H.report(hdr, rows, args.json, [
        "ampc: 28 B/param (bf16/fp16 grad read, fp32 master, exp_avg, exp_avg_sq read + written, "
        "param written); ampc GB/s counts those bytes; roofline: torch's in-place mul_ over a large fp32 tensor",
        "(a) upcast grads + AdamW(fused=True) on fp32 masters + copy back (40 B/param, three passes); "
        "(b) AdamW(fused=True) on fp32 params (28 B/param); (c) AdamW(foreach=True) on fp32 params; "
        "ampc32: ampc.optim.AdamW on fp32 params"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
