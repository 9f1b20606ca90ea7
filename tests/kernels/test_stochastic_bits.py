"""Stochastic rounding, bit for bit: the CPU kernels (vectorized, branch-free) against
an independent transcription of the rule in csrc/math/dtype.h (which the CUDA kernels run
as written), on values that cover every fp16/bf16 regime. Equal bits here are what
make a seeded cast give the same result on CPU and CUDA."""
import struct

import numpy as np
import pytest
import torch

import ampc

M32 = 0xFFFFFFFF


def mix32(x):
    x = x.astype(np.uint64) & M32
    x ^= x >> 16
    x = (x * 0x7FEB352D) & M32
    x ^= x >> 15
    x = (x * 0x846CA68B) & M32
    x ^= x >> 16
    return x


def random_bits(seed, index):
    """ampc_random_bits(seed, index) for a uint64 array of indices."""
    hi = mix32(index >> np.uint64(32))
    key = mix32(mix32(np.uint64(seed >> 32) ^ hi) ^ np.uint64(seed & M32))
    return mix32((index & np.uint64(M32)) ^ key)


def bf16_sr(x, rnd):
    u = x.view(torch.int32).numpy().astype(np.uint64) & M32
    out = ((u + (rnd >> 16)) >> 16) & 0xFFFF
    return torch.from_numpy(out.astype(np.uint16).view(np.int16))


def f16_sr(x, rnd):
    a = x.abs()
    lo = a.to(torch.float16).view(torch.int16).to(torch.int32) & 0x7FFF
    lo = torch.where(lo.to(torch.int16).view(torch.float16).float() > a, lo - 1, lo)
    lo_f = lo.to(torch.int16).view(torch.float16).float()
    up_f = (lo + 1).clamp(max=0x7BFF).to(torch.int16).view(torch.float16).float()
    ulp = torch.where(lo == 0x7BFF, torch.tensor(32.0), up_f - lo_f)
    u01 = torch.from_numpy((rnd >> 8).astype(np.float32)) * 2.0 ** -24
    away = ((a - lo_f) > u01 * ulp).to(torch.int32)
    sign = (x.view(torch.int32) < 0).to(torch.int32) << 15
    return (sign | (lo + away)).to(torch.int16)


def sample_values():
    g = torch.Generator().manual_seed(3)
    parts = [
        torch.randn(20000, generator=g),
        torch.randn(20000, generator=g) * 2.0 ** -20,       # fp16 subnormal range
        torch.randn(20000, generator=g) * 2.0 ** -30,       # below fp16's smallest
        torch.rand(20000, generator=g) * 100 + 65440,       # up to and past fp16's max
        torch.randn(20000, generator=g) * 1e30,
        torch.tensor([0.0, -0.0, 1.0, -1.0, 65504.0, 65520.0, 65536.0, 1e-45, -1e-45,
                      2.0 ** -24, 2.0 ** -25, 3.0 * 2.0 ** -26]),
    ]
    return torch.cat(parts)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("seed", [0, 12345, (7 << 32) | 99])
def test_stochastic_bits_follow_the_rule(dtype, seed):
    x = sample_values()
    x = x[torch.randperm(x.numel(), generator=torch.Generator().manual_seed(seed & 0xFF))]
    # two tensors in one call: element indices run on across the list
    parts = [x[:30001].contiguous(), x[30001:].contiguous()]
    got = torch.cat([t.view(torch.int16) for t in
                     ampc.ops.cast(parts, dtype, stochastic=True, seed=seed)])
    rnd = random_bits(seed, np.arange(x.numel(), dtype=np.uint64))
    want = f16_sr(x, rnd) if dtype == torch.float16 else bf16_sr(x, rnd)
    diff = (got != want).nonzero()
    assert diff.numel() == 0, (
        f"ampc.cast stochastic {dtype}: {diff.numel()} of {x.numel()} differ, first at "
        f"{int(diff[0])}: x={x[diff[0]].item()!r} got {int(got[diff[0]]) & 0xFFFF:#06x} "
        f"want {int(want[diff[0]]) & 0xFFFF:#06x}")


