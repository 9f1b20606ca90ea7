"""The matmul probe: which candidates run so slowly on this device that search does not
try them (fp16 on most CPUs, bf16 without AVX-512 BF16 or AMX, fp8's exact CPU path)."""
from __future__ import annotations

import math
import time

import torch

import ampc      # its fp8 attribute loads ampc.fp8 (and torch._dynamo) on first use only
from . import _candidates, _measure

SLOW = 4.0       # a candidate whose matmul is this many times slower than fp32 is not tried


def _matmul_ms(choice, device, n=512, reps=20, seconds=0.2):
    """Milliseconds of an (n x n) @ (n x n) at ``choice`` (fp8: an ampc.fp8.Linear) and in
    fp32: the fastest of up to ``reps`` calls each within about ``seconds``."""
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    x = torch.randn(n, n, device=device)
    lin = torch.nn.Linear(n, n, bias=False).to(device)
    if _candidates.fp8_linear(choice):
        ampc.fp8.convert(lin)
    base = torch.nn.Linear(n, n, bias=False).to(device)
    best = {choice: math.inf, "fp32": math.inf}
    # interleaved with fp32's: a busy machine slows both alike
    with torch.no_grad():
        for mod, c in ((lin, choice), (base, "fp32")):
            with _measure.at(mod, c, device, ampc.fp8.DelayedScaling()):
                mod(x)
        start = time.perf_counter()
        for _ in range(reps):
            for mod, c in ((lin, choice), (base, "fp32")):
                with _measure.at(mod, c, device, ampc.fp8.DelayedScaling()):
                    sync()
                    t0 = time.perf_counter()
                    mod(x)
                    sync()
                    best[c] = min(best[c], time.perf_counter() - t0)
            if time.perf_counter() - start > seconds:
                break
    return best[choice] * 1e3, best["fp32"] * 1e3


def probe(candidates, device):
    """{candidate: why it is not tried} for candidates whose matmul runs SLOW times slower
    than fp32's here (fp16 on most CPUs, bf16 without AVX-512 BF16 or AMX, fp8's exact
    CPU reference path), or that do not run at all."""
    out = {}
    for c in candidates:
        if c == "fp32":
            continue
        try:
            ms, base = _matmul_ms(c, device)
        except RuntimeError as e:
            out[c] = f"does not run here ({str(e).splitlines()[0][:80]})"
            continue
        if ms > SLOW * base:
            out[c] = (f"its 512x512 matmul takes {ms / base:.0f}x fp32's time on this "
                      f"{'GPU' if device == 'cuda' else 'CPU'} ({ms:.2f} vs {base:.2f} ms)")
    return out
