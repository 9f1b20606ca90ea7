"""The fp8 casts on the CPU: ampc.ops.cast_fp8, fp8_amax and cast_from_fp8 against torch.

Tolerance rules:
- fp8 outputs are compared bit for bit with torch's
  ``(x.float() * scale).clamp(-fmax, fmax).to(fp8)``, NaN codes and their signs included
  (both run the same fp32 multiply on this CPU, which keeps a NaN operand's sign; for fp16
  inputs the reference keeps a NaN's sign through ``.float()``, see torch_cast).
- The amax is compared with ``x.abs().amax().float()``: equal values, NaN where torch's is
  NaN (payload free), 0 for an empty tensor (where torch refuses).
- cast_from_fp8 is compared with ``(q.float() * scale_inv).to(dtype)``: fp32 outputs bit for
  bit, NaN payload included; fp16/bf16 outputs bit for bit except that a NaN only has to
  meet a NaN (the rule of ampc.ops.cast, whose rounding they share).
"""
import itertools

import pytest
import torch

import ampc
from reference import INT_VIEW, assert_same

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
WIDE = [F32, F16, BF16]
FP8 = [E4M3, E5M2]
FMAX = {E4M3: 448.0, E5M2: 57344.0}
NAMES = {F32: "fp32", F16: "fp16", BF16: "bf16", E4M3: "e4m3", E5M2: "e5m2"}
# around the SIMD widths (8, 16), the chunk (65536) and the size below which the list is
# walked on one thread (2 chunks); and a prime
SIZES = [1, 7, 8, 9, 15, 16, 17, 33, 1023, 65536, 65537, 131073, 200003]
SCALES = [1.0, 2.0 ** -10, 2.0 ** 12, 0.3, 3.7e3, 1e-30, 1e30, 0.0]


def pair_id(pair):
    return "->".join(NAMES[d] for d in pair)


def fp8_bits(q):
    return q.view(torch.uint8)


def torch_cast(x, scale, dtype, keep_nan_sign=True):
    """torch's scaled saturating cast, the op's definition. torch's own fp16 -> fp32 on the
    CPU gives +NaN for a negative NaN in the tail of its vector loop (elsewhere it keeps the
    sign): with keep_nan_sign the reference widens with the fp16 sign kept, as everywhere
    else and as ampc does."""
    m = FMAX[dtype]
    xf = x.float()
    if keep_nan_sign and x.dtype == F16:
        xf = torch.where(torch.isnan(xf), xf.copysign(x.view(torch.int16).float()), xf)
    return (xf * scale).clamp(-m, m).to(dtype)


def torch_amax(x):
    return x.abs().amax().float() if x.numel() else torch.zeros((), dtype=F32)


def random_values(n, dtype, seed):
    """n values of dtype: half spread over many binades (the fp8 ranges and subnormals,
    far beyond them too), half uniformly random bit patterns (inf and NaN of both signs)."""
    g = torch.Generator().manual_seed(seed)
    k = n // 2
    spread = torch.ldexp(torch.randn(n - k, generator=g, dtype=torch.float64),
                         torch.randint(-40, 41, (n - k,), generator=g)).to(dtype)
    info = torch.iinfo(INT_VIEW[dtype])
    raw = torch.randint(info.min, info.max + 1, (k,), generator=g,
                        dtype=INT_VIEW[dtype]).view(dtype)
    return torch.cat([spread, raw])[torch.randperm(n, generator=g)]


def check_cast_fp8(srcs, dtypes, scales, what):
    """One cast_fp8 call over the list equals torch tensor by tensor; amax too."""
    dst = [torch.empty(x.shape, dtype=d) for x, d in zip(srcs, dtypes)]
    scale = torch.tensor(scales, dtype=F32)
    amax = torch.full((len(srcs),), -1.0)
    ampc.ops.cast_fp8(dst, srcs, scale, amax)
    for i, (x, q) in enumerate(zip(srcs, dst)):
        label = f"{what} tensor {i} ({NAMES[x.dtype]}->{NAMES[q.dtype]}, scale {scales[i]})"
        assert_same(fp8_bits(q), fp8_bits(torch_cast(x, scale[i], q.dtype)), label)
        assert_same(amax[i], torch_amax(x), f"{label} amax")
    return dst, amax


