"""Stochastic rounding, bit for bit: the CPU kernels (vectorized, branch-free) against
an independent transcription of the rule in csrc/dtype.h (which the CUDA kernels run
as written), on values that cover every fp16/bf16 regime. Equal bits here are what
make a seeded cast give the same result on CPU and CUDA."""
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
