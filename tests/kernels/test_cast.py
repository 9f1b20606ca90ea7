"""Tests of ampc.ops.cast, ampc.ops.cast_ and torch.ops.ampc.cast on the CPU.

Tolerance rules:
- Round to nearest (the default) is bit-exact against Tensor.to(dtype): bit patterns
  are compared through integer views, and a NaN only has to meet a NaN at the same
  position (payload bits may differ). A same-dtype copy keeps every bit, NaN payloads
  included. Special values are also checked against hand-computed bit patterns.
- Stochastic rounding is checked as a property: every result is one of the two dtype
  neighbours of its input (lo toward zero, hi away from zero, reference.
  stochastic_neighbours), exact inputs come back unchanged, and over N samples of one
  value the share of `hi` results is within 5 standard deviations, sqrt(p(1-p)/N), of
  the reference probability p. The same seed gives the same bits on any thread count.
"""
import itertools

import pytest
import torch

import ampc
from reference import INT_VIEW, assert_periodic, assert_same, bits, stochastic_neighbours

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
DTYPES = [F32, F16, BF16]
PAIRS = list(itertools.product(DTYPES, DTYPES))
NAMES = {F32: "fp32", F16: "fp16", BF16: "bf16"}
# around the SIMD widths (8, 16), the block (1024), the chunk (65536) and the size below
# which the list is walked on one thread (2 chunks); and a prime
SIZES = [1, 2, 7, 8, 9, 15, 16, 17, 31, 33, 1023, 1024, 1025, 65535, 65536, 65537,
         131071, 131072, 131073, 200003]


def pair_id(pair):
    return f"{NAMES[pair[0]]}->{NAMES[pair[1]]}"


def random_values(n, dtype, seed):
    """n values of dtype: half spread over many binades (subnormals, overflow for
    fp16), half uniformly random bit patterns (every exponent, inf and NaN too)."""
    g = torch.Generator().manual_seed(seed)
    k = n // 2
    spread = torch.ldexp(torch.randn(n - k, generator=g, dtype=torch.float64),
                         torch.randint(-30, 31, (n - k,), generator=g)).to(dtype)
    itype = INT_VIEW[dtype]
    info = torch.iinfo(itype)
    raw = torch.randint(info.min, info.max + 1, (k,), generator=g, dtype=itype).view(dtype)
    return torch.cat([spread, raw])[torch.randperm(n, generator=g)]


def finite_values(n, dtype, seed):
    """n finite values of dtype spread over its whole range, subnormals included."""
    x = random_values(n, dtype, seed)
    return torch.where(torch.isfinite(x), x, torch.zeros_like(x))


def check_cast(srcs, dtype, what):
    """ampc.ops.cast of the list equals Tensor.to() of each tensor, bit for bit."""
    out = ampc.ops.cast(srcs, dtype)
    assert len(out) == len(srcs), f"{what}: {len(out)} outputs for {len(srcs)} inputs"
    for i, (s, o) in enumerate(zip(srcs, out)):
        assert_same(o, s.to(dtype), f"cast {what} {NAMES[s.dtype]}->{NAMES[dtype]} "
                    f"tensor {i}", nan_payload=s.dtype == dtype)


def with_threads(n, fn):
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        return fn()
    finally:
        torch.set_num_threads(old)


# ---- round to nearest: dtype pairs, sizes, bit patterns ----

@pytest.mark.smoke
@pytest.mark.parametrize("pair", PAIRS, ids=pair_id)
def test_sizes_all_pairs(pair):
    src_dt, dst_dt = pair
    srcs = [random_values(n, src_dt, seed=n) for n in SIZES]
    for n, s in zip(SIZES, srcs):
        what = f"size {n}"
        check_cast([s], dst_dt, what)
        # the in-place form and the raw op, into preallocated outputs
        d = torch.empty(n, dtype=dst_dt)
        ampc.ops.cast_([d], [s])
        assert_same(d, s.to(dst_dt), f"cast_ {what}", nan_payload=src_dt == dst_dt)
        d = torch.empty(n, dtype=dst_dt)
        torch.ops.ampc.cast([d], [s], [], False, 0)
        assert_same(d, s.to(dst_dt), f"torch.ops.ampc.cast {what}",
                    nan_payload=src_dt == dst_dt)
    check_cast(srcs, dst_dt, "all sizes in one list")


