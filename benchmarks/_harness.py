"""Shared by the benchmarks: workloads, timing, the copy-bandwidth roofline, the header and the table."""
import argparse
import json
import os
import pathlib
import platform
import statistics
import sys
import time

import torch

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
GiB = 1 << 30


def import_ampc():
    try:
        import ampc
    except ImportError:  # run from a source checkout with the extension built in place
        sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
        import ampc
    return ampc


def gpt2_shapes() -> list:
    """Parameter shapes of GPT-2 small (124M parameters, 148 tensors), in module order."""
    layer = [(768,), (768,), (768, 2304), (2304,), (768, 768), (768,),  # ln_1, attn.c_attn, attn.c_proj
             (768,), (768,), (768, 3072), (3072,), (3072, 768), (768,)]  # ln_2, mlp.c_fc, mlp.c_proj
    return [(50257, 768), (1024, 768)] + layer * 12 + [(768,), (768,)]  # wte, wpe, h.0-11, ln_f


def workloads(bytes_per_elem: int, device: str) -> list:
    """(case, shapes): one tensor moving >= 1 GiB (4 GiB on CUDA), 1,000 small ones (seeded), GPT-2's list."""
    large = -(-GiB * (4 if device == "cuda" else 1) // bytes_per_elem // 4096) * 4096
    small = torch.randint(1024, 16385, (1000,), generator=torch.Generator().manual_seed(0)).tolist()
    return [(f"large 1x{large / 1e6:.0f}M", [(large,)]), ("1000 small 1k-16k", [(n,) for n in small]),
            ("gpt2-124M 148 tensors", gpt2_shapes())]


def randn_list(shapes: list, dtype: torch.dtype, device: str) -> list:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(s, generator=g).to(device=device, dtype=dtype) for s in shapes]


def random_bits(dtype: torch.dtype, device: str, n: int = 1 << 16) -> torch.Tensor:
    """Every bit pattern equally likely: all exponents, subnormals, ties, infs and NaNs with payloads."""
    ints = {2: torch.int16, 4: torch.int32}[dtype.itemsize]
    info = torch.iinfo(ints)
    g = torch.Generator().manual_seed(1)
    return torch.randint(info.min, info.max + 1, (n,), dtype=ints, generator=g).view(dtype).to(device)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit equal, except that a NaN matches any NaN: torch's NaN bits depend on its code path
    (on CPU fp32 -> bf16 writes 0xffff, fp16 -> bf16 writes 0x7fc0), so no payload is the right one."""
    ints = {1: torch.int8, 2: torch.int16, 4: torch.int32}[a.element_size()]
    return a.dtype == b.dtype and bool(((a.view(ints) == b.view(ints)) | (a.isnan() & b.isnan())).all())


def common_args(doc: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=doc.strip().splitlines()[0])
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--json", action="store_true", help="print JSON instead of the table")
    p.add_argument("--cache", choices=["cold", "warm"], default="cold",
                   help="before each timed rep: flush the caches (cold) or run the same fn once (warm)")
    p.add_argument("--reps", type=int, default=0, help="timed rounds per case (0: about 4 s worth)")
    p.add_argument("--peak-gbs", type=float, default=0.0, help="use this copy bandwidth instead of measuring it")
    p.add_argument("--threads", type=int, default=0,
                   help="torch.set_num_threads for both sides (0: torch's default)")
    return p


def parse(p: argparse.ArgumentParser) -> argparse.Namespace:
    """Parses the command line and applies --threads."""
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    return args


def time_ms(fns: dict, device: str, reps: int = 0, warm: bool = False) -> dict:
    """Median ms of each fn in {name: fn}. Before each timed rep, untimed: a pass over 512 MiB to flush
    the caches (a read on CPU, so no dirty lines are left to write back), or with warm=True the same fn.
    Reps are interleaved (a, b, c, a, b, c, ...) so that machine noise hits every fn alike."""
    buf = torch.ones(512 << 20, dtype=torch.uint8, device=device)
    flush = buf.zero_ if device == "cuda" else buf.max

    def one(fn) -> float:
        (fn if warm else flush)()
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end)
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3

    t0 = time.perf_counter()
    for fn in fns.values():  # warm-up round
        one(fn)
    reps = reps or max(5, min(200, int(4.0 / max(time.perf_counter() - t0, 1e-6))))
    times = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            times[name].append(one(fn))
    return {name: statistics.median(t) for name, t in times.items()}


class Roofline:
    """Copy bandwidth: a large same-dtype dst.copy_(src) (fp32, 1 GiB read + written on CPU, 4 GiB on CUDA),
    counted as bytes read plus bytes written. On a shared machine memory bandwidth drifts 2x within
    minutes, so measure() times the copy interleaved with the fns it is compared to."""

    def __init__(self, args):
        self.device, self.warm, self.fixed = args.device, args.cache == "warm", args.peak_gbs
        if not self.fixed:
            self.src = torch.ones(GiB // 8 * (4 if args.device == "cuda" else 1), device=args.device)
            self.dst = torch.zeros_like(self.src)  # both touched already, so no page faults are timed
        self.start_gbs = self.fixed or self.measure({}, reps=10)[1]

    def measure(self, fns: dict, reps: int = 0):
        """(median ms per fn, copy GB/s measured alongside them or --peak-gbs)"""
        copy = {} if self.fixed else {"copy": lambda: self.dst.copy_(self.src)}
        ms = time_ms({**fns, **copy}, self.device, reps, self.warm)
        return ms, self.fixed or 2 * self.src.nbytes / ms.pop("copy") / 1e6


def row(case: str, ampc_ms: float, torch_ms: float, gb: float, copy_gbs: float, **extra) -> dict:
    return {"case": case, "ampc ms": ampc_ms, "torch ms": torch_ms, "torch/ampc": torch_ms / ampc_ms,
            "ampc GB/s": gb / ampc_ms * 1e3, "% copy": 100 * gb / ampc_ms * 1e3 / copy_gbs,
            "copy GB/s": copy_gbs, **extra}


def _cpu_busy_s() -> float:
    """CPU seconds spent busy since boot, all CPUs and processes (Linux), else 0."""
    try:
        with open("/proc/stat") as f:
            ticks = [int(x) for x in f.readline().split()[1:9]]
        return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError):
        return 0.0


_START = (time.monotonic(), _cpu_busy_s(), sum(os.times()[:2]))


def header(args, roof: Roofline) -> dict:
    name = torch.cuda.get_device_name() if args.device == "cuda" else platform.processor()
    if args.device == "cpu" and os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            name = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), name)
    return {"torch": torch.__version__, "device": f"{args.device} ({name})", "threads": torch.get_num_threads(),
            "cache": args.cache, "copy_gbs": round(roof.start_gbs, 1),
            "copy_gbs_source": "given" if roof.fixed else "measured at start"}


def report(hdr: dict, rows: list, as_json: bool, notes: list) -> None:
    """Prints the header, one table row per dict and the notes, or all of it as JSON."""
    wall, busy, mine = time.monotonic() - _START[0], _cpu_busy_s() - _START[1], sum(os.times()[:2]) - _START[2]
    hdr["other_procs_cpu_pct"] = round(max(0.0, 100 * (busy - mine) / (wall * os.cpu_count())), 1)
    if hdr["other_procs_cpu_pct"] > 5:
        notes.append(f"other processes used {hdr['other_procs_cpu_pct']}% of the CPUs during this run: "
                     "the times are not trustworthy")
    if as_json:
        print(json.dumps({"header": hdr, "rows": rows, "notes": notes}, indent=1))
        return
    print(" | ".join(f"{k} {v}" for k, v in hdr.items()))
    fmt = lambda v: (f"{v:.3f}" if abs(v) < 10 else f"{v:.1f}") if isinstance(v, float) else str(v)
    cells = [list(rows[0])] + [[fmt(v) for v in r.values()] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(cells[0]))]
    right = [isinstance(v, (int, float)) for v in rows[0].values()]  # numbers right-aligned, text left
    for i, r in enumerate(cells):
        print(" | ".join(v.rjust(w) if rj else v.ljust(w) for v, w, rj in zip(r, widths, right)))
        if i == 0:
            print("-+-".join("-" * w for w in widths))
    for n in notes:
        print(f"note: {n}")
