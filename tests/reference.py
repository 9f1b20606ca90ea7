"""Float64 references for ampc's ops, written from their documented semantics, and the
comparison helper the tests share.

Each reference is a few lines of plain torch (float64 or integer bit arithmetic) or
plain Python: slow, and obviously right.
"""
import math
import os
import struct
import subprocess
import sys

import pytest
import torch

INT_VIEW = {torch.float64: torch.int64, torch.float32: torch.int32, torch.float16: torch.int16,
            torch.bfloat16: torch.int16, torch.float8_e4m3fn: torch.uint8,
            torch.float8_e5m2: torch.uint8, torch.uint8: torch.uint8}

# magnitude bits of +inf, and the value the first step past the largest finite number
# would have if the exponent range went on (the "upper neighbour" of values beyond max)
INF_BITS = {torch.float16: 0x7C00, torch.bfloat16: 0x7F80}
PAST_MAX = {torch.float16: 2.0 ** 16, torch.bfloat16: 2.0 ** 128}


def bits(t):
    """The bit patterns of a float tensor as a same-shaped integer tensor."""
    return t.view(INT_VIEW[t.dtype])


def assert_periodic(got, want, what, rows=256):
    """Checks every element of a huge 1-D tensor against ``want`` repeated (bits, NaN by
    position), a block of ``rows`` periods at a time, so memory stays small."""
    period = want.numel()
    full = got.numel() // period
    want_bits, want_nan = bits(want), torch.isnan(want)
    nan_cols = torch.nonzero(want_nan)[:, 0]
    ok = torch.empty(rows, period, dtype=torch.bool)
    for r in range(0, full, rows):
        blk = got[r * period : min(r + rows, full) * period].view(-1, period)
        buf = ok[: blk.shape[0]]
        torch.eq(bits(blk), want_bits, out=buf)
        buf.logical_or_(want_nan)
        if not (bool(buf.all()) and bool(torch.isnan(blk[:, nan_cols]).all())):
            assert_same(blk, want.expand_as(blk), f"{what} elements from {r * period}")
    assert_same(got[full * period :], want[: got.numel() - full * period],
                f"{what} last elements")


def f32(x):
    """x rounded to the nearest fp32 value (to +-inf past the fp32 range)."""
    try:
        return struct.unpack("<f", struct.pack("<f", x))[0]
    except OverflowError:
        return math.copysign(math.inf, x)


def hex_bits(t, i):
    """Bit pattern of element i of the flattened tensor t, as hex text."""
    b = int(bits(t.reshape(-1)[i : i + 1])[0])
    width = 2 * t.element_size()
    return f"0x{b & ((1 << (4 * width)) - 1):0{width}x}"


def assert_same(got, expected, what, nan_payload=False):
    """got and expected are bit-identical; a NaN only has to meet a NaN at the same
    position unless nan_payload is set. `what` names the op and the case."""
    where = f"{what}: dtype {expected.dtype}, shape {tuple(expected.shape)}"
    assert got.dtype == expected.dtype, f"{where}: got dtype {got.dtype}"
    assert got.shape == expected.shape, f"{where}: got shape {tuple(got.shape)}"
    g = got.contiguous().reshape(-1)
    e = expected.contiguous().reshape(-1)
    same = bits(g) == bits(e)
    if not nan_payload:
        same |= torch.isnan(g) & torch.isnan(e)
    if bool(same.all()):
        return
    bad = torch.nonzero(~same)[:, 0]
    i = int(bad[0])
    raise AssertionError(
        f"{where}: {bad.numel()} of {e.numel()} elements differ; first at flat index {i}: "
        f"got {g[i].item()!r} ({hex_bits(g, i)}), expected {e[i].item()!r} ({hex_bits(e, i)})")


# ---- unscale and norm ----

def unscale(x, inv_scale):
    """x * inv_scale as one fp32 multiply, then rounded to x's dtype (inv_scale is first
    rounded to fp32, as the 1-element fp32 tensor that carries it to the op holds it).

    A product of two values with at most 24 significant bits is exact in float64, so
    rounding it to fp32 gives exactly the fp32 multiply; 16-bit grads are rounded once
    more, from fp32 to their own dtype (this is what torch does too)."""
    return (x.double() * f32(float(inv_scale))).float().to(x.dtype)