def f16_value(h):
    """Value of fp16 bit patterns, decoded from the IEEE 754 fields (not through torch)."""
    h = h.to(torch.int64) & 0xFFFF
    sign = torch.where(h >= 0x8000, -1.0, 1.0).double()
    e = (h >> 10) & 0x1F
    m = (h & 0x3FF).double()
    normal = torch.ldexp(1.0 + m / 1024, e - 15)
    sub = torch.ldexp(m, torch.full_like(e, -24))
    v = torch.where(e == 0, sub, normal)
    v = torch.where(e == 0x1F, torch.where(m == 0, torch.inf, torch.nan), v)
    return sign * v


@pytest.mark.smoke
@pytest.mark.parametrize("dst", DTYPES, ids=NAMES.get)
@pytest.mark.parametrize("src", [F16, BF16], ids=NAMES.get)
def test_every_16bit_pattern(src, dst):
    x = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(src)
    # one tensor (vector code), then 7-element tensors (scalar code for every element)
    check_cast([x], dst, "all 65536 patterns")
    parts = list(x.split(7))
    out = torch.cat(ampc.ops.cast(parts, dst))
    assert_same(out, x.to(dst), f"cast all patterns in 7-element tensors "
                f"{NAMES[src]}->{NAMES[dst]}", nan_payload=src == dst)
    if dst == F32:
        # the widening is exact: check it against the format itself too
        got = ampc.ops.cast([x], F32)[0].double()
        want = f16_value(bits(x)) if src == F16 else \
            (bits(x).to(torch.int32) << 16).view(F32).double()
        assert_same(got, want, f"cast {NAMES[src]}->fp32 against the decoded format")


@pytest.mark.parametrize("dst", [F16, BF16], ids=NAMES.get)
def test_fp32_pattern_sweep(dst):
    # every 257th fp32 bit pattern: all exponents, signs, mantissa residues and ties
    k = torch.arange(0, 2 ** 32, 257, dtype=torch.int64)
    x = torch.where(k >= 2 ** 31, k - 2 ** 32, k).to(torch.int32).view(F32)
    check_cast([x], dst, "every 257th fp32 pattern")
    # a sparser subset through the scalar code, in 7-element tensors
    sub = x[::61].contiguous()
    out = torch.cat(ampc.ops.cast(list(sub.split(7)), dst))
    assert_same(out, sub.to(dst), f"cast fp32 patterns in 7-element tensors fp32->{NAMES[dst]}")


