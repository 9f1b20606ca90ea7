"""Every CUDA kernel and launch plan of ampc, run on the CPU by the CUDA emulation
(csrc/cuda/emu, docs/cuda-emulation.md) under ASan/UBSan, against ampc's CPU path.

Runs only in a process started by scripts/cuda_emu.sh (AMPC_CUDA_EMU names the emulated
library, the sanitizer runtime preloaded); .ci/run runs it in forward, reversed and
shuffled thread order, and once more on the sm80 device (4 KB tables). In that process
`emulated()` sends calls on CPU tensors through the emulated CUDA launchers; outside it the
same calls take the CPU path, so each test runs an op both ways on copies of one input.

Tolerances: bit for bit everywhere (stochastic rounding included: same seed, same bits),
except check_norm's norm, whose sum follows the chunks (within 1e-6 of the CPU path and
a float64 reference; bit-identical across thread orders).
"""
import contextlib
import ctypes
import itertools
import math
import os

import pytest
import torch

import ampc
import ampc.optim

EMU = os.environ.get("AMPC_CUDA_EMU")
pytestmark = pytest.mark.skipif(
    not EMU, reason="runs in the CUDA emulation run: bash scripts/cuda_emu.sh (.ci/run runs it)")

if EMU:
    from ampc import _lib
    _emu = _lib.cuda_lib
    _emu.ampc_emu_device.restype = ctypes.c_char_p
    _emu.ampc_emu_launch_count.restype = ctypes.c_int64
    _emu.ampc_emu_set_order.argtypes = [ctypes.c_int, ctypes.c_uint64]
    _emu.ampc_emu_launch.argtypes = [ctypes.c_int64, ctypes.c_char_p, ctypes.c_int] + \
        [ctypes.POINTER(ctypes.c_int64)] * 3
    DEVICE = _emu.ampc_emu_device().decode()
else:
    DEVICE = "h200"

f32, f16, bf16 = torch.float32, torch.float16, torch.bfloat16
e4m3, e5m2 = torch.float8_e4m3fn, torch.float8_e5m2
DTYPES = [f32, f16, bf16]
FP8 = [e4m3, e5m2]
INT = {f32: torch.int32, f16: torch.int16, bf16: torch.int16, e4m3: torch.uint8, e5m2: torch.uint8,
       torch.int32: torch.int32, torch.int64: torch.int64, torch.uint8: torch.uint8}
SMS = {"h200": 132, "sm80": 108}[DEVICE]
LARGE = DEVICE == "h200" and os.environ.get("AMPC_CUDA_SMALL_PARAMS", "0") in ("", "0")
# tensors a launch, as the README states: two-list tables (cast, unscale, norm), Adam's
# 7 lists, fp8's 4 lists (always 4 KB)
CAP2 = {True: 902, False: 106}
CAP_ADAM = {True: 427, False: 50}
CAP_LEAN = {True: 353, False: 41}   # the lean step's 9 lists
CAP_FP8 = 73
VEC_STEP = 512 * 4 * 8      # elements one pass of a block's vector loop covers (fp16)
# around the 8-element vector, one pass of the vector loop, the smallest and largest chunk
SIZES = [0, 1, 7, 8, 9, 15, 16, 17, VEC_STEP - 1, VEC_STEP + 1, 4095, 4096, 4097,
         65535, 65536, 65537, 2 * 65536 + 5, 0]


def name(d):
    return str(d).replace("torch.", "")


@contextlib.contextmanager
def emulated():
    """Calls on CPU tensors run the emulated CUDA kernels inside."""
    assert _lib.lib.ampc_set_cuda_emulation(1) == 0
    try:
        yield
    finally:
        _lib.lib.ampc_set_cuda_emulation(0)


def launches():
    """(site, grid, block, argument bytes) of every launch since the last clear."""
    out = []
    site = ctypes.create_string_buffer(64)
    g, b, p = ctypes.c_int64(), ctypes.c_int64(), ctypes.c_int64()
    for i in range(_emu.ampc_emu_launch_count()):
        assert _emu.ampc_emu_launch(i, site, 64, ctypes.byref(g), ctypes.byref(b),
                                    ctypes.byref(p)) == 0
        out.append((site.value.decode(), g.value, b.value, p.value))
    return out


def at(n, dtype, offset=0):
    """An empty 1-D tensor of n elements that starts `offset` elements into its storage."""
    return torch.empty(n + offset, dtype=dtype)[offset:]


