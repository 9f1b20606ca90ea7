"""ampc.ops.fp8_update_scales (delayed scaling, TransformerEngine's rules) against a plain
Python reference, bit for bit, over 1,000 steps with zeros, infs, NaNs and amaxes so small
that the scale overflows.

The reference keeps the history in Python floats holding fp32 values; each fp32 operation
is a float64 operation rounded once to fp32 (exact for one division of two fp32 values:
float64 has more than twice fp32's precision plus two bits). Scales, inverse scales and the
whole history are compared as fp32 bit patterns after every step.
"""
import math
import random
import struct

import pytest
import torch

import ampc
from reference import f32

FLT_MAX = 3.4028234663852886e38


def f32_bits(x):
    return struct.unpack("<I", struct.pack("<f", x))[0]


def ref_step(history, amax, scale, fmax, margin, algo):
    """One step of one tensor, the rules of csrc/math/fp8_scaling.h as TransformerEngine states
    them; history[0] is the newest. Returns (history, scale, scale_inv)."""
    if amax != 0:
        history = [amax] + history[:-1]
        used = max([v for v in history if not math.isnan(v)] + [0.0])
    else:
        used = 0.0
    if algo == "most_recent":
        used = amax
    scaled_max = f32(f32(fmax) * f32(2.0 ** -margin))
    if 0 < used < math.inf:
        scale = f32(scaled_max / used)
    if math.isinf(scale):
        scale = FLT_MAX
    return history, scale, f32(1.0 / scale)


def amax_stream(rng, n):
    """Per step, n amaxes: mostly ordinary values over many binades, with zeros, infs,
    NaNs, negative zero, and subnormals whose scale overflows fp32."""
    specials = [0.0, -0.0, math.inf, math.nan, 1e-40, 1.4e-45, FLT_MAX]
    for _ in range(1000):
        yield [rng.choice(specials) if rng.random() < 0.15
               else f32(rng.lognormvariate(0, 8)) for _ in range(n)]


@pytest.mark.smoke
@pytest.mark.parametrize("rows, algo, fmax, margin", [
    (16, "max", 448.0, 0),
    (16, "most_recent", 57344.0, 0),
    (1, "most_recent", 448.0, 0),          # current scaling
    (1, "max", 57344.0, 2),
    (1024, "max", 448.0, 1),
    (7, "max", 448.0, -3),
])
def test_matches_reference_over_1000_steps(rows, algo, fmax, margin):
    n = 5
    rng = random.Random(rows * 31 + margin)
    history = torch.zeros(rows, n)
    scale = torch.ones(n)
    scale_inv = torch.ones(n)
    ref = [([0.0] * rows, 1.0) for _ in range(n)]
    for step, amaxes in enumerate(amax_stream(rng, n)):
        amax = torch.tensor(amaxes, dtype=torch.float32)
        ampc.ops.fp8_update_scales(history, amax, scale, scale_inv, fmax=fmax, margin=margin,
                                   algo=algo)
        for j in range(n):
            hist, s, s_inv = ref_step(ref[j][0], amaxes[j], ref[j][1], fmax, margin, algo)
            ref[j] = (hist, s)
            where = f"step {step}, tensor {j}, amax {amaxes[j]!r}"
            assert f32_bits(scale[j].item()) == f32_bits(s), f"{where}: scale {scale[j].item()!r}, want {s!r}"
            assert f32_bits(scale_inv[j].item()) == f32_bits(s_inv), f"{where}: scale_inv"
            got = [f32_bits(v) for v in history[:, j].tolist()]
            assert got == [f32_bits(v) for v in hist], f"{where}: history"


def test_zero_amax_keeps_history_and_scale():
    history = torch.tensor([[3.0, 5.0], [100.0, 7.0]])
    scale, scale_inv = torch.tensor([2.0, 4.0]), torch.tensor([0.5, 0.25])
    ampc.ops.fp8_update_scales(history, torch.tensor([0.0, 14.0]), scale, scale_inv, fmax=448.0)
    assert history.tolist() == [[3.0, 14.0], [100.0, 5.0]]
    assert scale.tolist() == [2.0, 32.0] and scale_inv.tolist() == [0.5, 1 / 32]


def test_max_skips_nan_rows_and_inf_keeps_the_scale():
    history = torch.tensor([[2.0], [8.0]])
    scale, scale_inv = torch.ones(1), torch.ones(1)
    ampc.ops.fp8_update_scales(history, torch.tensor([math.nan]), scale, scale_inv, fmax=448.0)
    assert math.isnan(history[0, 0].item()) and history[1, 0].item() == 2.0
    assert scale.item() == 224.0            # 448 / 2, the NaN row skipped
    ampc.ops.fp8_update_scales(history, torch.tensor([math.inf]), scale, scale_inv, fmax=448.0)
    assert scale.item() == 224.0            # inf in the history: kept
    ampc.ops.fp8_update_scales(history, torch.tensor([1e-40]), scale, scale_inv, fmax=448.0,
                               algo="most_recent")
    assert scale.item() == FLT_MAX and scale_inv.item() == f32(1 / FLT_MAX)


def test_current_scaling_after_fp8_amax():
    x = [torch.randn(1000) * 37, torch.randn(10).to(torch.bfloat16)]
    amax = torch.empty(2)
    ampc.ops.fp8_amax(x, amax)
    history, scale, scale_inv = torch.zeros(1, 2), torch.ones(2), torch.ones(2)
    ampc.ops.fp8_update_scales(history, amax, scale, scale_inv, fmax=448.0, algo="most_recent")
    for j, t in enumerate(x):
        assert scale[j].item() == f32(448.0 / t.abs().amax().item())
    q = [torch.empty(t.shape, dtype=torch.float8_e4m3fn) for t in x]
    ampc.ops.cast_fp8(q, x, scale, amax)
    assert max(float(t.float().abs().max()) for t in q) == 448.0


def test_empty_history_columns():
    ampc.ops.fp8_update_scales(torch.zeros(4, 0), torch.zeros(0), torch.ones(0), torch.ones(0),
                               fmax=448.0)
