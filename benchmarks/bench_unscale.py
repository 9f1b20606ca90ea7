"""ampc.ops.unscale_check (fused multi-tensor unscale + inf/nan check) vs torch's GradScaler kernel.

    python benchmarks/bench_unscale.py [--dtype fp32|fp16|bf16] [--device cpu|cuda] [--cache cold|warm] [--json]

Baseline: torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale), timed in the same
run on the same grads; torch/ampc > 1 means ampc is faster. The "check" rows time ampc's read-only mode
(check_only=True: found_inf and the grad norm, grads untouched) against that same in-place torch op, since
torch has no read-only mode. GB/s counts bytes read plus bytes written; "% copy" is against a large
same-dtype copy_ timed interleaved with the case (see _harness.py). The copy also pulls each destination
line in before writing it, which an in-place op does not, so in-place ops can pass 100%. Timed calls
alternate inv_scale between 2.0 and 0.5, so the grads return to their values exactly, and each follows an
untimed cache flush (--cache warm: the same call). ampc is checked against torch (bits, found_inf, norm,
also on random bit patterns) before anything is timed. Sample (2-core CPU):

    torch 2.14.1+cu130 | device cpu (AMD EPYC) | threads 2 | cache cold | copy_gbs 31.0 | copy_gbs_source measured at start | op unscale_check fp32 | other_procs_cpu_pct 0.3
    case                          | ampc ms | torch ms | torch/ampc | ampc GB/s | % copy | copy GB/s | tensors | MB moved
    ------------------------------+---------+----------+------------+-----------+--------+-----------+---------+---------
    large 1x134M unscale          |    20.4 |     20.5 |      1.002 |      52.6 |  178.3 |      29.5 |       1 |   1073.7
    large 1x134M check            |    17.0 |     20.5 |      1.203 |      31.6 |  107.1 |      29.5 |       1 |    536.9
    1000 small 1k-16k unscale     |   1.779 |    2.173 |      1.221 |      38.4 |   93.2 |      41.1 |    1000 |     68.3
    1000 small 1k-16k check       |   1.622 |    2.173 |      1.340 |      21.0 |   51.1 |      41.1 |    1000 |     34.1
    gpt2-124M 148 tensors unscale |    11.8 |     12.2 |      1.030 |      84.3 |  211.9 |      39.8 |     148 |    995.5
    gpt2-124M 148 tensors check   |    10.6 |     12.2 |      1.147 |      47.0 |  118.1 |      39.8 |     148 |    497.8
    note: unscale_check fp32: unscale 8 B/elem (read + write in place), check 4 B/elem (read)
    note: check rows: torch has no read-only mode, so torch ms is the same in-place _amp_foreach_non_finite_check_and_unscale_ as in the unscale row
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
    roof = H.Roofline(args)
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
        ms, copy_gbs = roof.measure({"torch": alternating(torch._amp_foreach_non_finite_check_and_unscale_),
                                     "unscale": alternating(ampc.ops.unscale_check),
                                     "check": alternating(ampc.ops.unscale_check, check_only=True)}, args.reps)
        for mode, check_only in (("unscale", False), ("check", True)):
            gb = bytes_moved(numel, dt, check_only) / 1e9
            rows.append(H.row(f"{case} {mode}", ms[mode], ms["torch"], gb, copy_gbs,
                              tensors=len(grads), **{"MB moved": gb * 1e3}))
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