def values(n, dtype, seed):
    """n values of dtype: random bit patterns (NaN, inf, subnormals), ordinary numbers and,
    for fp32, values next to fp16/bf16 rounding ties."""
    g = torch.Generator().manual_seed(seed)
    if dtype in FP8:
        return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g).view(dtype)
    if dtype != f32:
        return torch.randint(-(2**15), 2**15, (n,), dtype=torch.int16, generator=g).view(dtype)
    b = torch.randint(-(2**31), 2**31, (n,), dtype=torch.int32, generator=g)
    kind = torch.randint(0, 4, (n,), generator=g)
    b = torch.where(kind == 1, (b & ~0xFFFF) | 0x8000,
                    torch.where(kind == 2, (b & ~0x1FFF) | 0x1000, b))
    x = b.view(f32).clone()
    exponent = torch.randint(-20, 20, (n,), generator=g).float()
    normal = torch.randn(n, generator=g) * torch.exp2(exponent)
    return torch.where(kind == 3, normal, x)


def finite(n, dtype, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, generator=g) * scale).to(dtype)


def copy(t):
    """A copy of t at the same storage offset (so with the same misalignment)."""
    if not isinstance(t, torch.Tensor):
        return [copy(x) for x in t]
    c = at(t.numel(), t.dtype, t.storage_offset()).view(t.shape)
    c.copy_(t)
    return c


def assert_bits(got, want, what):
    """Same dtype, shape and bit pattern; a NaN of fp32/fp16/bf16 only has to meet a NaN
    (the CPU's F16C conversion quiets a signaling fp16 NaN, the GPU's, dtype.h's, keeps it)."""
    assert got.dtype == want.dtype and got.shape == want.shape, what
    g, w = got.contiguous().view(INT[got.dtype]), want.contiguous().view(INT[want.dtype])
    if got.dtype in DTYPES:
        nan = torch.isnan(got)
        assert torch.equal(nan, torch.isnan(want)), f"{what}: NaN positions differ"
        g, w = torch.where(nan, 0, g), torch.where(nan, 0, w)
    if not torch.equal(g, w):
        i = int((g.flatten() != w.flatten()).nonzero()[0, 0])
        raise AssertionError(f"{what}: first difference at [{i}] of {got.numel()}: emulated CUDA "
                             f"{int(g.flatten()[i]):#x}, CPU {int(w.flatten()[i]):#x}")


def _tensors(x):
    if isinstance(x, torch.Tensor):
        return [x]
    return [t for v in x for t in _tensors(v)] if isinstance(x, (list, tuple)) else []


def both_ways(call, inputs, what):
    """call(*inputs) on the CPU path and on the emulated CUDA kernels, each on its own copy
    of the inputs; every tensor must end bit-identical. Returns the emulated copy."""
    cpu, emu = copy(inputs), copy(inputs)
    call(*cpu)
    launches = _emu.ampc_emu_launch_count()
    with emulated():
        call(*emu)
    # a call that touches any element must have gone through the emulated kernels, or this
    # would compare the CPU path with itself
    if any(t.numel() for t in _tensors(inputs)):
        assert _emu.ampc_emu_launch_count() > launches, f"{what}: no emulated launch ran"
    for k, (a, b) in enumerate(zip(emu, cpu)):
        for i, (x, y) in enumerate(zip(a, b) if isinstance(a, list) else [(a, b)]):
            assert_bits(x, y, f"{what}: argument {k} tensor {i}")
    return emu


def cast_op(stochastic, seed=7):
    return lambda dst, src: torch.ops.ampc.cast(dst, src, [], stochastic, seed)


# ---- cast ----

@pytest.mark.parametrize("stochastic", [False, True], ids=["nearest", "stochastic"])
@pytest.mark.parametrize("src_dtype,dst_dtype", list(itertools.product(DTYPES, DTYPES)), ids=name)
def test_cast_sizes(src_dtype, dst_dtype, stochastic):
    src = [values(n, src_dtype, i) for i, n in enumerate(SIZES)]
    dst = [at(n, dst_dtype) for n in SIZES]
    both_ways(cast_op(stochastic), [dst, src], f"cast {name(src_dtype)}->{name(dst_dtype)}")


