"""Tests of ampc.ops.unscale_check (and its check_only mode), torch.ops.ampc.unscale_check
and torch.ops.ampc.check_norm on the CPU.

Tolerance rules:
- unscale_check is bit-exact against torch._amp_foreach_non_finite_check_and_unscale_
  (which takes fp32, fp16 and bf16 on the CPU) and against reference.unscale; a NaN only
  has to meet a NaN at the same position. found_inf is exact: 1.0 after any inf or NaN
  input element, otherwise left as it was (it is never cleared).
- check_only leaves every bit of the grads unchanged (NaN payloads included), sets
  found_inf exactly like unscale_check, and returns a norm within relative 1e-5 of
  reference.norm (float64) and of torch.linalg.vector_norm (float64) of the grads torch
  unscaled. The norm is bitwise the same on 1 and 2 threads.
"""
import math

import pytest
import torch

import ampc
from reference import INT_VIEW, assert_periodic, assert_same, bits
from reference import norm as ref_norm
from reference import unscale as ref_unscale

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
DTYPES = [F32, F16, BF16]
NAMES = {F32: "fp32", F16: "fp16", BF16: "bf16"}
SIZES = [1, 2, 7, 8, 9, 15, 16, 17, 31, 33, 1023, 1024, 1025, 65535, 65536, 65537,
         131071, 131072, 131073, 200003]
NORM_RTOL = 1e-5
# 1/scale the way GradScaler computes it (not a power of two), powers of two, 1, a factor
# above 1, 0, a negative one, and ones whose products underflow or overflow fp32
INV_SCALES = [float(torch.tensor(65536.7, dtype=torch.float64).reciprocal().float()),
              2.0 ** -16, 2.0 ** -3, 1.0, 3.0, 0.0, -(2.0 ** -10), 1e-30, 1e30]