def test_inf_and_nan_pass_through_stochastic_rounding():
    x = torch.tensor([float("inf"), float("-inf"), float("nan")] * 11)
    for dtype in (torch.float16, torch.bfloat16):
        (y,) = ampc.ops.cast([x], dtype, stochastic=True, seed=5)
        assert torch.equal(y[:2].float(), x[:2]) and torch.isnan(y[2::3]).all()


# ---- bits that advance on the device (Note [random bits that advance on the device]) ----
# A seed passed by value is frozen into a captured CUDA graph. Adam mixes in each param's
# step count, cast can read its seed from a tensor, so both draw new bits when the device
# state moves on; the CPU computes the same bits.

STRIDE = 0x9E3779B97F4A7C15


def step_seed(seed, step):
    """seed + bits(fp32 step) * STRIDE mod 2^64, written independently of ampc."""
    bits = struct.unpack("<I", struct.pack("<f", step))[0]
    return (seed + bits * STRIDE) % (1 << 64)


def test_step_seed_is_the_documented_formula():
    for seed, step in [(0, 1), (1234, 1), (1234, 2), ((1 << 64) - 1, 100000), (5, 2.0 ** 24)]:
        assert ampc.ops.step_seed(seed, step) % (1 << 64) == step_seed(seed, step)
    assert len({step_seed(7, k) for k in range(1, 1000)}) == 999


def adam_with_frozen_masters(params, masters, steps, seed):
    """One stochastic Adam step with lr = 0: the masters keep their values, so the params
    are the same values rounded again, with the bits of the step taken."""
    n = [p.numel() for p in params]
    ampc.ops.adam_master(params, [torch.randn(k).to(p.dtype) for k, p in zip(n, params)],
                         [torch.zeros(k) for k in n], [torch.zeros(k) for k in n],
                         steps, lr=0.0, masters=masters, stochastic=True, seed=seed)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_consecutive_adam_steps_draw_different_bits(dtype):
    seed = 4321
    masters = [t.contiguous() for t in sample_values()[:60001].split([20000, 40001])]
    want_values = torch.cat(masters)
    params = [m.to(dtype) for m in masters]
    steps = [torch.zeros(1), torch.zeros(1)]
    seen = []
    for step in (1, 2, 3):
        adam_with_frozen_masters(params, masters, steps, seed)
        assert torch.equal(torch.cat(masters), want_values)      # lr = 0: nothing moved
        got = torch.cat([p.view(torch.int16) for p in params])
        rnd = random_bits(step_seed(seed, float(step)), np.arange(got.numel(), dtype=np.uint64))
        want = f16_sr(want_values, rnd) if dtype == torch.float16 else bf16_sr(want_values, rnd)
        assert torch.equal(got, want), f"step {step}: bits differ from the documented formula"
        seen.append(got)
    # the same values, rounded on three steps: each pair of steps rounds some differently
    for a, b in [(0, 1), (1, 2), (0, 2)]:
        assert (seen[a] != seen[b]).sum() > 1000


def test_params_with_different_step_counts_draw_their_own_bits():
    # a param added to the optimizer later has a lower step count than the others
    x = sample_values()[:20000].contiguous()
    masters = [x.clone(), x.clone()]
    params = [m.to(torch.bfloat16) for m in masters]
    adam_with_frozen_masters(params, masters, [torch.full((1,), 4.0), torch.zeros(1)], 11)
    for p, step, offset in [(params[0], 5.0, 0), (params[1], 1.0, x.numel())]:
        rnd = random_bits(step_seed(11, step), np.arange(offset, offset + x.numel(), dtype=np.uint64))
        assert torch.equal(p.view(torch.int16), bf16_sr(x, rnd))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_cast_seed_tensor_is_read_when_the_cast_runs(dtype):
    x = [t.contiguous() for t in sample_values()[:50001].split([30000, 20001])]
    seed = torch.tensor([99], dtype=torch.int64)
    a = ampc.ops.cast(x, dtype, stochastic=True, seed=seed)
    b = ampc.ops.cast(x, dtype, stochastic=True, seed=99)
    assert all(torch.equal(u.view(torch.int16), v.view(torch.int16)) for u, v in zip(a, b))
    seed.add_(1)
    c = ampc.ops.cast(x, dtype, stochastic=True, seed=seed)
    d = ampc.ops.cast(x, dtype, stochastic=True, seed=100)
    assert all(torch.equal(u.view(torch.int16), v.view(torch.int16)) for u, v in zip(c, d))
    assert sum(int((u.view(torch.int16) != v.view(torch.int16)).sum()) for u, v in zip(a, c)) > 1000
    # a negative int64 is the same 64 bits as the unsigned seed
    seed.fill_(-1)
    e = ampc.ops.cast(x, dtype, stochastic=True, seed=seed)
    f = ampc.ops.cast(x, dtype, stochastic=True, seed=(1 << 64) - 1)
    assert all(torch.equal(u.view(torch.int16), v.view(torch.int16)) for u, v in zip(e, f))


