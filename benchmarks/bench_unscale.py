"""ampc.ops.unscale_check (fused multi-tensor unscale + inf/nan check) vs torch's ops for the same jobs.

    python benchmarks/bench_unscale.py [--dtype fp32|fp16|bf16] [--device cpu|cuda] [--cache cold|warm] [--json]

Baselines, timed in the same run on the same grads; torch/ampc > 1 means ampc is faster:
  unscale rows  torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale), GradScaler's
                kernel: grads *= inv_scale in place, found_inf set on any inf/nan
  check rows    ampc's read-only mode (check_only=True: found_inf and the norm of the unscaled grads, grads
                untouched) against torch's read-only way to the same answers, what clip_grad_norm_ does:
                torch._foreach_norm(grads), the norm of those norms times inv_scale, and found_inf set when
                that total is not finite
GB/s counts bytes read plus bytes written. "% roofline" compares ampc's GB/s with a torch op of the same access
pattern over a large fp32 tensor, timed interleaved with the case (see _harness.py): an in-place mul_ for the
unscale rows, a read-only sum for the check rows. Timed calls alternate inv_scale between 2.0 and 0.5, so the
grads return to their values exactly, and each follows an untimed cache flush (--cache warm: the same call).
ampc is checked against torch (bits, found_inf, norm, also on random bit patterns) before anything is timed.
"""
import math
import sys

import torch

import _harness as H

ampc = H.import_ampc()


def bytes_moved(numel: int, dtype: torch.dtype, check_only: bool) -> int:
    # in place: read and write each element once = 2x element size (8 B/elem for fp32);
    # check only: read each element once = 1x element size
    return numel * dtype.itemsize * (1 if check_only else 2)


TORCH_NORM_ERRORS = []  # torch's norm against the float64 one where it is off by more than 1e-4 (ampc's is not)


def torch_check(grads: list, found_inf: torch.Tensor, inv_scale: torch.Tensor) -> torch.Tensor:
    """torch's read-only check, as clip_grad_norm_ does it: the norm of the per-tensor norms (in the grads'
    dtype: asking _foreach_norm for float32 takes a path 10x slower on the CPU), found_inf set when it is not
    finite; no host sync."""
    total = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads, 2)))
    found_inf.copy_(total.isfinite().logical_not())
    return total * inv_scale


def validate(grads: list, dev: str) -> str:
    """Returns "" when ampc matches torch on copies of grads (bits, found_inf, the check-only norm)."""
    inv = torch.full((1,), 1 / 1000, device=dev)  # not a power of two, so rounding is exercised
    ref, got = [g.clone() for g in grads], [g.clone() for g in grads]
    fi_ref, fi_got = torch.zeros(1, device=dev), torch.zeros(1, device=dev)
    torch._amp_foreach_non_finite_check_and_unscale_(ref, fi_ref, inv)
    ampc.ops.unscale_check(got, fi_got, inv)
    if fi_got.item() != fi_ref.item():
        return f"found_inf is {fi_got.item()}, torch says {fi_ref.item()}"
    bad = next((i for i, (r, g) in enumerate(zip(ref, got)) if not H.same(r, g)), None)
    if bad is not None:
        return f"grads[{bad}] differs from torch after unscale"
    del ref
    got, fi_got = [g.clone() for g in grads], torch.zeros(1, device=dev)
    norm = ampc.ops.unscale_check(got, fi_got, inv, check_only=True)
    if fi_got.item() != fi_ref.item() or not all(H.same(a, b) for a, b in zip(got, grads)):
        return f"check_only: found_inf is {fi_got.item()}, torch says {fi_ref.item()}, or grads were modified"
    want = inv.item() * math.hypot(*(torch.linalg.vector_norm(g, dtype=torch.float64).item() for g in grads))
    if fi_ref.item() == 0.0 and not math.isclose(norm.item(), want, rel_tol=1e-4):
        return f"check_only: norm {norm.item()}, expected {want}"
    fi_torch = torch.zeros(1, device=dev)
    norm_torch = torch_check(grads, fi_torch, inv).item()
    if fi_torch.item() != fi_got.item():
        return f"check_only: found_inf is {fi_got.item()}, torch's norm check says {fi_torch.item()}"
    if fi_ref.item() == 0.0 and not math.isclose(norm_torch, want, rel_tol=1e-4):
        TORCH_NORM_ERRORS.append(f"{norm_torch / want - 1:+.1e} on {sum(g.numel() for g in grads) / 1e6:.0f}M "
                                 f"elements in {len(grads)} tensors")
    for bad, where in ((math.inf, -1), (math.nan, 0)):  # one non-finite value, at the end or the start
        got[where].view(-1)[where] = bad
        for check_only in (False, True):
            fi_got.zero_()
            ampc.ops.unscale_check(got, fi_got, inv, check_only=check_only)
            if fi_got.item() != 1.0:
                return f"{bad} in grads[{where}] not found (check_only={check_only})"
        got[where].view(-1)[where] = 0.0
    return ""


def main() -> int:
    p = H.common_args(__doc__)
    p.add_argument("--dtype", choices=list(H.DTYPES), default="fp32")
    args = H.parse(p)
    dt, dev = H.DTYPES[args.dtype], args.device
    roof = H.Roofline(args, patterns=("mul_", "sum"))
    hdr = H.header(args, roof)
    hdr["op"] = f"unscale_check {args.dtype}"
    rows = []
    cases = [("random bit patterns", None)] + H.workloads(2 * dt.itemsize, dev)
    for case, shapes in cases:
        grads = H.randn_list(shapes, dt, dev) if shapes else [H.random_bits(dt, dev)]
        err = validate(grads, dev)
        if err:
            print(f"FAIL {case}: {err}", file=sys.stderr)
            return 1
        print(f"{case}: ampc matches torch", file=sys.stderr)
        if shapes is None:
            continue
        found_inf = torch.zeros(1, device=dev)
        invs = [torch.full((1,), 0.5, device=dev), torch.full((1,), 2.0, device=dev)]

        def alternating(op, **kw):  # each timed fn flips its own inv_scale: x2, x0.5, x2, ...
            k = [0]

            def fn():
                k[0] ^= 1
                return op(grads, found_inf, invs[k[0]], **kw)
            return fn

        numel = sum(g.numel() for g in grads)
        ms, _ = roof.measure({"torch unscale": alternating(torch._amp_foreach_non_finite_check_and_unscale_),
                              "unscale": alternating(ampc.ops.unscale_check),
                              "torch check": alternating(torch_check),
                              "check": alternating(ampc.ops.unscale_check, check_only=True)}, args.reps)
        for mode, check_only, pattern in (("unscale", False, "mul_"), ("check", True, "sum")):
            gb = bytes_moved(numel, dt, check_only) / 1e9
            rows.append(H.row(f"{case} {mode}", ms[mode], ms[f"torch {mode}"], gb, roof.gbs[pattern], pattern,
                              tensors=len(grads), **{"MB moved": gb * 1e3}))
        if found_inf.item() != 0.0:
            print(f"FAIL {case}: found_inf set while timing finite grads", file=sys.stderr)
            return 1
        del grads
    H.report(hdr, rows, args.json, [
        f"{hdr['op']}: unscale {2 * dt.itemsize} B/elem (read + write in place), check {dt.itemsize} B/elem (read)",
        "unscale rows: torch = _amp_foreach_non_finite_check_and_unscale_, roofline an in-place mul_; "
        "check rows: torch = _foreach_norm + a finite check of the total (read only), roofline a read-only sum"]
        + [f"torch's _foreach_norm is off the float64 norm by {e} (ampc's within 1e-4)" for e in TORCH_NORM_ERRORS])
    return 0


if __name__ == "__main__":
    sys.exit(main())