def grads_of(n, dtype, seed):
    """n finite grads of dtype: magnitudes over many binades (subnormals for 16-bit),
    some exact zeros and negative zeros."""
    g = torch.Generator().manual_seed(seed)
    top = {F32: 40, F16: 12, BF16: 40}[dtype]
    x = torch.ldexp(torch.randn(n, generator=g, dtype=torch.float64),
                    torch.randint(-top, top + 1, (n,), generator=g)).to(dtype)
    x[torch.randint(0, max(n, 1), (n // 50,), generator=g)] = 0.0
    x[torch.randint(0, max(n, 1), (n // 50,), generator=g)] = -0.0
    return x


def scalar(v):
    return torch.full((1,), v, dtype=F32)


def run_pair(grads, inv, found=0.0, what=""):
    """Unscales copies of grads with ampc and with torch; checks them equal (and equal to
    the reference); returns ampc's grads and found_inf."""
    ours, theirs = [g.clone() for g in grads], [g.clone() for g in grads]
    f_ours, f_theirs = scalar(found), scalar(found)
    ampc.ops.unscale_check(ours, f_ours, scalar(inv))
    torch._amp_foreach_non_finite_check_and_unscale_(theirs, f_theirs, scalar(inv))
    for i, (o, t, g) in enumerate(zip(ours, theirs, grads)):
        case = f"unscale_check {what} inv_scale {inv!r} tensor {i}"
        assert_same(o, t, case + " vs torch")
        assert_same(o, ref_unscale(g, inv), case + " vs reference")
    assert_same(f_ours, f_theirs, f"unscale_check {what} inv_scale {inv!r}: found_inf",
                nan_payload=True)
    return ours, f_ours


def run_check_only(grads, inv, found=0.0, what=""):
    """check_only on grads: they keep every bit; returns (norm as float, found_inf)."""
    before = [bits(g).clone() for g in grads]
    f = scalar(found)
    norm = ampc.ops.unscale_check(grads, f, scalar(inv), check_only=True)
    for i, (g, b) in enumerate(zip(grads, before)):
        assert torch.equal(bits(g), b), f"unscale_check check_only {what}: grads[{i}] changed"
    assert norm.dtype == F32 and norm.shape == (), f"check_only {what}: norm is {norm!r}"
    return float(norm), f


def assert_close_norm(got, want, what):
    assert math.isclose(got, want, rel_tol=NORM_RTOL, abs_tol=0.0), \
        f"{what}: norm {got!r}, expected {want!r} (relative error {abs(got - want) / want:.3g})"


# ---- values, sizes, layouts ----

@pytest.mark.smoke
@pytest.mark.parametrize("dtype", DTYPES, ids=NAMES.get)
def test_sizes_and_scales(dtype):
    grads = [grads_of(n, dtype, seed=n) for n in SIZES]
    for inv in INV_SCALES:
        for n, g in zip(SIZES, grads):
            _, f = run_pair([g], inv, what=f"size {n}")
            assert float(f) == 0.0, \
                f"unscale_check size {n} inv {inv}: found_inf set on finite grads"
        _, f = run_pair(grads, inv, what="all sizes in one list")
        assert float(f) == 0.0, "unscale_check: found_inf set on finite grads (an overflowing " \
                                "product is not an inf input)"


@pytest.mark.parametrize("dtype", DTYPES, ids=NAMES.get)
def test_raw_op(dtype):
    grads = [grads_of(n, dtype, seed=n) for n in (17, 1025, 65537)]
    want = [ref_unscale(g, 2.0 ** -7) for g in grads]
    f = scalar(0.0)
    torch.ops.ampc.unscale_check(grads, f, scalar(2.0 ** -7))
    for i, (g, w) in enumerate(zip(grads, want)):
        assert_same(g, w, f"torch.ops.ampc.unscale_check tensor {i}")
    before = [g.clone() for g in grads]
    norm = torch.ops.ampc.check_norm(grads, f, scalar(0.5))
    assert_close_norm(float(norm), ref_norm(before, 0.5), "torch.ops.ampc.check_norm")
    assert float(f) == 0.0


PLANT_SIZES = [1000, 3, 70001, 0, 65536, 17]   # first, middle (index 2) and last tensor


@pytest.mark.parametrize("dtype", DTYPES, ids=NAMES.get)
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("tensor", [0, 2, 5], ids=["first", "middle", "last"])
@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_planted_non_finite(dtype, value, tensor, where):
    grads = [grads_of(n, dtype, seed=i) for i, n in enumerate(PLANT_SIZES)]
    n = PLANT_SIZES[tensor]
    k = {"first": 0, "middle": n // 2, "last": n - 1}[where]
    grads[tensor][k] = value
    what = f"{NAMES[dtype]} {value} at [{tensor}][{k}]"
    ours, f = run_pair(grads, 2.0 ** -16, what=what)
    assert float(f) == 1.0, f"unscale_check {what}: found_inf is {float(f)}, expected 1.0"
    norm, f = run_check_only(grads, 2.0 ** -16, what=what)
    assert float(f) == 1.0, f"check_only {what}: found_inf is {float(f)}, expected 1.0"
    if math.isnan(value):
        assert math.isnan(norm), f"check_only {what}: norm {norm}, expected nan"
    else:
        assert norm == math.inf, f"check_only {what}: norm {norm}, expected inf"


@pytest.mark.parametrize("dtype", DTYPES, ids=NAMES.get)
def test_found_inf_is_sticky(dtype):
    clean = [grads_of(n, dtype, seed=n) for n in (100, 70000)]
    dirty = [g.clone() for g in clean]
    dirty[1][123] = math.inf
    for preset in (0.0, 1.0, 0.5, 2.0):
        _, f = run_pair(clean, 2.0 ** -10, found=preset, what=f"found_inf preset {preset}")
        assert float(f) == preset, f"unscale_check: found_inf {preset} became {float(f)}"
        _, f = run_check_only(clean, 2.0 ** -10, found=preset, what=f"found_inf preset {preset}")
        assert float(f) == preset, f"check_only: found_inf {preset} became {float(f)}"
        _, f = run_pair(dirty, 2.0 ** -10, found=preset, what=f"found_inf preset {preset}")
        assert float(f) == 1.0, f"unscale_check: found_inf {preset} with an inf became {float(f)}"
        _, f = run_check_only(dirty, 2.0 ** -10, found=preset, what=f"found_inf preset {preset}")
        assert float(f) == 1.0, f"check_only: found_inf {preset} with an inf became {float(f)}"


@pytest.mark.parametrize("dtype", DTYPES, ids=NAMES.get)
def test_inv_scale_one_keeps_values(dtype):
    x = grads_of(70001, dtype, seed=5)
    info = torch.finfo(dtype)
    special = torch.tensor([0.0, -0.0, info.tiny, -info.tiny, info.tiny / 4, info.max, -info.max,
                            math.inf, -math.inf, math.nan], dtype=dtype)
    g = torch.cat([x, special, x[:33]])
    ours, f = run_pair([g], 1.0, what="inv_scale 1")
    assert_same(ours[0], g, f"unscale_check {NAMES[dtype]} with inv_scale 1 changed values")
    assert float(f) == 1.0


@pytest.mark.smoke
@pytest.mark.parametrize("dtype", DTYPES, ids=NAMES.get)
def test_check_only(dtype):
    grads = [grads_of(n, dtype, seed=n) for n in SIZES]
    for inv in (2.0 ** -8, INV_SCALES[0], 1.0):
        norm, f = run_check_only(grads, inv, what=f"inv_scale {inv}")
        assert float(f) == 0.0
        assert_close_norm(norm, ref_norm(grads, inv), f"check_only {NAMES[dtype]} inv {inv}")
    # against torch's norm of the grads torch unscaled (a power of two: exact products)
    unscaled = [g.clone() for g in grads]
    torch._amp_foreach_non_finite_check_and_unscale_(unscaled, scalar(0.0), scalar(2.0 ** -8))
    torch_norm = float(torch.linalg.vector_norm(torch.cat([u.double() for u in unscaled])))
    norm, _ = run_check_only(grads, 2.0 ** -8)
    assert_close_norm(norm, torch_norm, f"check_only {NAMES[dtype]} vs torch.linalg.vector_norm")


def test_check_only_known_value():
    # 3-4-5 and 5-12-13 triangles, in pieces of every dtype: the norm is 2 * 13 = 26
    grads = [torch.tensor([3.0, 4.0]), torch.tensor([12.0], dtype=F16),
             torch.tensor([0.0, 0.0], dtype=BF16)]
    norm = ampc.ops.unscale_check(grads, scalar(0.0), scalar(-2.0), check_only=True)
    assert float(norm) == 26.0, f"check_only: norm {float(norm)}, expected 26"


@pytest.mark.parametrize("dtype,exponent", [(F32, 70), (F32, 60), (F32, -80), (BF16, 70),
                                            (BF16, -80), (F32, 40), (F32, -40), (BF16, 40),
                                            (F16, 13), (F16, -10)],
                         ids=lambda v: NAMES.get(v, str(v)))
def test_check_only_norm_extreme_magnitudes(dtype, exponent):
    """Grads scaled by 2^e and unscaled by 2^-e have the norm of the unscaled grads.
    Large scaled grads are what a GradScaler left growing for 100k+ steps produces
    (bf16 autocast never overflows); the squares must not overflow or underflow."""
    g = torch.Generator().manual_seed(exponent + 100)
    base = torch.randn(100000, generator=g)
    grads = [torch.ldexp(base, torch.tensor(exponent)).to(dtype)]
    inv = 2.0 ** -exponent
    norm, f = run_check_only(grads, inv)
    assert float(f) == 0.0
    assert_close_norm(norm, ref_norm(grads, inv),
                      f"check_only {NAMES[dtype]} grads of magnitude 2^{exponent}, inv_scale "
                      f"2^{-exponent}")


def test_empty_and_zero_element():
    f = scalar(0.0)
    assert ampc.ops.unscale_check([], f, scalar(0.5)) is None
    norm = ampc.ops.unscale_check([], f, scalar(0.5), check_only=True)
    assert float(norm) == 0.0 and float(f) == 0.0
    for dtype in DTYPES:
        grads = [torch.empty(0, dtype=dtype), grads_of(17, dtype, seed=1),
                 torch.empty(3, 0, dtype=dtype), grads_of(70000, dtype, seed=2),
                 torch.empty(0, dtype=dtype)]
        run_pair(grads, 0.25, what="with zero-element tensors")
        norm, f = run_check_only(grads, 0.25)
        assert_close_norm(norm, ref_norm(grads, 0.25), f"check_only {NAMES[dtype]} with empties")
        only = [torch.empty(0, dtype=dtype), torch.empty(0, 4, dtype=dtype)]
        run_pair(only, 0.25, what="only zero-element tensors")
        norm, f = run_check_only(only, 0.25)
        assert norm == 0.0 and float(f) == 0.0


@pytest.mark.parametrize("dtype", DTYPES, ids=NAMES.get)
def test_shapes(dtype):
    shapes = [(), (1,), (3, 5), (2, 3, 4, 5), (1, 1, 1), (7, 1, 9)]
    grads = [grads_of(max(1, math.prod(s)), dtype, seed=i).reshape(s)
             for i, s in enumerate(shapes)]
    # contiguous by torch's rule although size-1 dims carry odd strides
    for i, (shape, stride) in enumerate((((1, 5), (99, 1)), ((5, 1), (1, 42)),
                                         ((2, 1, 3), (3, 77, 1)))):
        t = torch.empty_strided(shape, stride, dtype=dtype)
        t.copy_(grads_of(t.numel(), dtype, seed=50 + i).reshape(shape))
        grads.append(t)
    run_pair(grads, 2.0 ** -4, what="multi-dimensional")
    norm, _ = run_check_only(grads, 2.0 ** -4)
    assert_close_norm(norm, ref_norm(grads, 2.0 ** -4), "check_only multi-dimensional")


@pytest.mark.parametrize("dtype", DTYPES, ids=NAMES.get)
def test_thousand_mixed_sizes(dtype):
    g = torch.Generator().manual_seed(1000)
    sizes = torch.randint(0, 3000, (1000,), generator=g).tolist()
    for i in range(0, 1000, 37):
        sizes[i] = 0
    sizes[5], sizes[500], sizes[-1] = 70000, 65537, 0
    grads = list(grads_of(sum(sizes), dtype, seed=3).split(sizes))
    run_pair(grads, INV_SCALES[0], what="1000 mixed sizes")
    norm, _ = run_check_only(grads, INV_SCALES[0])
    assert_close_norm(norm, ref_norm(grads, INV_SCALES[0]), "check_only 1000 mixed sizes")
    grads[700][1] = math.nan
    _, f = run_pair(grads, INV_SCALES[0], what="1000 mixed sizes, one nan")
    assert float(f) == 1.0


@pytest.mark.parametrize("dtype", DTYPES, ids=NAMES.get)
def test_storage_offsets(dtype):
    """Grads that are views starting at element 1 or 3 of a larger buffer: unscaled like
    torch, and the elements around them keep their sentinel bits."""
    sentinel = 0x5A5A5A5A if dtype == F32 else 0x5A5A
    for n in (1, 15, 16, 17, 1025, 65537):
        for off in (1, 3):
            buf = torch.full((2 * n + 16,), sentinel, dtype=INT_VIEW[dtype]).view(dtype)
            a, b = buf[off : off + n], buf[n + 8 + off : n + 8 + off + n]
            a.copy_(grads_of(n, dtype, seed=n))
            b.copy_(grads_of(n, dtype, seed=n + 1))
            a[n // 2] = math.inf
            want = [ref_unscale(t, 2.0 ** -5) for t in (a, b)]
            theirs = [a.clone(), b.clone()]
            torch._amp_foreach_non_finite_check_and_unscale_(theirs, scalar(0.0), scalar(2.0 ** -5))
            f = scalar(0.0)
            norm_want = ref_norm([a, b], 2.0 ** -5)
            norm = ampc.ops.unscale_check([a, b], f, scalar(2.0 ** -5), check_only=True)
            assert float(norm) == norm_want == math.inf and float(f) == 1.0
            f = scalar(0.0)
            ampc.ops.unscale_check([a, b], f, scalar(2.0 ** -5))
            what = f"unscale_check {NAMES[dtype]} size {n} offset {off}"
            for t, w, th in zip((a, b), want, theirs):
                assert_same(t, w, what + " vs reference")
                assert_same(t, th, what + " vs torch")
            assert float(f) == 1.0
            mask = torch.ones(buf.numel(), dtype=torch.bool)
            mask[off : off + n] = False
            mask[n + 8 + off : n + 8 + off + n] = False
            assert bool((bits(buf)[mask] == sentinel).all()), f"{what}: wrote outside the grads"


@pytest.mark.parametrize("dtype", DTYPES, ids=NAMES.get)
def test_non_contiguous_refused_untouched(dtype):
    base = grads_of(64 * 48, dtype, seed=4).reshape(64, 48)
    ok = grads_of(1000, dtype, seed=5)
    for nc in (base.t(), base[:, ::3]):
        before = [bits(base).clone(), bits(ok).clone()]
        for check_only in (False, True):
            with pytest.raises(RuntimeError, match="contiguous"):
                ampc.ops.unscale_check([ok, nc], scalar(0.0), scalar(0.5), check_only=check_only)
            with pytest.raises(RuntimeError, match="contiguous"):
                torch.ops.ampc.unscale_check([ok, nc], scalar(0.0), scalar(0.5))
        assert torch.equal(bits(base), before[0]) and torch.equal(bits(ok), before[1]), \
            "unscale_check: a refused call changed the grads"


def test_mixed_dtypes():
    grads = [grads_of(n, d, seed=i) for i, (n, d) in enumerate(
        [(1000, F32), (70001, F16), (17, BF16), (65536, F32), (0, F16), (1025, BF16), (33, F16)])]
    run_pair(grads, INV_SCALES[0], what="mixed dtypes")
    norm, f = run_check_only(grads, INV_SCALES[0])
    assert float(f) == 0.0
    assert_close_norm(norm, ref_norm(grads, INV_SCALES[0]), "check_only mixed dtypes")
    grads[5][1000] = -math.inf
    _, f = run_pair(grads, INV_SCALES[0], what="mixed dtypes, one -inf")
    assert float(f) == 1.0
    _, f = run_check_only(grads, INV_SCALES[0])
    assert float(f) == 1.0


def test_thread_count_independent():
    grads = [grads_of(n, d, seed=n) for n, d in ((300001, F32), (65536, F32), (17, F32),
                                                 (131073, F32))]
    grads16 = [g.to(BF16) for g in grads]
    for gs in (grads, grads16):
        norms, outs = [], []
        for threads in (1, 2):
            old = torch.get_num_threads()
            torch.set_num_threads(threads)
            try:
                norms.append(ampc.ops.unscale_check(gs, scalar(0.0), scalar(INV_SCALES[0]),
                                                    check_only=True))
                out = [g.clone() for g in gs]
                ampc.ops.unscale_check(out, scalar(0.0), scalar(INV_SCALES[0]))
                outs.append(out)
            finally:
                torch.set_num_threads(old)
        assert_same(norms[1], norms[0], f"check_only {gs[0].dtype} norm, 2 threads vs 1",
                    nan_payload=True)
        assert_close_norm(float(norms[0]), ref_norm(gs, INV_SCALES[0]), "check_only large list")
        for i, (a, b) in enumerate(zip(*outs)):
            assert_same(b, a, f"unscale_check tensor {i}, 2 threads vs 1", nan_payload=True)


@pytest.mark.slow
def test_more_than_2_31_elements():
    """One bf16 grad of 2^31 + 100 elements; element i holds finite value i mod 65537 of
    a random pattern (a period that does not divide 2^31). The norm, an inf planted past
    index 2^31, and every unscaled element are checked."""
    n = 2 ** 31 + 100
    period = 65537
    pattern = grads_of(period, BF16, seed=31)
    full = n // period
    tail = n - full * period
    g = torch.empty(n, dtype=BF16)
    g[: full * period].view(full, period).copy_(pattern)
    g[full * period :].copy_(pattern[:tail])
    inv = 2.0 ** -3
    p64 = pattern.double() ** 2
    want_norm = inv * math.sqrt(full * float(p64.sum()) + float(p64[:tail].sum()))
    f = scalar(0.0)
    norm = ampc.ops.unscale_check([g], f, scalar(inv), check_only=True)
    assert float(f) == 0.0
    assert_close_norm(float(norm), want_norm, "check_only bf16 2^31 + 100 elements")
    planted = 2 ** 31 + 50
    g[planted] = math.inf
    norm = ampc.ops.unscale_check([g], f, scalar(inv), check_only=True)
    assert float(f) == 1.0 and float(norm) == math.inf, \
        f"check_only: inf at {planted} missed (found_inf {float(f)}, norm {float(norm)})"
    f = scalar(0.0)
    ampc.ops.unscale_check([g], f, scalar(inv))
    assert float(f) == 1.0, f"unscale_check: inf at index {planted} missed"
    want = ref_unscale(pattern, inv)
    assert float(g[planted]) == math.inf
    g[planted] = want[planted % period]     # restore the pattern there for the sweep below
    around = torch.arange(2 ** 31 - 70000, n)
    assert_same(g[around], want[around % period], "unscale_check elements around 2^31")
    assert_periodic(g, want, "unscale_check")


@pytest.mark.parametrize("dtype", [F32, BF16], ids=NAMES.get)
@pytest.mark.parametrize("odd", ["huge", "tiny", "at_max", "below_max", "at_min", "below_min"])
def test_check_only_norm_runs_with_outliers(dtype, odd):
    """The norm sums runs of elements in fp32 when that is safe and in double when a run
    holds a value too large or only values too small (Note [fp32 squares when safe]);
    an outlier in one run, among ordinary runs, must not change the accuracy."""
    value = {"huge": 2.0 ** 100, "tiny": 2.0 ** -100, "at_max": 2.0 ** 58,
             "below_max": 2.0 ** 58 * (1 - 2.0 ** -7), "at_min": 2.0 ** -40,
             "below_min": 2.0 ** -40 * (1 - 2.0 ** -7)}[odd]
    g = torch.Generator().manual_seed(5)
    x = torch.randn(10_000, generator=g, dtype=torch.float64)
    if odd in ("tiny", "at_min", "below_min"):
        x[1024:1536] *= value           # one whole run of small values
    else:
        x[1500] = value                 # one large value in an ordinary run
    x = x.to(dtype)
    f = scalar(0.0)
    norm = ampc.ops.unscale_check([x], f, scalar(1.0), check_only=True)
    assert float(f) == 0.0
    assert_close_norm(float(norm), float(x.double().norm()), f"check_only {odd}")
    small = x[1024:1536].double().norm()
    if odd in ("tiny", "at_min", "below_min"):  # the small run alone is summed right too
        run = ampc.ops.unscale_check([x[1024:1536].contiguous()], f, scalar(1.0), check_only=True)
        assert_close_norm(float(run), float(small), f"check_only {odd} run alone")