# fp32 bit pattern, expected fp16 bits, expected bf16 bits (None: any NaN)
SPECIALS = [
    (0x00000000, 0x0000, 0x0000),   # +0
    (0x80000000, 0x8000, 0x8000),   # -0
    (0x00000001, 0x0000, 0x0000),   # smallest fp32 subnormal
    (0x00010000, 0x0000, 0x0001),   # an exact bf16 subnormal (not flushed)
    (0x00008000, 0x0000, 0x0000),   # bf16 subnormal tie, to even 0
    (0x00018000, 0x0000, 0x0002),   # bf16 subnormal tie, to even 2
    (0x80018000, 0x8000, 0x8002),
    (0x00008001, 0x0000, 0x0001),   # just past a bf16 subnormal tie
    (0x007FFFFF, 0x0000, 0x0080),   # largest fp32 subnormal rounds to a bf16 normal
    (0x00800000, 0x0000, 0x0080),   # smallest fp32 normal
    (0x33800000, 0x0001, 0x3380),   # 2^-24: smallest fp16 subnormal
    (0x33000000, 0x0000, 0x3300),   # 2^-25: fp16 tie between 0 and 1, to 0
    (0x33000001, 0x0001, 0x3300),   # just past it
    (0x32FFFFFF, 0x0000, 0x3300),   # just below it
    (0x33C00000, 0x0002, 0x33C0),   # 1.5 * 2^-24: fp16 tie between 1 and 2, to 2
    (0x34200000, 0x0002, 0x3420),   # 2.5 * 2^-24: fp16 tie between 2 and 3, to 2
    (0xB4200000, 0x8002, 0xB420),
    (0x387FC000, 0x03FF, 0x3880),   # largest fp16 subnormal
    (0x387FE000, 0x0400, 0x3880),   # tie between it and 2^-14, to even 0x400
    (0x387FDFFF, 0x03FF, 0x3880),
    (0x387FFFFF, 0x0400, 0x3880),   # just below 2^-14
    (0x38800000, 0x0400, 0x3880),   # 2^-14: smallest fp16 normal
    (0x3F801000, 0x3C00, 0x3F80),   # 1 + 2^-11: fp16 tie, to even 1.0
    (0x3F803000, 0x3C02, 0x3F80),   # 1 + 3 * 2^-11: fp16 tie, to even 0x3c02
    (0xBF803000, 0xBC02, 0xBF80),
    (0x3F801001, 0x3C01, 0x3F80),   # just past the fp16 tie
    (0x3F800FFF, 0x3C00, 0x3F80),   # just below it
    (0x3F808000, 0x3C04, 0x3F80),   # 1 + 2^-8: bf16 tie, to even 1.0
    (0x3F818000, 0x3C0C, 0x3F82),   # 1 + 3 * 2^-8: bf16 tie, to even 0x3f82
    (0x3F808001, 0x3C04, 0x3F81),   # just past the bf16 tie
    (0x3F817FFF, 0x3C0C, 0x3F81),   # just below it
    (0x3FFFFFFF, 0x4000, 0x4000),   # rounding carries into the exponent
    (0x477FE000, 0x7BFF, 0x4780),   # 65504: largest fp16
    (0x477FEFFE, 0x7BFF, 0x4780),   # 65519.99
    (0x477FEFFF, 0x7BFF, 0x4780),   # largest fp32 below 65520
    (0x477FF000, 0x7C00, 0x4780),   # 65520: rounds to fp16 inf
    (0xC77FF000, 0xFC00, 0xC780),   # -65520
    (0xC77FE000, 0xFBFF, 0xC780),   # -65504
    (0x47800000, 0x7C00, 0x4780),   # 65536
    (0x49742400, 0x7C00, 0x4974),   # 1e6
    (0x7F7F0000, 0x7C00, 0x7F7F),   # largest bf16
    (0x7F7F7FFF, 0x7C00, 0x7F7F),
    (0x7F7F8000, 0x7C00, 0x7F80),   # tie above the largest bf16 (odd): to inf
    (0x7F7E8000, 0x7C00, 0x7F7E),   # tie below an even bf16: stays finite
    (0x7F7FFFFF, 0x7C00, 0x7F80),   # largest fp32: bf16 inf
    (0xFF7FFFFF, 0xFC00, 0xFF80),
    (0x7F800000, 0x7C00, 0x7F80),   # +inf
    (0xFF800000, 0xFC00, 0xFF80),   # -inf
    (0x7FC00000, None, None),       # quiet NaN
    (0xFFC00000, None, None),       # negative quiet NaN
    (0x7F800001, None, None),       # signaling NaN, payload in the lowest bit only
    (0xFF800001, None, None),
    (0x7FA00000, None, None),
    (0x7FFFFFFF, None, None),
    (0x7F802000, None, None),       # payload only in the bits fp16 keeps
]


def specials_f32():
    b = torch.tensor([s[0] for s in SPECIALS], dtype=torch.int64)
    return torch.where(b >= 2 ** 31, b - 2 ** 32, b).to(torch.int32).view(F32)


def expected_specials(dst):
    col = 1 if dst == F16 else 2
    b = torch.tensor([s[col] if s[col] is not None else 0x7FFF for s in SPECIALS],
                     dtype=torch.int32)
    return b.to(torch.int16).view(dst)


