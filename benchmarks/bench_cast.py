"""ampc.ops.cast_ (fused multi-tensor cast) vs the fastest torch way to do the same job.

    python benchmarks/bench_cast.py [--src fp32] [--dst bf16] [--device cpu|cuda] [--json] [--reps N]

Torch baselines, all timed in the same run: torch._foreach_copy_(dst, src), a per-tensor dst.copy_(src)
loop and a per-tensor src.to(dtype) loop (which also allocates). "torch ms" is the fastest of the three.
ratio = torch ms / ampc ms (> 1: ampc is faster). GB/s counts bytes read plus bytes written; "% copy" is
against a large same-dtype torch copy measured in the same run. ampc's output is checked bit for bit
against Tensor.to before anything is timed. Sample (2-core CPU):

SAMPLE
"""
import sys

import torch

import _harness as H

ampc = H.import_ampc()


def bytes_moved(numel: int, src: torch.dtype, dst: torch.dtype) -> int:
    # read each source element once, write each destination element once: fp32 -> bf16 = 4 + 2 = 6 B/elem
    return numel * (src.itemsize + dst.itemsize)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({1: torch.int8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def main() -> int:
    p = H.common_args(__doc__)
    p.add_argument("--src", choices=list(H.DTYPES), default="fp32")
    p.add_argument("--dst", choices=list(H.DTYPES), default="bf16")
    args = p.parse_args()
    if args.src == args.dst:
        p.error("--src and --dst must differ (Tensor.to would return its input)")
    sdt, ddt, dev = H.DTYPES[args.src], H.DTYPES[args.dst], args.device
    roof = H.Roofline(args)
    hdr = H.header(args, roof)
    hdr["op"] = f"cast {args.src} -> {args.dst}"
    rows = []
    for case, shapes in H.workloads(sdt.itemsize + ddt.itemsize, dev):
        src = H.randn_list(shapes, sdt, dev)
        out = [torch.empty_like(s, dtype=ddt) for s in src]  # ampc and torch write here: same memory
        ampc.ops.cast_(out, src)
        for i, (o, s) in enumerate(zip(out, src)):  # validate before timing
            if not torch.equal(bits(o), bits(s.to(ddt))):
                print(f"FAIL {case}: tensor {i}: ampc cast differs from Tensor.to", file=sys.stderr)
                return 1
        numel = sum(s.numel() for s in src)
        gb = bytes_moved(numel, sdt, ddt) / 1e9
        ms, copy_gbs = roof.measure({"ampc": lambda: ampc.ops.cast_(out, src),
                                     "foreach_copy_": lambda: torch._foreach_copy_(out, src),
                                     "copy_ loop": lambda: [d.copy_(s) for d, s in zip(out, src)],
                                     ".to loop": lambda: [s.to(ddt) for s in src]}, args.reps)
        best = min((k for k in ms if k != "ampc"), key=ms.get)
        rows.append({"case": case, "ampc ms": ms["ampc"], "torch ms": ms[best],
                     "torch/ampc": ms[best] / ms["ampc"], "ampc GB/s": gb / ms["ampc"] * 1e3,
                     "% copy": 100 * gb / ms["ampc"] * 1e3 / copy_gbs, "copy GB/s": copy_gbs,
                     "torch best": best, "foreach ms": ms["foreach_copy_"], "copy_ ms": ms["copy_ loop"],
                     ".to ms": ms[".to loop"], "tensors": len(src), "MB moved": gb * 1e3})
        del src, out
    H.report(hdr, rows, args.json, [f"{hdr['op']}: {sdt.itemsize + ddt.itemsize} B/elem; "
                                    "torch ms = fastest of foreach_copy_, copy_ loop, .to loop"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