# ---- every code: round trips ----

@pytest.mark.smoke
@pytest.mark.parametrize("fmt", FP8, ids=NAMES.get)
@pytest.mark.parametrize("wide", WIDE, ids=NAMES.get)
def test_every_code_round_trips(fmt, wide):
    q = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(fmt)
    back = torch.empty(256, dtype=wide)
    one = torch.ones(1)
    ampc.ops.cast_from_fp8([back], [q], one)
    assert_same(back, (q.float() * one[0]).to(wide), f"{NAMES[fmt]} codes -> {NAMES[wide]}",
                nan_payload=wide == F32)
    again = torch.empty(256, dtype=fmt)
    amax = torch.empty(1)
    ampc.ops.cast_fp8([again], [back], torch.ones(1), amax)
    assert_same(fp8_bits(again), fp8_bits(torch_cast(back, 1.0, fmt)), "codes back to fp8")
    # finite codes come back as themselves; NaN codes as 0x7f or 0xff, e5m2's infs as +-fmax
    finite = torch.isfinite(q.float())
    assert torch.equal(fp8_bits(again)[finite], fp8_bits(q)[finite])
    assert torch.isnan(amax).all()


@pytest.mark.parametrize("fmt", FP8, ids=NAMES.get)
def test_decoded_values_are_exact(fmt):
    """Every code's value from first principles (sign, exponent, mantissa) in float64."""
    man_bits, bias = (3, 7) if fmt == E4M3 else (2, 15)
    out = torch.empty(256)
    ampc.ops.cast_from_fp8([out], [torch.arange(256, dtype=torch.int32).to(torch.uint8).view(fmt)],
                           torch.ones(1))
    for code in range(256):
        sign = -1.0 if code & 0x80 else 1.0
        e = (code & 0x7f) >> man_bits
        m = code & ((1 << man_bits) - 1)
        got = out[code].item()
        if fmt == E4M3 and (code & 0x7f) == 0x7f or fmt == E5M2 and e == 31 and m:
            assert got != got, f"code 0x{code:02x}"
        elif fmt == E5M2 and e == 31:
            assert got == sign * float("inf")
        else:
            want = sign * (m * 2.0 ** (1 - bias - man_bits) if e == 0
                           else (1 + m / 2 ** man_bits) * 2.0 ** (e - bias))
            assert got == want and (got != 0 or (str(got)[0] == "-") == (sign < 0)), \
                f"code 0x{code:02x}: got {got}, want {want}"


# ---- scaled casts: random inputs, sizes, scales ----

@pytest.mark.smoke
@pytest.mark.parametrize("pair", list(itertools.product(WIDE, FP8)), ids=pair_id)
def test_random_inputs_all_sizes(pair):
    wide, fmt = pair
    srcs = [random_values(n, wide, seed=n) for n in SIZES]
    scales = [SCALES[i % len(SCALES)] for i in range(len(SIZES))]
    check_cast_fp8(srcs, [fmt] * len(srcs), scales, "random")


@pytest.mark.parametrize("scale", SCALES)
@pytest.mark.parametrize("pair", list(itertools.product(WIDE, FP8)), ids=pair_id)
def test_every_scale(pair, scale):
    wide, fmt = pair
    check_cast_fp8([random_values(4099, wide, seed=3)], [fmt], [scale], "scale")


def fp8_ties(fmt):
    """fp32 values around every rounding decision of the format: the midpoints between
    adjacent finite values (exact in fp32), one fp32 ulp either side, the values
    themselves; and past the top: fmax's neighbours, the midpoint to the next power."""
    codes = torch.arange(0, 128, dtype=torch.int32).to(torch.uint8).view(fmt).float()
    vals = codes[torch.isfinite(codes)].double().sort().values
    mids = ((vals[1:] + vals[:-1]) / 2).float()
    assert torch.equal(mids.double(), (vals[1:] + vals[:-1]) / 2)      # exact in fp32
    up = torch.nextafter(mids, torch.full_like(mids, float("inf")))
    down = torch.nextafter(mids, torch.zeros_like(mids))
    m = FMAX[fmt]
    top = torch.tensor([m, m * (1 + 2 ** -23), m * 1.0625, m * 1.125, m * 1.1875, 2 * m,
                        3.4028234663852886e38], dtype=F32)
    x = torch.cat([vals.float(), mids, up, down, top])
    return torch.cat([x, -x])


@pytest.mark.smoke
@pytest.mark.parametrize("fmt", FP8, ids=NAMES.get)
def test_ties_and_saturation(fmt):
    x = fp8_ties(fmt)
    check_cast_fp8([x, x.to(BF16), x.to(F16)], [fmt] * 3, [1.0] * 3, "ties")
    # the same decisions reached through the scale: x / 4 scaled by 4 is exact
    check_cast_fp8([x / 4], [fmt], [4.0], "ties through the scale")


def special_values(dtype):
    nan, inf = float("nan"), float("inf")
    tiny = torch.finfo(dtype).tiny                  # smallest normal
    sub = tiny * 2.0 ** -{F32: 23, F16: 10, BF16: 7}[dtype]      # smallest subnormal
    x = torch.tensor([nan, -nan, inf, -inf, 0.0, -0.0, tiny, sub, 2 * sub, tiny - sub,
                      2.0 ** -10, 2.0 ** -17, 2.0 ** -16 * 0.5, 2.0 ** -16 * 0.75,
                      2.0 ** -9 * 0.5, 2.0 ** -9 * 0.5000001, 1.0, 65504.0],
                     dtype=torch.float64).to(dtype)
    return torch.cat([x, -x])


@pytest.mark.parametrize("pair", list(itertools.product(WIDE, FP8)), ids=pair_id)
def test_special_values(pair):
    wide, fmt = pair
    x = special_values(wide)
    # NaN and -NaN of the source dtype (a negative NaN keeps its sign through the multiply)
    assert torch.isnan(x[:2]).all()
    # a NaN scale: torch's vector loops (tensors of 16 elements and more) return the
    # scale's NaN when x is NaN too (Note [NaN times a NaN scale] in csrc/math/fp8.h)
    for scale in (1.0, 2.0 ** 20, 0.0, float("inf"), float("nan"), -float("nan")):
        check_cast_fp8([x], [fmt], [scale], "specials")


# ---- amax ----

def test_amax_exact_and_nan():
    x = torch.randn(100003) * 1e3
    x[77777] = -123456.78
    check_cast_fp8([x], [E4M3], [1.0], "amax")
    amax = torch.empty(1)
    ampc.ops.fp8_amax([x], amax)
    assert amax.item() == 123456.78125
    x[5] = float("nan")
    ampc.ops.fp8_amax([x], amax)
    assert torch.isnan(amax).all()
    y = torch.full((1000,), -0.0)
    ampc.ops.fp8_amax([y], amax)
    assert amax.item() == 0.0 and str(amax.item()) == "0.0"


@pytest.mark.parametrize("wide", WIDE, ids=NAMES.get)
def test_fp8_amax_matches_torch(wide):
    srcs = [random_values(n, wide, seed=n + 1) for n in SIZES] + [torch.empty(0, dtype=wide)]
    srcs += [torch.randn(n).to(wide) for n in (5, 70000)]
    amax = torch.full((len(srcs),), -1.0)
    ampc.ops.fp8_amax(srcs, amax)
    for i, x in enumerate(srcs):
        assert_same(amax[i], torch_amax(x), f"fp8_amax tensor {i}")


# ---- many tensors per call ----