@pytest.mark.parametrize("dst", [F16, BF16], ids=NAMES.get)
def test_special_values(dst):
    x = specials_f32()
    want = expected_specials(dst)
    # the hand-computed table agrees with torch
    assert_same(x.to(dst), want, f"Tensor.to table check fp32->{NAMES[dst]}")
    # scalar code: one element per tensor
    out = torch.cat(ampc.ops.cast(list(x.split(1)), dst))
    assert_same(out, want, f"cast specials as 1-element tensors fp32->{NAMES[dst]}")
    # vector code: every value in every lane (an odd count tiled 17 times)
    tiled = x.repeat(17)
    assert_same(ampc.ops.cast([tiled], dst)[0], want.repeat(17),
                f"cast specials tiled fp32->{NAMES[dst]}")
    # a NaN never turns into inf or a number
    nan = torch.tensor([s[1] is None for s in SPECIALS]).repeat(17)
    assert bool(torch.isnan(ampc.ops.cast([tiled], dst)[0][nan]).all()), \
        f"cast fp32->{NAMES[dst]}: a NaN input gave a non-NaN"


@pytest.mark.parametrize("pair", [(F16, BF16), (BF16, F16)], ids=pair_id)
def test_special_values_16bit(pair):
    src, dst = pair
    if src == BF16:
        # overflow to fp16 inf, exact large values, fp16 subnormals and their ties
        vals = [65504.0, 65280.0, 65536.0, -65536.0, 1e10, 2.0 ** -24, 2.0 ** -25,
                1.5 * 2.0 ** -24, 2.5 * 2.0 ** -24, 2.0 ** -26, 1e-8, -1e-8, 3e-5, 2.0 ** -14,
                0.0, -0.0, float("inf"), float("-inf"), float("nan")]
    else:
        # bf16 ties: 1 + 2^-8 to even 1.0, 1 + 3 * 2^-8 to even 1 + 2^-6
        vals = [1 + 2.0 ** -8, 1 + 3 * 2.0 ** -8, 1 + 2.0 ** -10, 65504.0, 2.0 ** -24,
                6e-5, 0.0, -0.0, float("inf"), float("-inf"), float("nan")]
    x = torch.tensor(vals, dtype=src)
    for s in (x, x.repeat(17)):
        check_cast([s], dst, "special values")
        check_cast(list(s.split(1)), dst, "special values as 1-element tensors")


def test_fp16_overflow_boundary_literal():
    x = torch.tensor([65504.0, 65519.99, 65520.0, -65520.0, 65535.0], dtype=F32)
    want = torch.tensor([65504.0, 65504.0, float("inf"), float("-inf"), float("inf")],
                        dtype=F16)
    assert_same(ampc.ops.cast([x], F16)[0], want, "cast fp32->fp16 overflow boundary")


# ---- shapes and layouts ----

def test_empty_list():
    assert ampc.ops.cast([], F16) == []
    assert ampc.ops.cast([], BF16, stochastic=True, seed=3) == []
    assert ampc.ops.cast((), F32) == []


def test_cast__empty_lists():
    # nothing to copy is not an error (a model with no parameters of some kind); the
    # raw op alone cannot be dispatched without a tensor, so the wrapper must handle it
    ampc.ops.cast_([], [])
    ampc.ops.cast_([], [], stochastic=True, seed=3)


@pytest.mark.parametrize("pair", PAIRS, ids=pair_id)
def test_zero_element_tensors(pair):
    src_dt, dst_dt = pair
    shapes = [(0,), (5,), (3, 0), (17,), (0, 4), (70000,), (0,)]
    srcs = [random_values(max(1, int(torch.tensor(s).prod())), src_dt, seed=i)[
        : int(torch.tensor(s).prod())].reshape(s) for i, s in enumerate(shapes)]
    check_cast(srcs, dst_dt, "with zero-element tensors")
    for stochastic in (False, True):
        out = ampc.ops.cast(srcs, dst_dt, stochastic=stochastic, seed=1)
        assert [tuple(o.shape) for o in out] == shapes, f"cast: shapes not kept: {out}"
    # only zero-element tensors
    only = [torch.empty(0, dtype=src_dt), torch.empty(2, 0, dtype=src_dt)]
    check_cast(only, dst_dt, "only zero-element tensors")