def test_cast_seed_tensor_checked():
    x = [torch.randn(4)]
    for bad, what in [(torch.tensor([1.0]), "torch.float32"), (torch.tensor([1, 2]), "2 elements")]:
        with pytest.raises(RuntimeError, match=r"^ampc\.cast: seed_tensor must be a 1-element "
                                               rf"torch\.int64 tensor, got .*{what}"):
            ampc.ops.cast(x, torch.bfloat16, stochastic=True, seed=bad)


# ---- the bits' independence across elements ----
# Rounding is unbiased for each element whatever the bits' joint law; a sum of rounded
# values is only as good as the elements' bits are independent. Cheaper mixes than
# ampc_mix32 fail here: (index ^ key) * odd correlates elements 4,096 apart at 0.69, and
# (index + key) * odd elements 144 apart at 0.99.

@pytest.mark.parametrize("seed", [1, 77, (5 << 32) | 3])
def test_distant_elements_round_independently(seed):
    n = 1 << 20
    half = torch.full((n,), 1.0 + 2.0 ** -8)        # halfway between two bf16 values
    (y,) = ampc.ops.cast([half], torch.bfloat16, stochastic=True, seed=seed)
    up = (y.float() > 1.0).double()
    assert abs(float(up.mean()) - 0.5) < 0.005, f"rounded up {float(up.mean()):.4f}, not 1/2"
    for lag in (1, 2, 3, 144, 987, 4096, 65536, 1 << 19):
        a, b = up[:-lag] - up[:-lag].mean(), up[lag:] - up[lag:].mean()
        corr = float((a * b).mean() / (a.std() * b.std()))
        # 2^19 pairs or more: independent bits give |corr| about 0.001
        assert abs(corr) < 0.02, f"seed {seed}: elements {lag} apart round alike ({corr:.3f})"


@pytest.mark.parametrize("seed", [0, 12345, (7 << 32) | 99])
def test_the_two_halves_of_an_element_s_bits_are_independent(seed):
    """The lean step rounds a bf16 weight with the high 16 bits of an element's random bits
    and the 8-bit second moment's code with the low 16 (csrc/math/lean.h): decisions drawn
    from the two halves agree as independent ones would, in one element and at a distance."""
    n = 1 << 20
    rnd = random_bits(seed, np.arange(n, dtype=np.uint64))
    for cut in (1 << 15, 1 << 12, 3 << 14):       # probabilities 1/2, 1/16, 3/4
        hi = ((rnd >> 16) < cut).astype(np.float64)
        lo = ((rnd & 0xFFFF) < cut).astype(np.float64)
        p = cut / 65536
        assert abs(lo.mean() - p) < 0.004, (cut, lo.mean())
        for lag in (0, 1, 4096):
            a = hi[:n - lag] - hi[:n - lag].mean()
            b = lo[lag:] - lo[lag:].mean()
            corr = float((a * b).mean() / (a.std() * b.std()))
            assert abs(corr) < 0.01, f"seed {seed}, p {p}: halves {lag} apart ({corr:.4f})"
