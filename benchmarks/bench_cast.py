"""ampc.ops.cast_ (fused multi-tensor cast) vs the fastest torch way to do the same job.

    python benchmarks/bench_cast.py [--src fp32] [--dst bf16] [--device cpu|cuda] [--cache cold|warm] [--json]

Baselines, timed in the same run into the same output tensors: torch._foreach_copy_(dst, src), a per-tensor
dst.copy_(src) loop and a per-tensor src.to(dtype) loop (which also allocates). "torch ms" is the fastest of
the three; torch/ampc > 1 means ampc is faster. GB/s counts bytes read plus bytes written. "% roofline"
compares ampc's GB/s with the op of the same access pattern, a large same-dtype fp32 copy_ (read one
stream, write another), timed interleaved with the case (see _harness.py: on a shared machine the bandwidth
drifts). Every timed call follows an untimed cache flush (--cache warm: the same call). ampc's output is
checked against Tensor.to before anything is timed.

The large and 1000-small cases also run as views into one flat buffer, each starting an odd number of
elements past a 16-byte boundary: "misaligned alike" (source and destination start the same number of
elements before the boundary: a scalar head, then full vectors) and "misaligned apart" (the source off by
one element, the destination aligned: narrower vectors on CUDA, Note [misaligned views]).
"""
import math
import sys

import torch

import _harness as H

ampc = H.import_ampc()


def bytes_moved(numel: int, src: torch.dtype, dst: torch.dtype) -> int:
    # read each source element once, write each destination element once: fp32 -> bf16 = 4 + 2 = 6 B/elem
    return numel * (src.itemsize + dst.itemsize)


def flat_views(shapes: list, dtype: torch.dtype, device: str, head: int) -> list:
    """Views of one flat buffer, each `head` elements before a 16-byte boundary (0: aligned)."""
    per16 = 16 // dtype.itemsize
    offset = (per16 - head) % per16
    starts, at = [], 0
    for s in shapes:
        n = math.prod(s)
        starts.append((at + offset, n, s))
        at += -(-(n + offset) // per16) * per16
    flat = torch.empty(at, dtype=dtype, device=device)
    return [flat[a:a + n].view(s) for a, n, s in starts]


def misaligned(src: list, ddt: torch.dtype, alike: bool) -> tuple:
    """(src, dst) as flat-buffer views: both 3 elements before a boundary, or src 3 and dst 0."""
    shapes = [tuple(s.shape) for s in src]
    views = flat_views(shapes, src[0].dtype, src[0].device.type, 3)
    for v, s in zip(views, src):
        v.copy_(s)
    return views, flat_views(shapes, ddt, src[0].device.type, 3 if alike else 0)


def validate(src: list, ddt: torch.dtype, out: list = None) -> str:
    """Returns "" when ampc's cast (into `out`, or new tensors) equals Tensor.to, else what differs."""
    out = out or [torch.empty_like(s, dtype=ddt) for s in src]
    ampc.ops.cast_(out, src)
    bad = next((i for i, (o, s) in enumerate(zip(out, src)) if not H.same(o, s.to(ddt))), None)
    return "" if bad is None else f"tensor {bad}: ampc cast differs from Tensor.to"


def main() -> int:
    p = H.common_args(__doc__)
    p.add_argument("--src", choices=list(H.DTYPES), default="fp32")
    p.add_argument("--dst", choices=list(H.DTYPES), default="bf16")
    args = H.parse(p)
    if args.src == args.dst:
        p.error("--src and --dst must differ (Tensor.to would return its input)")
    sdt, ddt, dev = H.DTYPES[args.src], H.DTYPES[args.dst], args.device
    roof = H.Roofline(args)
    hdr = H.header(args, roof)
    hdr["op"] = f"cast {args.src} -> {args.dst}"
    rows = []
    err = validate([H.random_bits(sdt, dev)], ddt)
    if err:
        print(f"FAIL random bit patterns: {err}", file=sys.stderr)
        return 1
    for case, shapes in H.workloads(sdt.itemsize + ddt.itemsize, dev):
        layouts = [("", None)]
        if not case.startswith("gpt2"):
            layouts += [(", misaligned alike", True), (", misaligned apart", False)]
        for layout, alike in layouts:
            src = H.randn_list(shapes, sdt, dev)
            out = [torch.empty_like(s, dtype=ddt) for s in src]  # ampc and torch write here
            if alike is not None:
                src, out = misaligned(src, ddt, alike)
            err = validate(src, ddt, out)
            if err:
                print(f"FAIL {case}{layout}: {err}", file=sys.stderr)
                return 1
            print(f"{case}{layout}: ampc matches Tensor.to bit for bit, timing", file=sys.stderr)
            numel = sum(s.numel() for s in src)
            gb = bytes_moved(numel, sdt, ddt) / 1e9
            ms, copy_gbs = roof.measure({"ampc": lambda: ampc.ops.cast_(out, src),
                                         "foreach_copy_": lambda: torch._foreach_copy_(out, src),
                                         "copy_ loop": lambda: [d.copy_(s) for d, s in zip(out, src)],
                                         ".to loop": lambda: [s.to(ddt) for s in src]}, args.reps)
            best = min((k for k in ms if k != "ampc"), key=ms.get)
            rows.append(H.row(case + layout, ms["ampc"], ms[best], gb, copy_gbs, **{
                "torch best": best, "foreach ms": ms["foreach_copy_"], "copy_ ms": ms["copy_ loop"],
                ".to ms": ms[".to loop"], "tensors": len(src), "MB moved": gb * 1e3}))
            del src, out
    H.report(hdr, rows, args.json, [f"{hdr['op']}: {sdt.itemsize + ddt.itemsize} B/elem; "
                                    "torch ms = fastest of foreach_copy_, copy_ loop, .to loop"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