@pytest.mark.parametrize("pair", PAIRS, ids=pair_id)
def test_shapes_kept(pair):
    src_dt, dst_dt = pair
    shapes = [(), (1,), (3, 5), (2, 3, 4, 5), (1, 1, 1), (7, 1, 9)]
    srcs = [random_values(max(1, int(torch.tensor(s).prod())), src_dt, seed=i).reshape(s)
            for i, s in enumerate(shapes)]
    # contiguous by torch's rule although size-1 dims carry odd strides
    for i, (shape, stride) in enumerate((((1, 5), (99, 1)), ((5, 1), (1, 42)),
                                         ((2, 1, 3), (3, 77, 1)))):
        t = torch.empty_strided(shape, stride, dtype=src_dt)
        t.copy_(random_values(t.numel(), src_dt, seed=50 + i).reshape(shape))
        assert t.is_contiguous()
        srcs.append(t)
    check_cast(srcs, dst_dt, "multi-dimensional")


@pytest.mark.parametrize("pair", PAIRS, ids=pair_id)
def test_thousand_mixed_sizes(pair):
    src_dt, dst_dt = pair
    g = torch.Generator().manual_seed(1000)
    sizes = torch.randint(0, 3000, (1000,), generator=g).tolist()
    for i in range(0, 1000, 37):
        sizes[i] = 0
    sizes[5], sizes[500], sizes[-1] = 70000, 65537, 0
    data = random_values(sum(sizes), src_dt, seed=7)
    check_cast(list(data.split(sizes)), dst_dt, "1000 mixed sizes")


@pytest.mark.parametrize("pair", PAIRS, ids=pair_id)
def test_storage_offsets(pair):
    """Views that start at element 1 or 3 (unaligned for the vector code), on either side;
    the elements around the output view keep their sentinel bits."""
    src_dt, dst_dt = pair
    sentinel = 0x5A5A5A5A if dst_dt == F32 else 0x5A5A
    for n in (1, 15, 16, 17, 1025, 65537):
        for s_off, d_off in ((1, 3), (3, 1), (1, 1), (0, 3)):
            base = random_values(n + 8, src_dt, seed=n + s_off)
            src = base[s_off : s_off + n]
            out_base = torch.full((n + 8,), sentinel, dtype=INT_VIEW[dst_dt]).view(dst_dt)
            dst = out_base[d_off : d_off + n]
            ampc.ops.cast_([dst], [src])
            what = f"cast_ size {n}, src offset {s_off}, dst offset {d_off}"
            assert_same(dst, src.to(dst_dt), what, nan_payload=src_dt == dst_dt)
            guard = torch.cat([bits(out_base[:d_off]), bits(out_base[d_off + n :])])
            assert bool((guard == sentinel).all()), f"{what}: wrote outside the output view"
            check_cast([src], dst_dt, f"size {n}, offset {s_off}")


@pytest.mark.parametrize("pair", PAIRS, ids=pair_id)
def test_non_contiguous(pair):
    src_dt, dst_dt = pair
    base = random_values(64 * 48, src_dt, seed=3).reshape(64, 48)
    cases = [base.t(), base[:, ::3], base[::2], base.t()[5:20, 3:9],
             random_values(50, src_dt, seed=4).reshape(1, 50).expand(7, 50),
             random_values(2 * 3 * 4 * 5, src_dt, seed=5).reshape(2, 3, 4, 5)
             .to(memory_format=torch.channels_last)]
    assert not any(c.is_contiguous() for c in cases)
    out = ampc.ops.cast(cases, dst_dt)
    for i, (c, o) in enumerate(zip(cases, out)):
        assert o.is_contiguous(), f"cast: output {i} is not contiguous"
        assert_same(o, c.to(dst_dt), f"cast non-contiguous case {i}",
                    nan_payload=src_dt == dst_dt)
    # the raw op refuses them, on either side
    nc = cases[0]
    with pytest.raises(RuntimeError, match="contiguous"):
        torch.ops.ampc.cast([torch.empty(nc.shape, dtype=dst_dt)], [nc], [], False, 0)
    dst = torch.empty(48, 64, dtype=dst_dt).t()
    with pytest.raises(RuntimeError, match="contiguous"):
        torch.ops.ampc.cast([dst], [base], [], False, 0)