def misalignments(dtype):
    return range(16 // dtype.itemsize)


@pytest.mark.parametrize("stochastic", [False, True], ids=["nearest", "stochastic"])
@pytest.mark.parametrize("src_dtype,dst_dtype", list(itertools.product(DTYPES, DTYPES)), ids=name)
def test_cast_every_misalignment_pair(src_dtype, dst_dtype, stochastic):
    """One tensor for each (src offset, dst offset) within 16 bytes: 8-, 4-, 2-element and
    scalar walks, each with its head and tail."""
    pairs = list(itertools.product(misalignments(src_dtype), misalignments(dst_dtype)))
    n = 300
    src = [values(n, src_dtype, i).clone() for i in range(len(pairs))]
    src = [copy_at(s, a) for s, (a, _) in zip(src, pairs)]
    dst = [at(n, dst_dtype, b) for _, b in pairs]
    both_ways(cast_op(stochastic), [dst, src], f"cast {name(src_dtype)}->{name(dst_dtype)}")


def copy_at(t, offset):
    c = at(t.numel(), t.dtype, offset)
    c.copy_(t)
    return c


def test_cast_mixed_dtypes_in_one_list():
    dts = [DTYPES[i % 3] for i in range(12)]
    src = [values(100 + 37 * i, d, i) for i, d in enumerate(dts)]
    dst = [at(s.numel(), DTYPES[(i + 1) % 3], i % 5) for i, s in enumerate(src)]
    both_ways(cast_op(True), [dst, src], "mixed cast")


def test_cast_seed_tensor_is_read_on_the_device():
    src = [values(5000, f32, 1)]
    seed = torch.tensor([123456789], dtype=torch.int64)
    both_ways(lambda d, s, t: torch.ops.ampc.cast(d, s, [t], True, 0),
              [[at(5000, bf16)], src, seed], "cast with a seed tensor")


# ---- unscale_check, check_norm ----

@pytest.mark.parametrize("plant", [None, "first", "last"])
@pytest.mark.parametrize("dtype", DTYPES, ids=name)
def test_unscale_check(dtype, plant):
    grads = [copy_at(finite(n, dtype, i, 100.0), i % 8) for i, n in enumerate(SIZES)]
    if plant:
        big = [g for g in grads if g.numel() > 0]
        t = big[0] if plant == "first" else big[-1]
        t[0 if plant == "first" else -1] = math.inf if dtype != f32 else math.nan
    found = both_ways(lambda g, f, s: torch.ops.ampc.unscale_check(g, f, s),
                      [grads, torch.zeros(1), torch.tensor([1 / 1024 * 1.37])],
                      f"unscale_check {name(dtype)}")[1]
    assert float(found) == (1.0 if plant else 0.0)


@pytest.mark.parametrize("dtype", DTYPES, ids=name)
def test_unscale_check_found_inf_is_sticky(dtype):
    found = both_ways(lambda g, f, s: torch.ops.ampc.unscale_check(g, f, s),
                      [[finite(9000, dtype, 1)], torch.ones(1), torch.tensor([0.5])], "sticky")[1]
    assert float(found) == 1.0


def test_unscale_check_mixed_dtypes_in_one_list():
    grads = [copy_at(finite(100 + 37 * i, DTYPES[i % 3], i, 10.0), i % 4) for i in range(12)]
    grads[-1][-1] = math.nan
    found = both_ways(lambda g, f, s: torch.ops.ampc.unscale_check(g, f, s),
                      [grads, torch.zeros(1), torch.tensor([0.125])], "mixed unscale_check")[1]
    assert float(found) == 1.0


def run_norm(grads, inv=-1 / 512):
    found, inv_scale = torch.zeros(1), torch.tensor([inv])
    norm = torch.ops.ampc.check_norm(grads, found, inv_scale)
    return norm, found


def f64_norm(grads, inv):
    return abs(inv) * math.sqrt(sum(float((g.double() ** 2).sum()) for g in grads))


def assert_norm_both_ways(grads):
    """check_norm emulated leaves the grads as they are and agrees with the CPU path and a
    float64 reference."""
    want, want_found = run_norm(copy(grads))
    before = copy(grads)
    with emulated():
        got, found = run_norm(grads)
    for g, b in zip(grads, before):
        assert_bits(g, b, "check_norm wrote a grad")
    assert float(found) == float(want_found) == 0.0
    ref = f64_norm(grads, 1 / 512)
    assert math.isclose(float(got), ref, rel_tol=1e-6), (float(got), ref)
    assert math.isclose(float(got), float(want), rel_tol=1e-6), (float(got), float(want))


@pytest.mark.parametrize("huge", [False, True], ids=["fp32 squares", "fp64 squares"])
@pytest.mark.parametrize("dtype", DTYPES, ids=name)
def test_check_norm_across_blocks(dtype, huge):
    """Many blocks, every block's partial sum, the finishing block; values past 2^58 take
    the double re-read of the threads that met them."""
    grads = [copy_at(finite(n, dtype, i), i % 8) for i, n in enumerate(SIZES)]
    if huge and dtype != f16:
        grads[12][5] = 2.0**100
    assert_norm_both_ways(grads)


def test_check_norm_mixed_dtypes_in_one_list():
    """Grads of three dtypes: a norm per dtype group into a scratch tensor on the device,
    then the norm of those, still on the device."""
    assert_norm_both_ways([copy_at(finite(n, DTYPES[i % 3], i), i % 8)
                           for i, n in enumerate(SIZES)])


@pytest.mark.parametrize("where", ["first", "last"])
def test_check_norm_finds_inf(where):
    grads = [finite(n, bf16, i) for i, n in enumerate([70000, 3, 9000])]
    grads[0 if where == "first" else 2][-1] = math.inf
    with emulated():
        norm, found = run_norm(grads)
    assert float(found) == 1.0 and math.isinf(float(norm))


def test_check_norm_empty_list():
    for grads in ([], [at(0, f32), at(0, f32)]):
        with emulated():
            norm, found = run_norm(grads)
        assert float(norm) == 0.0 and float(found) == 0.0


def test_check_norm_same_bits_in_every_thread_order():
    grads = [finite(n, f32, i) for i, n in enumerate(SIZES)]
    first = _emu.ampc_emu_order()
    norms = []
    try:
        for order in (0, 1, 2):
            _emu.ampc_emu_set_order(order, 99)
            with emulated():
                norms.append(run_norm(grads)[0])
    finally:
        _emu.ampc_emu_set_order(first, 1)
    assert_bits(norms[1], norms[0], "reversed order")
    assert_bits(norms[2], norms[0], "shuffled order")


# ---- update_scale ----

@pytest.mark.parametrize("hysteresis,min_scale,max_scale", [(1, 0.0, math.inf), (3, 0.0, math.inf),
                                                            (2, 1.0, 4096.0)])
def test_update_scale_with_hysteresis(hysteresis, min_scale, max_scale):
    pattern = [0, 1, 0, 0, 1, 1, 1, 0, 0, 0, 0, 0, 1, 0, 1, 1, 0, 0, 0, 0, 0, 0, 0]
    state = [torch.full((1,), 1024.0), torch.zeros(1, dtype=torch.int32),
             torch.full((1,), hysteresis, dtype=torch.int32)]
    for k, bad in enumerate(pattern):
        state = both_ways(
            lambda s, g, h, f: torch.ops.ampc.update_scale(s, g, h, f, 2.0, 0.5, 3, hysteresis,
                                                           min_scale, max_scale),
            state + [torch.full((1,), float(bad))], f"update_scale step {k}")[:3]


# ---- Adam ----

def adam_inputs(sizes, pdtype, gdtype, master, amsgrad, seed=0, offsets=(0,) * 7):
    params = [copy_at(finite(n, f32, seed + i).to(pdtype), offsets[0]) for i, n in enumerate(sizes)]
    grads = [copy_at(finite(n, f32, seed + 50 + i, 0.1).to(gdtype), offsets[1])
             for i, n in enumerate(sizes)]
    masters = [copy_at(p.float(), offsets[2]) for p in params] if master else []
    m = [copy_at(finite(n, f32, seed + 100 + i, 0.01), offsets[3]) for i, n in enumerate(sizes)]
    v = [copy_at(finite(n, f32, seed + 200 + i, 0.01).abs(), offsets[4])
         for i, n in enumerate(sizes)]
    vmax = [copy_at(x * 1.5, offsets[5]) for x in v] if amsgrad else []
    steps = [torch.full((1,), float(3 + i % 5)) for i in range(len(sizes))]
    return [params, grads, masters, m, v, vmax, steps]


def adam_op(lr_t=None, inv=None, clip=None, found=None, decoupled=True, maximize=False,
            stochastic=False, wd=0.01, betas=(0.9, 0.999)):
    opt = lambda t: [] if t is None else [torch.tensor([t], dtype=f32)]
    return lambda *lists: torch.ops.ampc.adam_master(
        *lists, opt(lr_t), opt(inv), opt(clip), opt(found), 1e-3, betas[0], betas[1], 1e-8, wd,
        decoupled, maximize, stochastic, 1234)


ADAM_SIZES = [0, 1, 7, 8, 9, 17, 255, 2048 + 3, 4096, 4097, 9000, 3]
FLAGS = list(itertools.product([False, True], repeat=5))


@pytest.mark.parametrize("master,amsgrad,decoupled,maximize,stochastic", FLAGS,
                         ids=lambda f: "TF"[f])
def test_adam_master_every_flag(master, amsgrad, decoupled, maximize, stochastic):
    k = FLAGS.index((master, amsgrad, decoupled, maximize, stochastic))
    pdtype, gdtype = list(itertools.product(DTYPES, DTYPES))[k % 9]
    if master and pdtype == f32:
        pdtype = bf16
    lists = adam_inputs(ADAM_SIZES, pdtype, gdtype, master, amsgrad, seed=k)
    both_ways(adam_op(decoupled=decoupled, maximize=maximize, stochastic=stochastic), lists,
              f"adam {name(pdtype)}/{name(gdtype)} flags {k}")


@pytest.mark.parametrize("pdtype,gdtype", list(itertools.product(DTYPES, DTYPES)), ids=name)
def test_adam_master_every_dtype_pair(pdtype, gdtype):
    lists = adam_inputs(ADAM_SIZES, pdtype, gdtype, pdtype != f32, True, seed=3)
    both_ways(adam_op(stochastic=True), lists, f"adam {name(pdtype)}/{name(gdtype)}")


@pytest.mark.parametrize("controls", [(0.01, None, None, 0.0), (None, 1 / 1024, 0.5, 0.0),
                                      (0.02, 0.25, 0.9, None), (None, None, None, 1.0),
                                      (0.01, 1.0, 1.0, math.inf)], ids=str)
def test_adam_master_control_tensors(controls):
    lists = adam_inputs(ADAM_SIZES, bf16, bf16, True, False, seed=5)
    out = both_ways(adam_op(*controls), lists, f"adam controls {controls}")
    if controls[3]:         # found_inf set: nothing moved, steps included
        for a, b in zip(out, lists):
            for x, y in zip(a, b):
                assert_bits(x, y, "adam skipped")


@pytest.mark.parametrize("shifted", range(7))
def test_adam_master_misaligned_lists(shifted):
    offsets = [0] * 7
    offsets[shifted] = 3
    lists = adam_inputs(ADAM_SIZES, bf16, f16, True, True, seed=6, offsets=offsets)
    both_ways(adam_op(stochastic=True), lists, f"adam list {shifted} misaligned")


@pytest.mark.parametrize("amsgrad,stochastic", [(False, False), (True, True)])
def test_adam_packed(amsgrad, stochastic):
    sizes = [1, 7, 9, 0, 4097, 65537, 33, 2 * 4096]
    def params():
        g = torch.Generator().manual_seed(0)
        return [torch.nn.Parameter(torch.randn(n, generator=g).to(DTYPES[i % 3]))
                for i, n in enumerate(sizes)]
    cpu, emu = params(), params()
    opts = [ampc.optim.AdamW(ps, lr=1e-2, amsgrad=amsgrad, stochastic_rounding=stochastic, seed=5)
            for ps in (cpu, emu)]
    optimizers_both_ways(opts, cpu, emu)
    for q in emu:
        assert opts[1].state[q]["exp_avg"]._base is not None       # the packed path


def optimizers_both_ways(opts, cpu, emu, steps=3):
    """opts[0] steps the params `cpu` on the CPU, opts[1] the params `emu` through the
    emulated kernels, on the same grads; params and every state tensor end bit-equal."""
    for k in range(steps):
        g = torch.Generator().manual_seed(100 + k)
        for p, q in zip(cpu, emu):
            grad = torch.randn(p.shape, generator=g).to(p.dtype)
            p.grad, q.grad = grad, grad.clone()
        opts[0].step()
        launched = _emu.ampc_emu_launch_count()
        with emulated():
            opts[1].step()
        assert _emu.ampc_emu_launch_count() > launched, "no emulated launch ran"
    for i, (p, q) in enumerate(zip(cpu, emu)):
        assert_bits(q.detach(), p.detach(), f"param {i}")
        for key, t in opts[0].state[p].items():
            assert_bits(opts[1].state[q][key], t, f"'{key}' of param {i}")


# ---- fp8 ----

def cast_fp8_op(dst, src, scale, amax):
    torch.ops.ampc.cast_fp8(dst, src, scale, amax)


@pytest.mark.parametrize("fmt", FP8, ids=name)
@pytest.mark.parametrize("wide", DTYPES, ids=name)
def test_cast_fp8_and_back(wide, fmt):
    src = [values(n, wide, i) for i, n in enumerate(SIZES)]
    for s in src[1:3]:
        s[0] = math.nan if s.numel() else 0
    scale = torch.tensor([2.0 ** (i % 7 - 3) for i in range(len(SIZES))])
    scale[4] = math.nan
    amax = torch.full((len(SIZES),), -1.0)
    out = both_ways(cast_fp8_op, [[at(n, fmt) for n in SIZES], src, scale, amax],
                    f"cast_fp8 {name(wide)}->{name(fmt)}")
    both_ways(lambda d, s, si: torch.ops.ampc.cast_from_fp8(d, s, si),
              [[at(n, wide) for n in SIZES], out[0], 1 / scale], f"cast_from_fp8 {name(fmt)}")
    both_ways(lambda s, a: torch.ops.ampc.fp8_amax(s, a), [src, amax], f"fp8_amax {name(wide)}")


@pytest.mark.parametrize("wide", DTYPES, ids=name)
def test_fp8_every_misalignment_pair(wide):
    pairs = list(itertools.product(misalignments(wide), range(16)))
    n = 200
    src = [copy_at(values(n, wide, i), a) for i, (a, _) in enumerate(pairs)]
    scale = torch.full((len(pairs),), 0.5)
    dst = [at(n, e4m3, b) for _, b in pairs]
    q = both_ways(cast_fp8_op, [dst, src, scale, torch.empty(len(pairs))], "cast_fp8 misaligned")[0]
    back = [at(n, wide, a) for a, _ in pairs]
    both_ways(lambda d, s, si: torch.ops.ampc.cast_from_fp8(d, s, si), [back, q, 1 / scale],
              "cast_from_fp8 misaligned")


def test_fp8_mixed_dtypes_in_one_list():
    src = [values(300 + i, DTYPES[i % 3], i) for i in range(9)]
    dst = [at(300 + i, FP8[i % 2], i % 3) for i in range(9)]
    both_ways(cast_fp8_op, [dst, src, torch.full((9,), 4.0), torch.empty(9)], "mixed cast_fp8")


@pytest.mark.parametrize("rows,most_recent", [(16, False), (1, True), (1024, False)])
def test_fp8_update_scales(rows, most_recent):
    n = 700                 # three blocks of 256, the last partly used
    g = torch.Generator().manual_seed(rows)
    hist = torch.rand(rows, n, generator=g) * 100
    amax = torch.rand(n, generator=g) * 50
    amax[::7] = 0.0
    amax[3] = math.nan
    amax[5] = math.inf
    scale, scale_inv = torch.rand(n, generator=g) + 0.5, torch.empty(n)
    both_ways(lambda h, s, si, a: torch.ops.ampc.fp8_update_scales(h, s, si, a, 448.0, 1.0,
                                                                   most_recent),
              [hist, scale, scale_inv, amax], f"fp8_update_scales rows {rows}")


# ---- launch tables: counts, every launch, an inf in the last one ----

def two_list_launches(count):
    small = CAP2[False]
    return 1 if count <= small else math.ceil(count / CAP2[LARGE])


COUNTS = [1, 105, 106, 107, 426, 427, 428, 901, 902, 903, 2000]


@pytest.mark.parametrize("count", COUNTS)
def test_cast_launches_and_every_launch_matches(count):
    sizes = [1 + (i * 7) % 23 for i in range(count)]
    sizes[count // 2] = 0
    src = [values(n, f32, i) for i, n in enumerate(sizes)]
    _emu.ampc_emu_clear_launches()
    both_ways(cast_op(True), [[at(n, bf16) for n in sizes], src], f"cast of {count} tensors")
    got = launches()
    filled = count - 1      # the empty tensor takes no slot and no block
    assert [l[0] for l in got] == ["cast_launch"] * (two_list_launches(filled) if filled else 0)
    assert sum(l[1] for l in got) == filled
    assert all(l[3] <= (32764 if LARGE else 4096) for l in got)


@pytest.mark.parametrize("count", COUNTS)
def test_unscale_inf_in_the_last_launch(count):
    grads = [finite(3 + i % 5, f16, i) for i in range(count)]
    grads[-1][-1] = math.inf
    _emu.ampc_emu_clear_launches()
    found = both_ways(lambda g, f, s: torch.ops.ampc.unscale_check(g, f, s),
                      [grads, torch.zeros(1), torch.tensor([0.5])], f"unscale {count}")[1]
    assert float(found) == 1.0
    assert len(launches()) == two_list_launches(count)


@pytest.mark.parametrize("count", [1, 107, 903])
def test_check_norm_inf_in_the_last_launch(count):
    grads = [finite(2 + i % 3, f32, i) for i in range(count)]
    want = f64_norm(grads, 1.0)
    with emulated():
        norm, found = run_norm(grads, 1.0)
    assert float(found) == 0.0 and math.isclose(float(norm), want, rel_tol=1e-6)
    grads[-1][0] = math.nan
    _emu.ampc_emu_clear_launches()
    with emulated():
        norm, found = run_norm(grads, 1.0)
    assert float(found) == 1.0
    # the norm blocks' launches, then the finishing block
    assert [l[0] for l in launches()] == ["mt_launch2_fn"] * two_list_launches(count) + \
        ["check_norm_apply"]


@pytest.mark.parametrize("count", [1, 49, 50, 51, 426, 427, 428, 2000])
def test_adam_launches_and_every_launch_matches(count):
    sizes = [1 + i % 9 for i in range(count)]
    lists = adam_inputs(sizes, bf16, bf16, True, False, seed=count)
    _emu.ampc_emu_clear_launches()
    both_ways(adam_op(stochastic=True), lists, f"adam of {count}")
    got = [l[0] for l in launches()]
    large = count > CAP_ADAM[False] and LARGE
    n = math.ceil(count / CAP_ADAM[large])
    # then the step counts, as many a launch as the parameter space holds: (P - 16) / 8 - 1
    steps = math.ceil(count / (4093 if large else 509))
    assert got == ["adam_launch"] * n + ["advance_steps"] * steps, got


@pytest.mark.parametrize("count", [51, 428])
def test_adam_found_inf_skips_every_launch(count):
    lists = adam_inputs([1 + i % 9 for i in range(count)], bf16, bf16, True, True, seed=2)
    out = both_ways(adam_op(found=1.0), lists, "adam skipped")
    for a, b in zip(out, lists):
        for x, y in zip(a, b):
            assert_bits(x, y, "adam with found_inf moved")


@pytest.mark.parametrize("count", [1, 72, 73, 74, 481, 1000])
def test_fp8_launches_and_inf_in_the_last_launch(count):
    src = [finite(1 + i % 11, bf16, i) for i in range(count)]
    src[-1][-1] = math.inf
    amax = torch.empty(count)
    _emu.ampc_emu_clear_launches()
    out = both_ways(cast_fp8_op, [[at(s.numel(), e5m2) for s in src], src, torch.ones(count), amax],
                    f"cast_fp8 of {count}")
    assert math.isinf(float(out[3][-1]))
    got = [l[0] for l in launches()]
    assert got == (["zero_values"] * math.ceil(count / 480) +
                   ["fp8_launch_fn"] * math.ceil(count / CAP_FP8))


def test_launch_figures_are_the_readmes():
    """902 tensors a launch (Adam 427); 4 KB: 106 (Adam 50): from the launches themselves."""
    for count, per, site in ((2000, CAP2, "cast_launch"), (1000, CAP_ADAM, "adam_launch")):
        if site == "cast_launch":
            src = [at(1, f32) for _ in range(count)]
            dst = [at(1, f16) for _ in range(count)]
            call = lambda: torch.ops.ampc.cast(dst, src, [], False, 0)
        else:
            lists = adam_inputs([1] * count, f32, f32, False, False)
            call = lambda: adam_op()(*lists)
        _emu.ampc_emu_clear_launches()
        _emu.ampc_emu_set_execute(0)
        try:
            with emulated():
                call()
        finally:
            _emu.ampc_emu_set_execute(1)
        grids = [l[1] for l in launches() if l[0] == site]
        cap = per[LARGE]
        assert grids == [cap] * (count // cap) + [count % cap] * (count % cap > 0), (site, grids)


# ---- chunk per call ----

@pytest.mark.parametrize("numel", [1, 4096, 10**5, 2 * 10**6, 2**21 + 1, 5 * 10**6, 10**7,
                                   3 * 10**7, 10**8])
def test_chunk_per_call(numel):
    """The chunk is the largest power of two from 4,096 to 65,536 that still gives 4
    blocks an SM of this device; the plan is checked and recorded, no thread runs."""
    want = numel // (4 * SMS)
    chunk = min(65536, max(4096, 1 << (want.bit_length() - 1) if want else 0))
    g = torch.empty(numel, dtype=f16)
    _emu.ampc_emu_clear_launches()
    _emu.ampc_emu_set_execute(0)
    try:
        with emulated():
            torch.ops.ampc.unscale_check([g], torch.zeros(1), torch.ones(1))
    finally:
        _emu.ampc_emu_set_execute(1)
    assert [l[1] for l in launches()] == [math.ceil(numel / chunk)]


def test_chunk_follows_the_whole_list():
    sizes = [10**6, 3 * 10**6, 5]
    chunk = 1 << ((sum(sizes) // (4 * SMS)).bit_length() - 1)
    _emu.ampc_emu_clear_launches()
    _emu.ampc_emu_set_execute(0)
    try:
        with emulated():
            torch.ops.ampc.unscale_check([torch.empty(n, dtype=bf16) for n in sizes],
                                         torch.zeros(1), torch.ones(1))
    finally:
        _emu.ampc_emu_set_execute(1)
    assert [l[1] for l in launches()] == [sum(math.ceil(n / chunk) for n in sizes)]


# ---- adam_lean ----

LEAN_SIZES = [0, 1, 7, 255, 256, 257, 2048 + 3, 9000, 3]


def lean_inputs(weights, moments, seed=0):
    """adam_lean's tensor lists: weights "fp32", "master", "sr", "kahan" or "rne" (bf16
    params), "sr16" or "master16" (fp16 params, written stochastically); moments fp32, bf16
    or uint8 (8-bit codes: random codes and positive scales)."""
    sizes = LEAN_SIZES
    g = torch.Generator().manual_seed(seed)
    w = [finite(n, f32, seed + i) for i, n in enumerate(sizes)]
    pdtype = f32 if weights == "fp32" else f16 if weights.endswith("16") else bf16
    params = [x.to(pdtype) for x in w]
    grads = [finite(n, f32, seed + 50 + i, 0.1).to(bf16) for i, n in enumerate(sizes)]
    masters = [x.clone() for x in w] if weights.startswith("master") else []
    comps = [(x - x.to(bf16).float()).to(bf16) for x in w] if weights == "kahan" else []
    if moments == torch.uint8:
        m = [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g) for n in sizes]
        v = [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g) for n in sizes]
        scales = [[torch.rand(-(-n // 256), generator=g) * 0.01 for n in sizes]
                  for _ in range(2)]
    else:
        m = [finite(n, f32, seed + 100 + i, 0.01).to(moments) for i, n in enumerate(sizes)]
        v = [finite(n, f32, seed + 200 + i, 0.01).abs().to(moments) for i, n in enumerate(sizes)]
        scales = [[], []]
    steps = [torch.full((1,), float(3 + i % 5)) for i in range(len(sizes))]
    return [params, grads, masters, comps, m, v, scales[0], scales[1], steps]


def lean_op(weights, found=None):
    opt = lambda t: [] if t is None else [torch.tensor([t], dtype=f32)]  # noqa: E731
    return lambda *lists: torch.ops.ampc.adam_lean(
        *lists, [], opt(0.5), opt(0.9), opt(found), 1e-3, 0.9, 0.999, 1e-8, 0.01, True, False,
        weights in ("sr", "sr16", "master16"), 1234)


# fp16 params written stochastically: the CPU rounds them in cast.c's loop after the step,
# CUDA in the step; both through cast.h's ampc_f16_sr_value
@pytest.mark.parametrize("moments", [f32, bf16, torch.uint8], ids=name)
@pytest.mark.parametrize("weights", ["fp32", "master", "sr", "kahan", "rne", "sr16", "master16"])
def test_adam_lean_every_layout(weights, moments):
    both_ways(lean_op(weights), lean_inputs(weights, moments, seed=11),
              f"adam_lean {weights}/{name(moments)}")


def test_adam_lean_found_inf_skips():
    inputs = lean_inputs("sr", torch.uint8, seed=12)
    before = copy(inputs)
    out = both_ways(lean_op("sr", found=1.0), inputs, "adam_lean skipped")
    for k, (a, b) in enumerate(zip(out, before)):
        for x, y in zip(a, b):
            assert_bits(x, y, f"adam_lean skipped: argument {k}")


@pytest.mark.parametrize("count", [1, 41, 42, 353, 354, 1000])
def test_adam_lean_launches_and_every_launch_matches(count):
    """All tensors in the multi-tensor walk's launches (not one a tensor), each bit-equal
    to the CPU; sizes around the 256-element block of the 8-bit moments."""
    sizes = [[1, 255, 256, 257, 600][i % 5] for i in range(count)]
    g = torch.Generator().manual_seed(count)
    params = [finite(n, f32, i).to(bf16) for i, n in enumerate(sizes)]
    grads = [finite(n, f32, 5000 + i, 0.1).to(bf16) for i, n in enumerate(sizes)]
    m = [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g) for n in sizes]
    v = [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g) for n in sizes]
    scales = [[torch.rand(-(-n // 256), generator=g) * 0.01 for n in sizes] for _ in range(2)]
    steps = [torch.full((1,), float(1 + i % 4)) for i in range(count)]
    _emu.ampc_emu_clear_launches()
    both_ways(lean_op("sr"), [params, grads, [], [], m, v, scales[0], scales[1], steps],
              f"adam_lean of {count}")
    got = [l[0] for l in launches()]
    large = count > CAP_LEAN[False] and LARGE
    n = math.ceil(count / CAP_LEAN[large])
    steps_launches = math.ceil(count / (4093 if large else 509))
    assert got == ["lean_launch"] * n + ["advance_steps"] * steps_launches, got


@pytest.mark.parametrize("stochastic", [False, True])
def test_adam_lean_packed(stochastic):
    """The lean optimizer's packed path (small params, 8-bit and fp32 moments): the
    emulated kernels on the pack's pointers give the CPU's bits."""
    shapes = [(64, 64), (17,), (300, 20), (1,), (5, 1000), (0,), (33,)]

    def params():
        g = torch.Generator().manual_seed(0)
        return [torch.nn.Parameter(torch.randn(s, generator=g).to(bf16)) for s in shapes]

    cpu, emu = params(), params()
    opts = [ampc.optim.AdamW(ps, lr=1e-2, state="lean", stochastic_rounding=stochastic, seed=5)
            for ps in (cpu, emu)]
    optimizers_both_ways(opts, cpu, emu)
    for q in emu:
        assert opts[1].state[q]["step"]._base is not None       # the packed path


# ---- encode_q8, decode_q8 ----

CAP_Q8 = {True: 738, False: 86}     # 3 lists


@pytest.mark.parametrize("dtype", DTYPES, ids=name)
@pytest.mark.parametrize("count", [1, 86, 87, 739])
def test_q8_codes_and_values_match(dtype, count):
    sizes = [[3000, 1, 255, 256, 257][i % 5] for i in range(count)]
    src = [finite(n, dtype, i) for i, n in enumerate(sizes)]
    if count == 1:
        src[0][300] = math.inf          # a block of nan values
    codes = [torch.empty(n, dtype=torch.uint8) for n in sizes]
    scales = [torch.empty(-(-n // 256)) for n in sizes]
    _emu.ampc_emu_clear_launches()
    both_ways(lambda c, s, x: torch.ops.ampc.encode_q8(c, s, x), [codes, scales, src],
              f"encode_q8 {name(dtype)} x{count}")
    large = count > CAP_Q8[False] and LARGE
    assert [l[0] for l in launches()] == ["q8_launch"] * math.ceil(count / CAP_Q8[large])
    torch.ops.ampc.encode_q8(codes, scales, src)
    dst = [torch.empty(n, dtype=dtype) for n in sizes]
    both_ways(lambda d, c, s: torch.ops.ampc.decode_q8(d, c, s), [dst, codes, scales],
              f"decode_q8 {name(dtype)} x{count}")
