"""Shared pieces of the benchmarks: timing, the copy-bandwidth roofline, the header and the table."""
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
    """(case name, list of shapes): one large tensor moving >= 1 GiB (4 GiB on CUDA), 1,000 small ones, GPT-2."""
    large = -(-GiB * (4 if device == "cuda" else 1) // bytes_per_elem)
    large = -(-large // 4096) * 4096
    g = torch.Generator().manual_seed(0)
    small = [(int(n),) for n in torch.randint(1024, 16385, (1000,), generator=g)]
    return [(f"large 1x{large / 1e6:.0f}M", [(large,)]),
            ("1000 small 1k-16k", small),
            ("gpt2-124M 148 tensors", gpt2_shapes())]


def randn_list(shapes: list, dtype: torch.dtype, device: str, seed: int = 0) -> list:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g).to(device=device, dtype=dtype) for s in shapes]


def common_args(doc: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=doc.strip().splitlines()[0])
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--json", action="store_true", help="print JSON instead of the table")
    p.add_argument("--reps", type=int, default=0, help="timed rounds per case (0: about 4 s worth)")
    p.add_argument("--peak-gbs", type=float, default=0.0, help="use this bandwidth instead of measuring it")
    return p


def time_ms(fns: dict, device: str, reps: int = 0, warmup: int = 2) -> dict:
    """Median wall time in ms of each fn in {name: fn}, cold caches: every rep follows an untimed pass
    over 512 MiB (more than the last-level cache; a read on CPU so that no dirty lines are left behind).
    Reps are interleaved (a, b, c, a, b, c, ...) so that machine noise hits every fn alike.
    CUDA: events and synchronize. CPU: perf_counter."""
    buf = torch.ones(512 << 20, dtype=torch.uint8, device=device)
    flush = buf.zero_ if device == "cuda" else buf.max
    t0 = time.perf_counter()
    for _ in range(warmup):
        for fn in fns.values():
            flush()
            fn()
    if device == "cuda":
        torch.cuda.synchronize()
    if reps <= 0:  # about 4 s of timed rounds, 5..200 of them
        reps = max(5, min(200, int(4.0 * warmup / max(time.perf_counter() - t0, 1e-6))))
    times = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            flush()
            if device == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times[name].append(start.elapsed_time(end))
            else:
                t = time.perf_counter()
                fn()
                times[name].append((time.perf_counter() - t) * 1e3)
    return {name: statistics.median(t) for name, t in times.items()}


class Roofline:
    """Copy bandwidth: a large same-dtype dst.copy_(src), counted as bytes read plus bytes written
    (fp32, 1 GiB moved on CPU, 4 GiB on CUDA). Memory bandwidth on a shared machine drifts by 2x and
    more within minutes, so measure() times the copy interleaved with the fns it is compared to."""

    def __init__(self, args):
        self.device, self.fixed = args.device, args.peak_gbs
        if not self.fixed:
            numel = GiB // 8 * (4 if args.device == "cuda" else 1)
            self.src = torch.ones(numel, dtype=torch.float32, device=args.device)
            self.dst = torch.zeros_like(self.src)  # both touched already, so no page faults are timed
            self.gb = 2 * self.src.nbytes / 1e9
        self.start_gbs = self.measure({}, reps=10)[1]

    def measure(self, fns: dict, reps: int = 0):
        """(median ms per fn, copy GB/s measured alongside them, or --peak-gbs if given)"""
        ms = time_ms({**fns, "copy": lambda: self.dst.copy_(self.src)} if not self.fixed else fns,
                     self.device, reps)
        return ms, self.fixed or self.gb / ms.pop("copy") * 1e3


def device_name(device: str) -> str:
    if device == "cuda":
        return torch.cuda.get_device_name()
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def header(args, roof: Roofline) -> dict:
    return {"torch": torch.__version__, "device": f"{args.device} ({device_name(args.device)})",
            "threads": torch.get_num_threads(), "load_1min": round(os.getloadavg()[0], 2),
            "copy_gbs": round(roof.start_gbs, 1),
            "copy_gbs_source": "given" if roof.fixed else "measured at start"}


def report(hdr: dict, rows: list, as_json: bool, notes=()) -> None:
    """Prints the header, one table row per dict (columns = the first row's keys) and notes, or all as JSON."""
    if as_json:
        print(json.dumps({"header": hdr, "rows": rows, "notes": list(notes)}, indent=1))
        return
    print(f"torch {hdr['torch']} | {hdr['device']} | {hdr['threads']} threads | load {hdr['load_1min']} | "
          f"copy {hdr['copy_gbs']} GB/s ({hdr['copy_gbs_source']})")
    fmt = lambda v: f"{v:.3f}" if isinstance(v, float) and abs(v) < 10 else (f"{v:.1f}" if isinstance(v, float) else str(v))
    cols = list(rows[0])
    cells = [[fmt(r[c]) for c in cols] for r in rows]
    widths = [max(len(c), *(len(r[i]) for r in cells)) for i, c in enumerate(cols)]
    print(" | ".join(c.ljust(w) for c, w in zip(cols, widths)))
    print("-+-".join("-" * w for w in widths))
    for r in cells:
        print(" | ".join(v.rjust(w) if i else v.ljust(w) for i, (v, w) in enumerate(zip(r, widths))))
    for n in notes:
        print(f"note: {n}")