@pytest.mark.parametrize("pair", [(F32, F16), (F32, BF16), (BF16, F16)], ids=pair_id)
def test_thread_count_independent(pair):
    src_dt, dst_dt = pair
    srcs = [random_values(n, src_dt, seed=n) for n in (300001, 65536, 17, 131073)]
    for stochastic in (False, True):
        run = lambda: ampc.ops.cast(srcs, dst_dt, stochastic=stochastic, seed=11)  # noqa: E731
        one, two = with_threads(1, run), with_threads(2, run)
        for i, (a, b) in enumerate(zip(one, two)):
            assert_same(b, a, f"cast stochastic={stochastic} tensor {i}, 2 threads vs 1",
                        nan_payload=True)
        if not stochastic:
            check_cast(srcs, dst_dt, "large list")


@pytest.mark.slow
def test_more_than_2_31_elements():
    """One bf16 tensor of 2^31 + 100 elements cast to fp16. Element i holds pattern
    i mod 65537 (a period that does not divide 2^31, so an index that wraps at 2^31
    or 2^32 reads a different value); every element is checked."""
    n = 2 ** 31 + 100
    period = 65537
    pattern = ((torch.arange(period) * 40503) % 65536 - 32768).to(torch.int16)
    src = torch.empty(n, dtype=BF16)
    full = n // period
    bits(src)[: full * period].view(full, period).copy_(pattern)
    bits(src)[full * period :].copy_(pattern[: n - full * period])
    dst = ampc.ops.cast([src], F16)[0]
    assert dst.shape == (n,)
    want = pattern.view(BF16).to(F16)
    # around 2^31 and at the end, against Tensor.to()
    for lo, hi in ((2 ** 31 - 70000, 2 ** 31 + 70000), (n - 1000, n)):
        assert_same(dst[lo:hi], src[lo:hi].to(F16), f"cast bf16->fp16 elements [{lo}, {hi})")
    assert_same(dst[::9973], src[::9973].to(F16), "cast bf16->fp16 every 9973rd element")
    assert_periodic(dst, want, "cast bf16->fp16")


# ---- stochastic rounding ----

def check_neighbours(x, out, dst, what):
    """Every out[i] is lo or hi of x[i] (with x's sign), lo when x[i] is exact, hi when
    x[i] lies past the largest finite neighbour's gap."""
    xf = x.float().reshape(-1)
    lo, hi, p = stochastic_neighbours(xf, dst)
    b = bits(out.reshape(-1)).to(torch.int32)
    mag = b & 0x7FFF
    ok = ((mag == lo) & (p < 1)) | ((mag == hi) & (p > 0))
    ok &= (b < 0) == torch.signbit(xf)
    if not bool(ok.all()):
        i = int(torch.nonzero(~ok)[0, 0])
        raise AssertionError(
            f"{what}: dtype {dst}, shape {tuple(x.shape)}: {int((~ok).sum())} results are "
            f"not a neighbour; first at flat index {i}: input {xf[i].item()!r}, got "
            f"0x{int(b[i]) & 0xFFFF:04x}, neighbours 0x{int(lo[i]):04x} and "
            f"0x{int(hi[i]):04x} (p(hi) = {p[i].item():.6g})")


@pytest.mark.parametrize("pair", [(F32, F16), (F32, BF16), (BF16, F16), (F16, BF16)],
                         ids=pair_id)
def test_stochastic_gives_a_neighbour(pair):
    src, dst = pair
    x = finite_values(200003, src, seed=21)
    if src == F32:   # also values just around the largest fp16
        x = torch.cat([x, torch.linspace(65000, 66000, 1001), -torch.linspace(65000, 66000, 1001)])
    for seed in (0, 1, 12345):
        out = ampc.ops.cast([x], dst, stochastic=True, seed=seed)[0]
        check_neighbours(x, out, dst, f"cast stochastic {NAMES[src]}->{NAMES[dst]} seed {seed}")
        # scalar and vector code paths do not matter here, but the list walk does
        parts = ampc.ops.cast(list(x.split(7)), dst, stochastic=True, seed=seed)
        assert_same(torch.cat(parts), out, "cast stochastic in 7-element tensors vs one tensor",
                    nan_payload=True)


@pytest.mark.parametrize("pair", [(F16, F16), (BF16, BF16), (BF16, F16)], ids=pair_id)
def test_stochastic_exact_values_unchanged(pair):
    """Every value the destination holds exactly comes back unchanged (from fp32 and from
    the 16-bit source), infinities included."""
    src, dst = pair
    x = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(src)
    x = x[~torch.isnan(x)]
    if src != dst:
        x = x[x.to(dst).to(src) == x]       # the bf16 values fp16 holds exactly
    for s in (x, x.float()):
        out = ampc.ops.cast([s], dst, stochastic=True, seed=99)[0]
        assert_same(out, s.to(dst), f"cast stochastic of exact values "
                    f"{NAMES[s.dtype]}->{NAMES[dst]}", nan_payload=True)


@pytest.mark.parametrize("dst", [F16, BF16], ids=NAMES.get)
def test_stochastic_special_values(dst):
    vals = [float("inf"), float("-inf"), float("nan"), -float("nan"), 0.0, -0.0]
    if dst == F16:      # past the gap above 65504: always inf
        vals += [1e30, -1e30, 70000.0, -65536.0]
    x = torch.tensor(vals * 5)
    out = ampc.ops.cast([x], dst, stochastic=True, seed=5)[0]
    assert_same(out, x.to(dst), f"cast stochastic inf/nan/zero fp32->{NAMES[dst]}")


@pytest.mark.smoke
def test_stochastic_seed():
    x = torch.randn(300000, generator=torch.Generator().manual_seed(0))
    cast = lambda seed: bits(ampc.ops.cast([x], BF16, stochastic=True, seed=seed)[0])  # noqa
    a = cast(7)
    assert torch.equal(a, cast(7)), "cast stochastic: the same seed gave different bits"
    assert torch.equal(bits(ampc.ops.cast([x], BF16, stochastic=True)[0]), cast(0)), \
        "cast stochastic: the default seed is not 0"
    # about a third of random values round differently under another seed
    # (2p(1-p) averaged over uniform p); seeds that differ only in their upper 32 bits
    # are different seeds too
    for other in (8, 7 + 2 ** 32, -7, 2 ** 63 - 1, -(2 ** 63)):
        frac = float((cast(other) != a).double().mean())
        assert 0.3 < frac < 0.37, f"cast stochastic: seed {other} vs 7 differ on {frac:.3f}"
    # round to nearest ignores the seed
    assert_same(ampc.ops.cast([x], BF16, seed=123)[0], x.to(BF16), "cast seed without stochastic")


def test_stochastic_counts_elements_across_the_list():
    """The random bits follow the list-wide element index: a list gives the same bits as
    its concatenation, whatever the split, empty tensors and chunk edges included."""
    x = finite_values(1000 + 70000 + 65536 + 3 + 150000, F32, seed=8)
    sizes = [1000, 0, 70000, 65536, 3, 0, 150000]
    whole = ampc.ops.cast([x], F16, stochastic=True, seed=42)[0]
    parts = ampc.ops.cast(list(x.split(sizes)), F16, stochastic=True, seed=42)
    assert_same(torch.cat(parts), whole, "cast stochastic, list vs concatenation",
                nan_payload=True)
    # ampc.ops.cast counts within each dtype group: fp32 tensors a, c around a bf16 b
    a, c = x[:5000], x[5000:9000]
    b = x[9000:12000].to(BF16)
    out = ampc.ops.cast([a, b, c], F16, stochastic=True, seed=42)
    group = ampc.ops.cast([torch.cat([a, c])], F16, stochastic=True, seed=42)[0]
    assert_same(torch.cat([out[0], out[2]]), group, "cast stochastic, mixed dtypes: fp32 group",
                nan_payload=True)
    assert_same(out[1], ampc.ops.cast([b], F16, stochastic=True, seed=42)[0],
                "cast stochastic, mixed dtypes: bf16 group", nan_payload=True)
    # the in-place form and the raw op count the same way
    dst = [torch.empty(n, dtype=F16) for n in sizes]
    ampc.ops.cast_(dst, list(x.split(sizes)), stochastic=True, seed=42)
    assert_same(torch.cat(dst), whole, "cast_ stochastic vs cast", nan_payload=True)
    dst = [torch.empty(n, dtype=F16) for n in sizes]
    torch.ops.ampc.cast(dst, list(x.split(sizes)), [], True, 42)
    assert_same(torch.cat(dst), whole, "torch.ops.ampc.cast stochastic vs cast", nan_payload=True)


@pytest.mark.parametrize("dst", [F16, BF16], ids=NAMES.get)
def test_stochastic_sign_symmetric(dst):
    x = finite_values(100000, F32, seed=9).abs()
    pos = ampc.ops.cast([x], dst, stochastic=True, seed=3)[0]
    neg = ampc.ops.cast([-x], dst, stochastic=True, seed=3)[0]
    assert_same(neg, -pos, f"cast stochastic of -x vs -(cast of x) fp32->{NAMES[dst]}",
                nan_payload=True)


ULP16, ULPBF = 2.0 ** -10, 2.0 ** -7
UNBIASED_VALUES = {
    F16: [1 + 0.3 * ULP16, 1 + 0.5 * ULP16, 1 + 0.01 * ULP16, 1 + 0.99 * ULP16, -(1 + 0.3 * ULP16),
          3.14159265, -2.718281828, 1000.3, 0.1, 1e-3, 6.0e-5, 2.0 ** -14 * (1 - 0.3 * ULP16),
          0.3 * 2.0 ** -24, 2.7 * 2.0 ** -24, 1e-6, -5e-7, 65504 + 8.0, 65504 + 31.0,
          65000.7, -65510.0],
    BF16: [1 + 0.3 * ULPBF, 1 + 0.5 * ULPBF, 1 + 0.02 * ULPBF, -(1 + 0.3 * ULPBF), 0.1,
           3.14159265, -1e30, 12345.678, 1e-39, -3.0e-41, 3.3e38,
           float(torch.tensor(0x7F7F4000, dtype=torch.int32).view(F32))],
}


@pytest.mark.parametrize("dst", [F16, BF16], ids=NAMES.get)
def test_stochastic_unbiased(dst):
    """N samples of each value (one tensor, one seed): the share rounded up matches the
    reference probability, its error shrinks like 1/sqrt(N), and the mean error is far
    below round to nearest's bias."""
    vals = torch.tensor(UNBIASED_VALUES[dst], dtype=F32)
    m, n, n_small = vals.numel(), 2 ** 20, 1000
    lo, hi, p = stochastic_neighbours(vals, dst)
    assert bool(((p > 0) & (p < 1)).all()), "test values must not be exact"
    out = ampc.ops.cast([vals.repeat_interleave(n)], dst, stochastic=True, seed=2024)[0]
    check_neighbours(vals.repeat_interleave(n), out, dst, "cast stochastic, repeated values")
    is_hi = ((bits(out).to(torch.int32) & 0x7FFF).view(m, n) == hi[:, None]).double()
    err_big = is_hi.mean(1) - p                 # mean error in units of the gap
    err_small = is_hi[:, :n_small].mean(1) - p
    sigma = (p * (1 - p)).sqrt()
    for i in range(m):
        what = (f"cast stochastic fp32->{NAMES[dst]} value {vals[i].item()!r}: "
                f"p(up) = {p[i].item():.6f}")
        for err, k in ((err_big[i], n), (err_small[i], n_small)):
            bound = 5 * sigma[i].item() / k ** 0.5 + 2.0 ** -23
            assert abs(err.item()) <= bound, \
                f"{what}, over {k} samples the share rounded up is off by {err.item():.3g}"
        rtn = ampc.ops.cast([vals[i : i + 1]], dst)[0]
        rtn_bias = (1.0 - p[i].item()) if int(bits(rtn)[0]) & 0x7FFF == int(hi[i]) else -p[i].item()
        if abs(rtn_bias) >= 0.1:
            assert abs(err_big[i].item()) < 0.05 * abs(rtn_bias), \
                f"{what}: mean error {err_big[i].item():.3g} vs round to nearest {rtn_bias:.3g}"
    ratio = (err_small.square().mean() / err_big.square().mean()).sqrt().item()
    assert ratio > 10, (f"cast stochastic fp32->{NAMES[dst]}: RMS error over {n_small} samples "
                        f"is only {ratio:.1f}x the one over {n} (expected about 32x)")