def norm(grads, inv_scale):
    """Global L2 norm of the unscaled grads, |inv_scale| * sqrt(sum of squares), in
    float64 (inv_scale taken as fp32)."""
    total = sum(float((g.double() ** 2).sum()) for g in grads)
    return abs(f32(float(inv_scale))) * math.sqrt(total)


# ---- dynamic loss scale ----

def update_scale(scale, growth_tracker, hysteresis_tracker, found_inf, growth_factor,
                 backoff_factor, growth_interval, hysteresis=1, min_scale=0.0,
                 max_scale=math.inf):
    """One loss-scale step; returns the new (scale, growth_tracker, hysteresis_tracker).

    torch's rule: a step with found_inf != 0 (nan included) multiplies the scale by
    backoff_factor and restarts the count of clean steps; a clean step counts, and the
    growth_interval-th one in a row multiplies the scale by growth_factor unless the
    result would be inf. Products are rounded once to fp32.
    Hysteresis (hysteresis > 1): a non-finite step first counts the tracker down and
    backs off only once it is down to 0 or below; until then it only restarts the clean
    count. Every clean step sets the tracker back to `hysteresis`. With hysteresis = 1
    the tracker is not used.
    Bounds: a backed-off scale is raised to min_scale, a grown one lowered to max_scale
    (also when the unbounded growth would overflow fp32).
    """
    if found_inf != 0:
        if hysteresis > 1:
            hysteresis_tracker -= 1
            if hysteresis_tracker > 0:
                return scale, 0, hysteresis_tracker
        return max(f32(scale * backoff_factor), f32(min_scale)), 0, hysteresis_tracker
    growth_tracker += 1
    if growth_tracker == growth_interval:
        grown = f32(min(scale * growth_factor, max_scale))
        if math.isfinite(grown):
            scale = grown
        growth_tracker = 0
    if hysteresis > 1:
        hysteresis_tracker = hysteresis
    return scale, growth_tracker, hysteresis_tracker


# ---- stochastic rounding ----

def stochastic_neighbours(x, dtype):
    """For finite fp32 values x and a 16-bit dtype: the magnitude bits of the two dtype
    values around |x| (lo toward zero, hi = lo + 1 away from zero) and the probability
    that unbiased stochastic rounding returns hi, (|x| - lo) / (hi - lo), as float64.
    Past the largest finite value hi is inf, spaced as if the exponents went on; the
    probability is capped at 1 beyond that."""
    a = x.abs()
    nearest = a.to(dtype)
    lo = bits(nearest).to(torch.int32)
    lo = torch.where(nearest.double() > a.double(), lo - 1, lo)
    hi = lo + 1
    lo_v = lo.to(torch.int16).view(dtype).double()
    hi_v = hi.to(torch.int16).view(dtype).double()
    hi_v = torch.where(hi == INF_BITS[dtype], torch.full_like(hi_v, PAST_MAX[dtype]), hi_v)
    p = ((a.double() - lo_v) / (hi_v - lo_v)).clamp(max=1.0)
    return lo, hi, p


def assert_refused_unchanged(case_name, call, watched, exc, pattern):
    """call() raises exc matching pattern, and no tensor in watched changed (the checks of
    an op run before any write). Meta tensors are skipped: they hold no values."""
    before = [t.clone() for t in watched if t.device.type != "meta"]
    with pytest.raises(exc, match=pattern):
        call()
    after = [t for t in watched if t.device.type != "meta"]
    for b, a in zip(before, after):
        assert torch.equal(b.contiguous().view(torch.uint8), a.contiguous().view(torch.uint8)), \
            f"{case_name} modified a tensor"


def run_on_cpu_path(isa, script, *args):
    """stdout of `script` (python -c, with args) in a fresh process whose kernels take the
    CPU path `isa` ("scalar", "avx2"; "best": uncapped), through AMPC_CPU_ISA."""
    env = dict(os.environ)
    env.pop("AMPC_CPU_ISA", None)
    if isa != "best":
        env["AMPC_CPU_ISA"] = isa
    out = subprocess.run([sys.executable, "-c", script, *args], env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout
