"""Tests of ampc.ops.update_scale (torch.ops.ampc.update_scale) on the CPU.

Tolerance rules: every step is exact. After each step the scale is compared bit for bit
(fp32) and growth_tracker and hysteresis_tracker as integers, against
torch._amp_update_scale_ (hysteresis 1, no bounds: ampc promises the same op) and
against reference.update_scale (every setting, hysteresis and bounds included).
"""
import math
import struct

import pytest
import torch

import ampc
import reference as ref

I32 = torch.int32
# found_inf values: 0 and -0 are clean steps; any other value (nan included) skips
SKIP_VALUES = [1.0, 2.0, 0.5, -1.0, math.nan, math.inf, 1e-45, 3e38]
CLEAN_VALUES = [0.0, -0.0]


def f32_bits(x):
    return struct.unpack("<i", struct.pack("<f", x))[0]


def found_sequence(n, seed, p_skip, p_stay=None):
    """n found_inf values: a skip with probability p_skip, or p_stay right after a skip
    (bursts, so that hysteresis runs out)."""
    g = torch.Generator().manual_seed(seed)
    u = torch.rand(n, generator=g).tolist()
    pick = torch.randint(0, 1 << 30, (n,), generator=g).tolist()
    out, prev = [], False
    for i in range(n):
        skip = u[i] < (p_stay if prev and p_stay is not None else p_skip)
        vals = SKIP_VALUES if skip else CLEAN_VALUES
        out.append(vals[pick[i] % len(vals)])
        prev = skip
    return out


def run_sequence(found, growth, backoff, interval, init, *, hysteresis=1, min_scale=0.0,
                 max_scale=math.inf, init_growth=0, against_torch=False):
    """Runs the steps with ampc, the reference and (optionally) torch; checks every step."""
    scale = torch.full((1,), init, dtype=torch.float32)
    tracker = torch.full((1,), init_growth, dtype=I32)
    hyst = torch.full((1,), hysteresis, dtype=I32) if hysteresis > 1 else None
    t_scale, t_tracker = scale.clone(), tracker.clone()
    state = (float(scale), init_growth, hysteresis)
    f = torch.zeros(1)
    settings = (f"growth {growth}, backoff {backoff}, interval {interval}, hysteresis "
                f"{hysteresis}, min {min_scale}, max {max_scale}")
    for step, v in enumerate(found):
        before = float(scale)
        f.fill_(v)
        ampc.ops.update_scale(scale, tracker, f, growth, backoff, interval, hysteresis=hysteresis,
                              hysteresis_tracker=hyst, min_scale=min_scale, max_scale=max_scale)
        state = ref.update_scale(*state, ref.f32(v), growth, backoff, interval, hysteresis,
                                 min_scale, max_scale)
        got = (int(scale.view(I32)), int(tracker), int(hyst) if hyst is not None else hysteresis)
        want = (f32_bits(state[0]), state[1], state[2])
        where = (f"update_scale step {step} ({settings}), found_inf {v!r}, scale before "
                 f"{before!r}: got scale {float(scale)!r}, growth_tracker {got[1]}, "
                 f"hysteresis_tracker {got[2]}")
        assert got == want, f"{where}; reference: {state}"
        if against_torch:
            torch._amp_update_scale_(t_scale, t_tracker, f, growth, backoff, interval)
            assert (got[0], got[1]) == (int(t_scale.view(I32)), int(t_tracker)), \
                f"{where}; torch: scale {float(t_scale)!r}, growth_tracker {int(t_tracker)}"
    return float(scale)


# growth, backoff, interval, initial scale, share of skipped steps
TORCH_SETTINGS = [
    (2.0, 0.5, 2000, 65536.0, 0.0005),          # GradScaler's defaults
    (2.0, 0.5, 1, 65536.0, 0.3),
    (2.0, 0.5, 3, 1024.0, 0.2),
    (1.0001, 0.9999, 2, 3.0, 0.3),              # factors that round in fp32
    (3.7, 0.13, 5, 12345.678, 0.15),
    (2.0, 0.5, 1, 1e38, 0.05),                  # growth would overflow fp32 to inf
    (1.5, 0.9, 2, 3e38, 0.1),                   # ... just past 3.4e38
    (1.0001, 0.5, 1, 3.4e38, 0.02),             # the largest fp32 values
    (2.0, 0.5, 1, 1e-37, 0.8),                  # into fp32 subnormals, down to 0
    (1.25, 1.5, 4, 100.0, 0.2),                 # a backoff factor above 1
]


@pytest.mark.parametrize("setting", TORCH_SETTINGS,
                         ids=lambda s: f"g{s[0]}-b{s[1]}-i{s[2]}-s{s[3]:g}")
@pytest.mark.smoke
def test_matches_torch(setting):
    growth, backoff, interval, init, p_skip = setting
    found = found_sequence(5000, seed=interval, p_skip=p_skip)
    final = run_sequence(found, growth, backoff, interval, init, against_torch=True)
    if backoff <= 1:    # only a backoff factor above 1 may overflow (as in torch)
        assert math.isfinite(final), f"update_scale ({setting}): the scale became {final}"


def test_overflow_guard_literal():
    # 2e38 * 2 is inf in fp32: the scale stays and the tracker restarts
    scale, tracker = torch.full((1,), 2e38), torch.zeros(1, dtype=I32)
    ampc.ops.update_scale(scale, tracker, torch.zeros(1), 2.0, 0.5, 1)
    assert float(scale) == ref.f32(2e38) and int(tracker) == 0, \
        f"update_scale: growth past fp32 max gave scale {float(scale)}, tracker {int(tracker)}"


@pytest.mark.parametrize("init_growth", [1, 4, 7, 100])
def test_growth_tracker_start(init_growth):
    # a tracker already at or past the interval only counts on, until a skip resets it
    found = found_sequence(500, seed=init_growth, p_skip=0.05)
    run_sequence(found, 2.0, 0.5, 5, 256.0, init_growth=init_growth, against_torch=True)


def test_found_inf_values():
    """Any nonzero found_inf (nan, negative, subnormal) is a skipped step; -0 is clean."""
    for v in SKIP_VALUES + CLEAN_VALUES:
        scale, tracker = torch.full((1,), 1024.0), torch.full((1,), 2, dtype=I32)
        ampc.ops.update_scale(scale, tracker, torch.full((1,), v), 2.0, 0.5, 3)
        want = (512.0, 0) if v != 0 else (2048.0, 0)
        assert (float(scale), int(tracker)) == want, \
            f"update_scale found_inf {v!r}: got {(float(scale), int(tracker))}, expected {want}"


def test_hysteresis_literal():
    # hysteresis 2, growth 2, backoff 0.5, interval 3, from 1024
    found = [1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 1.0, 1.0]
    want = [(1024.0, 0, 1), (512.0, 0, 0), (256.0, 0, -1), (256.0, 1, 2), (256.0, 0, 1),
            (256.0, 1, 2), (256.0, 2, 2), (512.0, 0, 2), (512.0, 0, 1), (256.0, 0, 0)]
    scale, tracker = torch.full((1,), 1024.0), torch.zeros(1, dtype=I32)
    hyst = torch.full((1,), 2, dtype=I32)
    state = (1024.0, 0, 2)
    for step, (v, w) in enumerate(zip(found, want)):
        ampc.ops.update_scale(scale, tracker, torch.full((1,), v), 2.0, 0.5, 3, hysteresis=2,
                              hysteresis_tracker=hyst)
        state = ref.update_scale(*state, v, 2.0, 0.5, 3, hysteresis=2)
        got = (float(scale), int(tracker), int(hyst))
        assert got == w, \
            f"update_scale hysteresis 2 step {step} (found_inf {v}): got {got}, expected {w}"
        assert state == w, f"reference hysteresis 2 step {step}: got {state}, expected {w}"