@pytest.mark.smoke
def test_many_tensors_mixed_sizes_and_dtypes():
    g = torch.Generator().manual_seed(7)
    shapes = [(0,), (3, 5), (1,), (0, 4), (70001,), (17, 33), (8,), (2, 0, 3), (131073,)]
    srcs, dtypes, scales = [], [], []
    for i in range(150):
        shape = shapes[i % len(shapes)]
        wide = WIDE[(i // 3) % 3]
        srcs.append((torch.randn(shape, generator=g) * 100).to(wide))
        dtypes.append(FP8[i % 2])
        scales.append(2.0 ** (i % 13 - 6))
    check_cast_fp8(srcs, dtypes, scales, "mixed list")
    srcs = [x.float() for x in srcs]
    check_cast_fp8(srcs, [E4M3] * len(srcs), scales, "one dtype")


def test_empty_list_and_empty_tensors():
    ampc.ops.cast_fp8([], [], torch.ones(0), torch.empty(0))
    amax = torch.full((2,), 5.0)
    ampc.ops.cast_fp8([torch.empty(0, dtype=E4M3)] * 2, [torch.empty(0)] * 2, torch.ones(2), amax)
    assert amax.tolist() == [0.0, 0.0]


def test_same_bits_on_any_thread_count():
    x = [random_values(300001, F32, seed=11), random_values(5, BF16, seed=12)]
    runs = []
    for threads in (1, 2):
        old = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            runs.append(check_cast_fp8(x, [E5M2, E4M3], [0.5, 8.0], f"{threads} threads"))
        finally:
            torch.set_num_threads(old)
    for a, b in zip(runs[0][0], runs[1][0]):
        assert torch.equal(fp8_bits(a), fp8_bits(b))


# ---- cast_from_fp8 ----

@pytest.mark.parametrize("pair", list(itertools.product(FP8, WIDE)), ids=pair_id)
def test_cast_from_fp8_scaled(pair):
    fmt, wide = pair
    g = torch.Generator().manual_seed(5)
    srcs = [torch.randint(0, 256, (n,), generator=g, dtype=torch.int32).to(torch.uint8).view(fmt)
            for n in SIZES + [0]]
    scales = [SCALES[i % len(SCALES)] for i in range(len(srcs))]
    scales[-2] = 2.0 ** 120                 # past fp16's and bf16's range: inf
    scale_inv = torch.tensor(scales, dtype=F32)
    dst = [torch.empty(q.shape, dtype=wide) for q in srcs]
    ampc.ops.cast_from_fp8(dst, srcs, scale_inv)
    for i, (q, y) in enumerate(zip(srcs, dst)):
        assert_same(y, (q.float() * scale_inv[i]).to(wide), f"cast_from_fp8 tensor {i}",
                    nan_payload=wide == F32)


def test_cast_from_fp8_mixed_lists():
    srcs = [torch.randint(0, 256, (n,), dtype=torch.int32).to(torch.uint8).view(FP8[n % 2])
            for n in (3, 40, 17, 0, 1000)]
    dst = [torch.empty(q.shape, dtype=WIDE[i % 3]) for i, q in enumerate(srcs)]
    scale_inv = torch.tensor([0.5, 2.0, 1.0, 3.0, 1e-3])
    ampc.ops.cast_from_fp8(dst, srcs, scale_inv)
    for i, (q, y) in enumerate(zip(srcs, dst)):
        assert_same(y, (q.float() * scale_inv[i]).to(y.dtype), f"mixed tensor {i}")


@pytest.mark.parametrize("fmt", FP8, ids=NAMES.get)
def test_cast_from_fp8_nan_scale_inv(fmt):
    q = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(fmt)
    for s in (float("nan"), -float("nan"), float("inf"), 0.0):
        scale_inv = torch.tensor([s])
        out = torch.empty(256)
        ampc.ops.cast_from_fp8([out], [q], scale_inv)
        assert_same(out, q.float() * scale_inv[0], f"scale_inv {s}", nan_payload=True)
