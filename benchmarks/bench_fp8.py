"""ampc's fp8 ops vs the fastest torch way to do the same job.

    python benchmarks/bench_fp8.py [--src fp32|fp16|bf16] [--fp8 e4m3|e5m2] [--device cpu|cuda]
                                   [--sections cast,gemm] [--cache cold|warm] [--threads N] [--json]

cast rows: ampc.ops.cast_fp8 (scaled, saturating cast to fp8 with the amax of each input from the same
read) against torch doing the same job per tensor, ``(x.float() * scale).clamp(-m, m).to(fp8)`` and
``x.abs().amax()`` (a loop), and with torch's foreach ops (_foreach_mul, _foreach_clamp_min_/max_,
_foreach_copy_ into the fp8 outputs, _foreach_norm(inf) for the amax). "torch ms" is the fastest of the
two; torch/ampc > 1 means ampc is faster. GB/s counts bytes read plus bytes written (src + 1 byte an
element; the per-tensor scale and amax are left out). "% roofline" compares ampc's GB/s with a large fp32
copy_ (read one stream, write another) timed interleaved with the case (_harness.py). Every timed call
follows an untimed cache flush (--cache warm: the same call). Before anything is timed, ampc's codes and
amaxes are checked bit for bit against the torch loop, and each torch way against it too.

gemm rows (one per transformer GEMM shape): on CUDA, ampc.fp8.gemm's TFLOPS and their share of the H200's
dense FP8 peak (1,979 TFLOPS), torch._scaled_mm's and a bf16 torch.matmul's on the same shape; on the CPU,
the reference path's time against an fp32 matmul of the same shape. Results are checked against
torch._scaled_mm before anything is timed.

There is one table per kind of fp8 work (SECTIONS, --sections); a section's rows share their columns.
"""
import sys

import torch

import _harness as H

ampc = H.import_ampc()

FP8 = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


# ---- cast: cast_fp8 with amax ----

def torch_loop(src, out, scale, amax, m):
    """The op's definition, one tensor at a time."""
    for i, (x, q) in enumerate(zip(src, out)):
        q.copy_((x.float() * scale[i]).clamp_(-m, m))
        amax[i] = x.abs().amax()


def torch_foreach(src, out, scale, amax, m):
    """The same job with torch's multi-tensor ops."""
    ys = torch._foreach_mul([x.float() for x in src], list(scale.unbind()))
    torch._foreach_clamp_min_(ys, -m)
    torch._foreach_clamp_max_(ys, m)
    torch._foreach_copy_(out, ys)
    torch.stack(torch._foreach_norm(src, float("inf")), out=amax)


def same_job(fn, src, fp8, scale, m) -> str:
    """Runs fn(src, out, scale, amax, m) and the torch loop; "" when codes and amaxes agree bit for bit."""
    results = []
    for f in (fn, torch_loop):
        out = [torch.empty_like(x, dtype=fp8) for x in src]
        amax = torch.empty(len(src), device=scale.device)
        f(src, out, scale, amax, m)
        results.append((out, amax))
    (a, amax_a), (b, amax_b) = results
    bad = next((i for i, (x, y) in enumerate(zip(a, b)) if not torch.equal(x.view(torch.uint8), y.view(torch.uint8))),
               None)
    if bad is not None:
        return f"tensor {bad}: fp8 codes differ from the torch loop's"
    return "" if H.same(amax_a, amax_b) else "amax differs from the torch loop's"


def cast_rows(args, roof) -> list:
    sdt, fp8, dev = H.DTYPES[args.src], FP8[args.fp8], args.device
    m = torch.finfo(fp8).max

    def ampc_cast(src, out, scale, amax, m):
        ampc.ops.cast_fp8(out, src, scale, amax)

    err = same_job(ampc_cast, [H.random_bits(sdt, dev)], fp8, torch.full((1,), 3.0, device=dev), m)
    if err:
        raise SystemExit(f"FAIL random bit patterns: {err}")
    rows = []
    for case, shapes in H.workloads(sdt.itemsize + 1, dev):
        src = H.randn_list(shapes, sdt, dev)
        scale = torch.rand(len(src), generator=torch.Generator().manual_seed(2)).add_(0.5).mul_(60).to(dev)
        ways = {"ampc": ampc_cast, "torch loop": torch_loop, "torch foreach": torch_foreach}
        for name, fn in ways.items():
            err = same_job(fn, src, fp8, scale, m)
            if err:
                raise SystemExit(f"FAIL {case}, {name}: {err}")
        print(f"{case}: ampc and both torch ways agree bit for bit, timing", file=sys.stderr)
        out = [torch.empty_like(x, dtype=fp8) for x in src]   # every way writes here: same memory
        amax = torch.empty(len(src), device=dev)
        numel = sum(x.numel() for x in src)
        gb = numel * (sdt.itemsize + 1) / 1e9
        ms, copy_gbs = roof.measure({k: (lambda f=f: f(src, out, scale, amax, m)) for k, f in ways.items()},
                                    args.reps)
        best = min((k for k in ms if k != "ampc"), key=ms.get)
        rows.append(H.row(f"cast_fp8 {case}", ms["ampc"], ms[best], gb, copy_gbs, **{
            "torch best": best, "loop ms": ms["torch loop"], "foreach ms": ms["torch foreach"],
            "tensors": len(src), "MB moved": gb * 1e3}))
        del src, out
    return rows


# ---- GEMM: ampc.fp8.gemm against torch._scaled_mm and bf16 torch.matmul ----

