"""Shared by the benchmarks: workloads, timing, the rooflines, the header and the table."""
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
    p.add_argument("--peak-gbs", type=float, default=0.0,
                   help="use this roofline GB/s instead of measuring torch's op of the same access pattern")
    p.add_argument("--threads", type=int, default=0,
                   help="torch.set_num_threads for both sides (0: torch's default)")
    return p


def parse(p: argparse.ArgumentParser) -> argparse.Namespace:
    """Parses the command line and applies --threads."""
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    return args


def optimizer_step(opt, scaler=None) -> None:
    """opt.step(), through ``scaler`` (step, then update) where a plan gave one."""
    if scaler is None:
        opt.step()
    else:
        scaler.step(opt)
        scaler.update()


def time_reps(fns: dict, device: str, reps: int = 0, warm: bool = False) -> dict:
    """Every timed rep of each fn in {name: fn}, in ms. Before each timed rep, untimed: a pass over 512 MiB
    to flush the caches (a read on CPU, so no dirty lines are left to write back), or with warm=True the same
    fn. Reps are interleaved (a, b, c, a, b, c, ...) so that machine noise hits every fn alike."""
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
    return times


def time_ms(fns: dict, device: str, reps: int = 0, warm: bool = False) -> dict:
    """Median ms of each fn in {name: fn}, timed as time_reps does."""
    return {name: statistics.median(t) for name, t in time_reps(fns, device, reps, warm).items()}


# The roofline of an op: torch doing a plain op of the same access pattern over a large fp32 tensor (512 MiB
# on the CPU, 2 GiB on CUDA), as GB/s of bytes read plus bytes written. (label, bytes moved per byte of tensor)
ROOFLINES = {
    "copy": ("copy_ (same dtype, src to dst)", 2),  # read one array, write another: a cast
    "mul_": ("mul_ (in place)", 2),                  # read and write the same lines: unscale, Adam
    "sum": ("sum (read only)", 1),                   # read only: the check
}


class Roofline:
    """Times the torch ops of the given access patterns (ROOFLINES keys) interleaved with the fns they are
    compared to, since on a shared machine memory bandwidth drifts 2x within minutes. measure() returns the
    first pattern's GB/s; self.gbs holds every pattern's from the latest measure()."""

    def __init__(self, args, patterns=("copy",)):
        self.device, self.warm, self.fixed = args.device, args.cache == "warm", args.peak_gbs
        self.patterns = tuple(patterns)
        if not self.fixed:
            self.src = torch.ones(GiB // 8 * (4 if args.device == "cuda" else 1), device=args.device)
            self.dst = torch.zeros_like(self.src)  # both touched already, so no page faults are timed
        self.gbs = {}

    def _op(self, pattern):
        return {"copy": lambda: self.dst.copy_(self.src), "mul_": lambda: self.dst.mul_(1.0),
                "sum": self.src.sum}[pattern]

    def measure(self, fns: dict, reps: int = 0):
        """(median ms per fn, GB/s of the first pattern measured alongside them, or --peak-gbs)"""
        refs = {} if self.fixed else {f"roofline {k}": self._op(k) for k in self.patterns}
        self.reps = time_reps({**fns, **refs}, self.device, reps, self.warm)     # for spreads
        ms = {name: statistics.median(t) for name, t in self.reps.items()}
        for k in self.patterns:
            t = ms.pop(f"roofline {k}", None)
            self.gbs[k] = self.fixed or ROOFLINES[k][1] * self.src.nbytes / t / 1e6
        return ms, self.gbs[self.patterns[0]]

    def label(self, pattern=None) -> str:
        return ROOFLINES[pattern or self.patterns[0]][0]


def row(case: str, ampc_ms: float, torch_ms: float, gb: float, roof_gbs: float, roofline: str = "copy_",
        **extra) -> dict:
    """One table row; "% roofline" is ampc's GB/s over that of torch's op of the same access pattern."""
    return {"case": case, "ampc ms": ampc_ms, "torch ms": torch_ms, "torch/ampc": torch_ms / ampc_ms,
            "ampc GB/s": gb / ampc_ms * 1e3, "roofline": roofline, "roofline GB/s": roof_gbs,
            "% roofline": 100 * gb / ampc_ms * 1e3 / roof_gbs, **extra}


def _cpu_busy_s() -> float:
    """CPU seconds spent busy since boot, all CPUs and processes (Linux), else 0."""
    try:
        with open("/proc/stat") as f:
            ticks = [int(x) for x in f.readline().split()[1:9]]
        return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError):
        return 0.0


_START = (time.monotonic(), _cpu_busy_s(), sum(os.times()[:2]))


def cpu_isa() -> str:
    """The CPU's vector ISA as it matters here, torch's kernel choice, and any cap set in the environment."""
    flags = set()
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            flags = set(next((ln.split(":", 1)[1].split() for ln in f if ln.startswith("flags")), []))
    extra = [n for f, n in (("avx512_bf16", "BF16"), ("avx512_fp16", "FP16"), ("amx_bf16", "AMX")) if f in flags]
    isa = (f"AVX-512 ({', '.join(extra) or 'no BF16'})" if "avx512f" in flags
           else "AVX2 only" if "avx2" in flags else platform.machine())
    caps = [f"{k}={os.environ[k]}" for k in ("AMPC_CPU_ISA", "ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA")
            if k in os.environ]
    return ", ".join([isa, f"torch {torch.backends.cpu.get_cpu_capability()}"] + caps)


def machine(device: str) -> dict:
    """What a figure needs to name: torch, the device (CPU model and ISA), threads and the command."""
    if device == "cuda":
        name = torch.cuda.get_device_name()
    else:
        name = platform.processor()
        if os.path.exists("/proc/cpuinfo"):
            with open("/proc/cpuinfo") as f:
                name = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), name)
        name = f"{name}, {cpu_isa()}"
    return {"torch": torch.__version__, "device": f"{device} ({name})", "threads": torch.get_num_threads(),
            "command": " ".join(["python", os.path.relpath(sys.argv[0])] + sys.argv[1:])}


def header(args, roof: Roofline) -> dict:
    hdr = machine(args.device)
    hdr.update(cache=args.cache, roofline=", ".join(roof.label(k) for k in roof.patterns),
               roofline_source="given" if roof.fixed else "measured alongside each case")
    return hdr


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