def test_bounds_literal():
    # min 100, max 1000, growth 2, backoff 0.25, interval 1, from 400
    found = [0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0]
    want = [800.0, 1000.0, 1000.0, 250.0, 100.0, 100.0, 200.0]
    scale, tracker = torch.full((1,), 400.0), torch.zeros(1, dtype=I32)
    state = (400.0, 0, 1)
    for step, (v, w) in enumerate(zip(found, want)):
        ampc.ops.update_scale(scale, tracker, torch.full((1,), v), 2.0, 0.25, 1, min_scale=100.0,
                              max_scale=1000.0)
        state = ref.update_scale(*state, v, 2.0, 0.25, 1, min_scale=100.0, max_scale=1000.0)
        assert float(scale) == w, \
            f"update_scale bounds step {step}: scale {float(scale)}, expected {w}"
        assert state[0] == w, f"reference bounds step {step}: scale {state[0]}, expected {w}"


def test_growth_past_fp32_lands_on_max_scale():
    # 2e38 * 2 overflows fp32; with a finite max_scale the scale lands on it instead of
    # staying put (torch's rule, which has no max, keeps 2e38)
    scale, tracker = torch.full((1,), 2e38), torch.zeros(1, dtype=I32)
    ampc.ops.update_scale(scale, tracker, torch.zeros(1), 2.0, 0.5, 1, max_scale=3e38)
    assert float(scale) == ref.f32(3e38)
    scale.fill_(2e38)
    ampc.ops.update_scale(scale, tracker, torch.zeros(1), 2.0, 0.5, 1)
    assert float(scale) == ref.f32(2e38)


# growth, backoff, interval, initial scale, hysteresis, min, max, p_skip, p_skip after a skip
REFERENCE_SETTINGS = [
    (2.0, 0.5, 3, 1024.0, 2, 0.0, math.inf, 0.2, 0.6),
    (2.0, 0.5, 1, 65536.0, 3, 0.0, math.inf, 0.3, 0.8),
    (2.0, 0.5, 2000, 65536.0, 5, 1.0, 2.0 ** 24, 0.01, 0.9),
    (2.0, 0.5, 2, 1024.0, 1, 1.0, 2.0 ** 20, 0.3, 0.5),
    (1.5, 0.3, 2, 300.0, 1, 0.1, 1e6, 0.4, 0.4),        # bounds that fp32 cannot hold exactly
    (3.0, 0.5, 1, 10.0, 2, 2.0 ** -10, 1e30, 0.5, 0.7),
    (2.0, 0.25, 4, 128.0, 7, 1.0, 2.0 ** 16, 0.25, 0.9),
    (2.0, 0.5, 1, 1e38, 2, 0.0, math.inf, 0.1, 0.5),    # with the overflow guard
]


@pytest.mark.parametrize("setting", REFERENCE_SETTINGS,
                         ids=lambda s: f"h{s[4]}-i{s[2]}-min{s[5]:g}-max{s[6]:g}")
def test_hysteresis_and_bounds(setting):
    growth, backoff, interval, init, hysteresis, lo, hi, p_skip, p_stay = setting
    found = found_sequence(5000, seed=hysteresis * 100 + interval, p_skip=p_skip, p_stay=p_stay)
    run_sequence(found, growth, backoff, interval, init, hysteresis=hysteresis, min_scale=lo,
                 max_scale=hi, against_torch=hysteresis == 1 and lo == 0 and hi == math.inf)


def test_reference_matches_torch():
    """The reference itself agrees with torch where torch has the op (hysteresis 1, no bounds)."""
    for growth, backoff, interval, init, p_skip in TORCH_SETTINGS:
        scale, tracker = torch.full((1,), init), torch.zeros(1, dtype=I32)
        state = (ref.f32(init), 0, 1)
        f = torch.zeros(1)
        for step, v in enumerate(found_sequence(2000, seed=7, p_skip=p_skip)):
            f.fill_(v)
            torch._amp_update_scale_(scale, tracker, f, growth, backoff, interval)
            state = ref.update_scale(*state, ref.f32(v), growth, backoff, interval)
            assert (f32_bits(state[0]), state[1]) == (int(scale.view(I32)), int(tracker)), \
                f"reference vs torch, step {step}, growth {growth}, backoff {backoff}: " \
                f"{state} vs {(float(scale), int(tracker))}"