H200_FP8_DENSE_TFLOPS = 1979.0
# (name, tokens m, k, n): the four GEMMs of a transformer layer's forward, GPT-style widths
GEMM_SHAPES_CUDA = [(f"d{d} {name}", 8192, k, n) for d in (1024, 4096)
                    for name, k, n in (("qkv", d, 3 * d), ("proj", d, d), ("fc1", d, 4 * d),
                                       ("fc2", 4 * d, d))]
GEMM_SHAPES_CPU = [(f"d{d} {name}", 256, k, n) for d in (256, 1024)
                   for name, k, n in (("qkv", d, 3 * d), ("fc2", 4 * d, d))]


def gemm_operands(m: int, k: int, n: int, device: str):
    g = torch.Generator().manual_seed(0)
    a = (torch.randn(m, k, generator=g) * 4).to(torch.float8_e4m3fn).to(device)
    b = (torch.randn(n, k, generator=g) * 4).to(torch.float8_e4m3fn).to(device).t()
    one = torch.tensor([0.5], device=device)
    return a, b, one


def gemm_rows(args, roof) -> list:
    """One row per shape: on CUDA, TFLOPS of ampc.fp8.gemm, torch._scaled_mm and bf16 matmul
    and ampc's share of the H200's dense FP8 peak; on the CPU, the reference path against an
    fp32 matmul of the same shape. Results are checked against torch's before timing."""
    cuda = args.device == "cuda"
    rows = []
    for case, m, k, n in GEMM_SHAPES_CUDA if cuda else GEMM_SHAPES_CPU:
        a, b, s = gemm_operands(m, k, n, args.device)
        flop = 2 * m * n * k
        ours = lambda: ampc.fp8.gemm(a, b, s, s, out_dtype=torch.bfloat16)  # noqa: E731
        theirs = lambda: torch._scaled_mm(a, b, s[0], s[0], out_dtype=torch.bfloat16)  # noqa: E731
        if cuda:
            a16, b16 = a.to(torch.bfloat16), b.to(torch.bfloat16)
            fns = {"ampc": ours, "torch._scaled_mm": theirs, "bf16 matmul": lambda: a16 @ b16}
        else:
            a32, b32 = a.float(), b.float()
            fns = {"ampc": ours, "fp32 matmul": lambda: a32 @ b32}
        got, want = ours().float(), theirs().float()
        if not torch.allclose(got, want, rtol=2 ** -7, atol=1e-3 * want.abs().max().item()):
            raise SystemExit(f"FAIL gemm {case}: ampc.fp8.gemm differs from torch._scaled_mm")
        print(f"gemm {case}: ampc agrees with torch._scaled_mm, timing", file=sys.stderr)
        ms = H.time_ms(fns, args.device, args.reps, warm=True)
        tflops = {name: flop / t / 1e9 for name, t in ms.items()}
        if cuda:
            rows.append({"case": f"gemm {case} {m}x{k}x{n}", "ampc ms": ms["ampc"],
                         "torch ms": ms["torch._scaled_mm"],
                         "torch/ampc": ms["torch._scaled_mm"] / ms["ampc"],
                         "ampc TFLOPS": tflops["ampc"],
                         "% of 1979 peak": 100 * tflops["ampc"] / H200_FP8_DENSE_TFLOPS,
                         "_scaled_mm TFLOPS": tflops["torch._scaled_mm"],
                         "bf16 matmul TFLOPS": tflops["bf16 matmul"]})
        else:
            rows.append({"case": f"gemm {case} {m}x{k}x{n}", "ampc ms": ms["ampc"],
                         "torch ms": ms["fp32 matmul"],
                         "torch/ampc": ms["fp32 matmul"] / ms["ampc"],
                         "ampc GFLOPS": 1e3 * tflops["ampc"]})
    return rows


# One entry per kind of fp8 work: name -> (function(args, roofline) -> rows, note for the table).
SECTIONS = {
    "cast": (cast_rows, "cast_fp8 {src} -> {fp8} with amax: {bpe} B/elem; torch ms = fastest of the "
                        "torch loop and the foreach ops"),
    "gemm": (gemm_rows, "gemm e4m3 x e4m3 -> bf16, fp32 accumulation: on CUDA ampc.fp8.gemm (cuBLASLt) "
                        "against torch._scaled_mm (torch ms) and a bf16 matmul of the same shape, TFLOPS = "
                        "2mnk / time; on the CPU the reference path (widen to fp32, fp32 matmul, "
                        "scale) against an fp32 matmul (torch ms): it costs that matmul and more"),
}


def main() -> int:
    p = H.common_args(__doc__)
    p.add_argument("--src", choices=list(H.DTYPES), default="bf16")
    p.add_argument("--fp8", choices=list(FP8), default="e4m3")
    p.add_argument("--sections", default=",".join(SECTIONS),
                   help=f"comma-separated, of {', '.join(SECTIONS)} (default: all)")
    args = H.parse(p)
    names = args.sections.split(",")
    unknown = [n for n in names if n not in SECTIONS]
    if unknown:
        p.error(f"unknown sections {unknown}; choose from {list(SECTIONS)}")
    roof = H.Roofline(args)
    hdr = H.header(args, roof)
    tables = []     # one table per section: their columns differ
    for name in names:
        fn, note = SECTIONS[name]
        tables.append((fn(args, roof), [note.format(src=args.src, fp8=args.fp8,
                                                    bpe=H.DTYPES[args.src].itemsize + 1)]))
    if args.json:           # one document, as scripts/gpu_check.sh reads it
        H.report(hdr, [r for rows, _ in tables for r in rows], True,
                 [n for _, notes in tables for n in notes])
        return 0
    for rows, notes in tables:
        H.report(hdr, rows, False, notes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
