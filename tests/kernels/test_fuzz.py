"""Seeded random lists against torch: mixed sizes (around SIMD widths and the 65536
chunk), storage offsets, dtypes and planted specials, through every op at once."""
import math
import random

import pytest
import torch

import ampc
from reference import assert_same

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
DTYPES = [F32, F16, BF16]
SIZES = [0, 1, 7, 15, 16, 17, 31, 33, 1023, 1025, 65535, 65536, 65537, 131079]
SPECIALS = [math.inf, -math.inf, math.nan, 0.0, -0.0, 65504.0, 65520.0, 1e-40, 3e38]


def random_tensor(rng, gen, dtype, n):
    offset = rng.choice([0, 0, 1, 3, 5])
    base = torch.randn(n + offset, generator=gen) * 2.0 ** rng.randint(-20, 20)
    for _ in range(rng.randint(0, 3)):
        if n:
            base[offset + rng.randrange(n)] = rng.choice(SPECIALS)
    return base.to(dtype)[offset:]


@pytest.mark.parametrize("seed", range(100))
def test_random_lists_match_torch(seed):
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    count = rng.choice([1, 2, 5, 30])
    src_dt, dst_dt = rng.choice(DTYPES), rng.choice(DTYPES)
    src = [random_tensor(rng, gen, src_dt, rng.choice(SIZES)) for _ in range(count)]
    with torch.no_grad():
        # cast, bit for bit
        for got, x in zip(ampc.ops.cast(src, dst_dt), src):
            assert_same(got, x.to(dst_dt), f"fuzz {seed} cast {src_dt}->{dst_dt} n={x.numel()}")
        # unscale_check against torch's op, on copies
        inv = torch.full((1,), 2.0 ** rng.randint(-16, 2))
        mine, theirs = [x.clone() for x in src], [x.clone() for x in src]
        f_mine, f_theirs = torch.zeros(1), torch.zeros(1)
        ampc.ops.unscale_check(mine, f_mine, inv)
        torch._amp_foreach_non_finite_check_and_unscale_(theirs, f_theirs, inv)
        assert float(f_mine) == float(f_theirs), f"fuzz {seed} found_inf"
        for a, b in zip(mine, theirs):
            assert_same(a, b, f"fuzz {seed} unscale {src_dt} n={a.numel()}")
        # check_only: same flag, grads untouched, the norm of the unscaled grads
        f = torch.zeros(1)
        norm = ampc.ops.unscale_check(src, f, inv, check_only=True)
        assert float(f) == float(f_theirs)
        if float(f) == 0.0:
            want = float(inv) * math.sqrt(sum(float((x.double() ** 2).sum()) for x in src))
            want = float(torch.tensor(want, dtype=F32))     # past fp32's range it is inf
            assert math.isclose(float(norm), want, rel_tol=1e-5, abs_tol=1e-30), \
                f"fuzz {seed} norm {float(norm)} vs {want}"
