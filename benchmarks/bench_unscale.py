"""ampc.ops.unscale_check (fused multi-tensor unscale + inf/nan check) vs torch's GradScaler kernel.

    python benchmarks/bench_unscale.py [--dtype fp32|fp16|bf16] [--device cpu|cuda] [--json] [--reps N]

Baseline: torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale), timed in the same
run. Rows marked "check" time ampc's read-only mode (check_only=True: found_inf and the grad norm, grads
untouched) against that same torch op, since torch has no read-only mode. ratio = torch ms / ampc ms
(> 1: ampc is faster). GB/s counts bytes read plus bytes written; "% copy" is against a large same-dtype
torch copy measured in the same run. Timed reps alternate inv_scale between 0.5 and 2.0 so that the grads
return to their starting values exactly. ampc is checked against torch (bits, found_inf, norm) before
anything is timed. Sample (2-core CPU):

SAMPLE
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


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


def validate(grads: list, dev: str) -> str:
    """Returns "" when ampc matches torch, else what differs."""
    inv = torch.full((1,), 1 / 1000, device=dev)  # not a power of two, so rounding is exercised
    ref, got = [g.clone() for g in grads], [g.clone() for g in grads]
    fi_ref, fi_got = torch.zeros(1, device=dev), torch.zeros(1, device=dev)
    torch._amp_foreach_non_finite_check_and_unscale_(ref, fi_ref, inv)
    ampc.ops.unscale_check(got, fi_got, inv)
    if fi_got.item() != fi_ref.item() or fi_got.item() != 0.0:
        return f"found_inf is {fi_got.item()} on finite grads"
    for i, (r, g) in enumerate(zip(ref, got)):
        if not torch.equal(bits(r), bits(g)):
            return f"grads[{i}] differs from torch after unscale"
    del ref
    got = [g.clone() for g in grads]
    norm = ampc.ops.unscale_check(got, fi_got, inv, check_only=True)
    want = inv.item() * math.hypot(*(torch.linalg.vector_norm(g, dtype=torch.float64).item() for g in grads))
    if fi_got.item() != 0.0 or not math.isclose(norm.item(), want, rel_tol=1e-4):
        return f"check_only: found_inf {fi_got.item()}, norm {norm.item()} (expected {want})"
    if not all(torch.equal(bits(a), bits(b)) for a, b in zip(got, grads)):
        return "check_only modified the grads"
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
    args = p.parse_args()
    dt, dev = H.DTYPES[args.dtype], args.device
    roof = H.Roofline(args)
    hdr = H.header(args, roof)
    hdr["op"] = f"unscale_check {args.dtype}"
    rows = []
    for case, shapes in H.workloads(2 * dt.itemsize, dev):
        grads = H.randn_list(shapes, dt, dev)
        err = validate(grads, dev)
        if err:
            print(f"FAIL {case}: {err}", file=sys.stderr)
            return 1
        found_inf = torch.zeros(1, device=dev)
        invs = [torch.full((1,), 0.5, device=dev), torch.full((1,), 2.0, device=dev)]

        def alternating(op, **kw):  # each timed fn flips its own inv_scale: x2, x0.5, x2, ...
            k = [0]

            def fn():
                k[0] ^= 1
                return op(grads, found_inf, invs[k[0]], **kw)
            return fn

        numel = sum(g.numel() for g in grads)
        ms, copy_gbs = roof.measure({"torch": alternating(torch._amp_foreach_non_finite_check_and_unscale_),
                                     "unscale": alternating(ampc.ops.unscale_check),
                                     "check": alternating(ampc.ops.unscale_check, check_only=True)}, args.reps)
        for mode, check_only in (("unscale", False), ("check", True)):
            a_ms, t_ms = ms[mode], ms["torch"]
            gb = bytes_moved(numel, dt, check_only) / 1e9
            rows.append({"case": f"{case} {mode}", "ampc ms": a_ms, "torch ms": t_ms, "torch/ampc": t_ms / a_ms,
                         "ampc GB/s": gb / a_ms * 1e3, "% copy": 100 * gb / a_ms * 1e3 / copy_gbs,
                         "copy GB/s": copy_gbs,
                         "tensors": len(grads), "MB moved": gb * 1e3})
        if found_inf.item() != 0.0:
            print(f"FAIL {case}: found_inf set while timing finite grads", file=sys.stderr)
            return 1
        del grads
    H.report(hdr, rows, args.json, [
        f"{hdr['op']}: unscale {2 * dt.itemsize} B/elem (read + write in place), check {dt.itemsize} B/elem (read)",
        "check rows: torch has no read-only mode, so torch ms is the same in-place "
        "_amp_foreach_non_finite_check_and_unscale_ as in the unscale row"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
