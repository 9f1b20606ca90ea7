"""CUDA path of ampc, checked against torch and against ampc's own CPU path.

Tolerances:
  cast          bit-exact against Tensor.to() and against the CPU path (NaNs compared by
                position), stochastic rounding included (same seed, same bits).
  unscale_check bit-exact against torch._amp_foreach_non_finite_check_and_unscale_ (fp32,
                fp16) and against a float64 reference (bf16, which torch's CUDA op lacks);
                found_inf exact, including "stays 1".
  check_norm    within 1e-5 relative of a float64 reference; grads left bit-identical.
  update_scale  bit-exact against torch._amp_update_scale_, step by step.
All tests need a GPU; the big-tensor test is also marked slow.
"""
import math

import pytest
import torch

import ampc

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
PAIRS = [(s, d) for s in DTYPES for d in DTYPES]
BITS = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}
CHUNK = 65536
# around the 8-element vector, the 4-vector-per-thread step and the 65536-element chunk
SIZES = [0, 1, 7, 8, 9, 15, 16, 17, 4095, 4096, 4097, CHUNK - 1, CHUNK, CHUNK + 1,
         3 * CHUNK + 5, 0]


def name(dtype):
    return str(dtype).replace("torch.", "")


def assert_bits(got, want, what):
    """Equal bit patterns, except that a NaN only has to meet a NaN."""
    want = want.to(got.device)
    assert got.dtype == want.dtype and got.shape == want.shape, what
    got_nan, want_nan = torch.isnan(got), torch.isnan(want)
    assert torch.equal(got_nan, want_nan), f"{what}: NaN positions differ"
    g = torch.where(got_nan, 0, got.view(BITS[got.dtype]))
    w = torch.where(want_nan, 0, want.view(BITS[want.dtype]))
    if not torch.equal(g, w):
        i = int((g != w).nonzero()[0, 0])
        raise AssertionError(f"{what}: first difference at [{i}] of {got.numel()}: "
                             f"got {got[i].item()!r} ({int(g[i]):#x}), "
                             f"want {want[i].item()!r} ({int(w[i]):#x})")


def special_f32():
    """fp32 values at the edges of fp16/bf16 rounding."""
    v = [0.0, -0.0, 1.0, -1.0, math.inf, -math.inf, math.nan, -math.nan,
         65504.0, 65519.99, 65520.0, -65520.0, 65536.0, 3.4e38, -3.4e38,
         2.0**-14, 2.0**-24, 2.0**-25, 3 * 2.0**-25, 2.0**-26, 2.0**-149, -(2.0**-149), 1e-40,
         1 + 2.0**-11, 1 + 3 * 2.0**-11, 1 + 2.0**-8, 1 + 3 * 2.0**-8, 1 + 2.0**-8 + 2.0**-20,
         2.0**127 * (2 - 2.0**-8), 2.0**127 * (2 - 2.0**-9), 2.0**-126, 2.0**-133]
    return torch.tensor(v, dtype=torch.float32)


def make_values(n, dtype, seed):
    """n values of `dtype` covering every class: random bit patterns (NaN, inf, subnormal
    included), ordinary magnitudes, and fp32 values on and next to rounding ties."""
    gen = torch.Generator().manual_seed(seed)
    if dtype != torch.float32:
        return torch.randint(-(2**15), 2**15, (n,), dtype=torch.int16, generator=gen).view(dtype)
    bits = torch.randint(-(2**31), 2**31, (n,), dtype=torch.int32, generator=gen)
    kind = torch.randint(0, 4, (n,), generator=gen)
    # kind 1: a bf16 tie (+-1), kind 2: an fp16 tie (+-1) (low 16 or 13 bits at the midpoint)
    step = torch.randint(-1, 2, (n,), dtype=torch.int32, generator=gen)
    bf16_tie = (bits & ~0xFFFF) | (0x8000 + step)
    f16_tie = (bits & ~0x1FFF) | (0x1000 + step)
    bits = torch.where(kind == 1, bf16_tie, torch.where(kind == 2, f16_tie, bits))
    out = bits.view(torch.float32).clone()
    exponent = torch.randint(-30, 30, (n,), generator=gen).float()
    normal = torch.randn(n, generator=gen) * torch.exp2(exponent)
    out = torch.where(kind == 3, normal, out)
    k = min(n, special_f32().numel())
    out[:k] = special_f32()[:k]
    return out


def cuda_list(sizes, dtype, seed, offsets=None):
    """Tensors on the GPU; offsets[i] > 0 makes tensor i a view that starts offsets[i]
    elements into its storage, which breaks 16-byte alignment."""
    out = []
    for i, n in enumerate(sizes):
        off = offsets[i] if offsets else 0
        base = torch.empty(n + off, dtype=dtype, device="cuda")
        t = base[off:]
        t.copy_(make_values(n, dtype, seed + i))
        out.append(t)
    return out


def f64_norm(grads, inv_scale):
    s = sum(float((g.double() ** 2).sum()) for g in grads)
    return abs(float(inv_scale)) * math.sqrt(s)


# ---- cast ----

@pytest.mark.parametrize("src_dtype,dst_dtype", PAIRS, ids=lambda d: name(d))
def test_cast_sizes_cuda(src_dtype, dst_dtype):
    src = cuda_list(SIZES, src_dtype, seed=1)
    out = ampc.ops.cast(src, dst_dtype)
    cpu = ampc.ops.cast([s.cpu() for s in src], dst_dtype)
    assert len(out) == len(src)
    for i, (s, o, c) in enumerate(zip(src, out, cpu)):
        what = f"cast {name(src_dtype)}->{name(dst_dtype)} tensor {i} numel {s.numel()}"
        assert o.device == s.device, what
        assert_bits(o, s.to(dst_dtype), what + " vs Tensor.to")
        assert_bits(o, c, what + " vs CPU path")


@pytest.mark.parametrize("src_dtype,dst_dtype", PAIRS, ids=lambda d: name(d))
def test_cast_misaligned_cuda(src_dtype, dst_dtype):
    sizes = [CHUNK + 9, 17, 2 * CHUNK + 3, 8, 1000]
    src = cuda_list(sizes, src_dtype, seed=2, offsets=[1, 0, 3, 1, 0])
    # every mix of aligned and misaligned source and destination
    dst = [torch.empty(n + off, dtype=dst_dtype, device="cuda")[off:]
           for n, off in zip(sizes, [0, 1, 3, 1, 5])]
    ampc.ops.cast_(dst, src)
    for i, (s, d) in enumerate(zip(src, dst)):
        assert_bits(d, s.to(dst_dtype), f"cast_ {name(src_dtype)}->{name(dst_dtype)} tensor {i}")


@pytest.mark.parametrize("src_dtype", [torch.float16, torch.bfloat16], ids=name)
def test_cast_every_16bit_pattern_cuda(src_dtype):
    src = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(src_dtype).cuda()
    for dst_dtype in DTYPES:
        (out,) = ampc.ops.cast([src], dst_dtype)
        assert_bits(out, src.to(dst_dtype), f"all {name(src_dtype)} -> {name(dst_dtype)}")


def test_cast_many_tensors_cuda():
    gen = torch.Generator().manual_seed(3)
    sizes = [0 if int(torch.randint(0, 5, (1,), generator=gen)) == 0
             else int(torch.randint(1, 3000, (1,), generator=gen)) for _ in range(1000)]
    sizes += [CHUNK + 1, 0]
    for src_dtype, dst_dtype in [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32),
                                 (torch.float32, torch.float16), (torch.float16, torch.float16)]:
        src = cuda_list(sizes, src_dtype, seed=4)
        out = ampc.ops.cast(src, dst_dtype)
        for i, (s, o) in enumerate(zip(src, out)):
            assert_bits(o, s.to(dst_dtype), f"{name(src_dtype)}->{name(dst_dtype)} tensor {i}")
    src = cuda_list(sizes, torch.float32, seed=5)
    out = ampc.ops.cast(src, torch.bfloat16, stochastic=True, seed=77)
    cpu = ampc.ops.cast([s.cpu() for s in src], torch.bfloat16, stochastic=True, seed=77)
    for i, (o, c) in enumerate(zip(out, cpu)):
        assert_bits(o, c, f"stochastic fp32->bf16 tensor {i}")


def test_cast_zero_numel_list_cuda():
    zeros = [torch.empty(0, device="cuda") for _ in range(3)]
    out = ampc.ops.cast(zeros, torch.float16)
    assert [o.numel() for o in out] == [0, 0, 0]
    assert all(o.dtype == torch.float16 and o.is_cuda for o in out)


def test_cast_raw_op_cuda():
    src = cuda_list([100, 0, CHUNK + 3], torch.float32, seed=5)
    dst = [torch.empty_like(s, dtype=torch.bfloat16) for s in src]
    torch.ops.ampc.cast(dst, src, [], False, 0)
    for s, d in zip(src, dst):
        assert_bits(d, s.to(torch.bfloat16), "raw cast")


# ---- stochastic rounding ----

SR_PAIRS = [(torch.float32, torch.float16), (torch.float32, torch.bfloat16),
            (torch.bfloat16, torch.float16), (torch.float16, torch.bfloat16),
            (torch.float16, torch.float32), (torch.bfloat16, torch.bfloat16)]


@pytest.mark.parametrize("src_dtype,dst_dtype", SR_PAIRS, ids=lambda d: name(d))
def test_cast_stochastic_matches_cpu_cuda(src_dtype, dst_dtype):
    # element k of the list draws ampc_random_bits(seed, k): misaligned views, chunk
    # boundaries and zero-numel tensors must not shift k
    sizes = [CHUNK + 9, 0, 17, 2 * CHUNK + 3, 1, 0]
    src = cuda_list(sizes, src_dtype, seed=6, offsets=[1, 0, 0, 2, 0, 0])
    for seed in [0, 12345, 2**40 + 7]:      # the last one has high 32 bits set
        out = ampc.ops.cast(src, dst_dtype, stochastic=True, seed=seed)
        cpu = ampc.ops.cast([s.cpu() for s in src], dst_dtype, stochastic=True, seed=seed)
        for i, (o, c) in enumerate(zip(out, cpu)):
            assert_bits(o, c, f"stochastic {name(src_dtype)}->{name(dst_dtype)} seed {seed} "
                              f"tensor {i}")


@pytest.mark.parametrize("dst_dtype", [torch.float16, torch.bfloat16], ids=name)
def test_cast_stochastic_is_unbiased_cuda(dst_dtype):
    ulp = {torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7}[dst_dtype]     # at 1.0
    n = 1 << 20
    x = torch.full((n,), 1.0 + 0.25 * ulp, device="cuda")
    (a,) = ampc.ops.cast([x], dst_dtype, stochastic=True, seed=1)
    (b,) = ampc.ops.cast([x], dst_dtype, stochastic=True, seed=2)
    up = (a.float() != 1.0).float().mean().item()
    assert set(a.float().unique().tolist()) <= {1.0, 1.0 + ulp}
    assert abs(up - 0.25) < 0.005, f"rounded up {up:.4f} of the time, want 0.25"
    assert not torch.equal(a, b), "the seed must change the draw"


# ---- unscale_check ----

def planted(sizes, dtype, seed, where, offsets=None):
    """Finite grads with an inf/nan at the first, middle or last element of the first or
    last non-empty tensor (where = None plants nothing)."""
    grads = cuda_list(sizes, dtype, seed, offsets)
    for g in grads:
        g.copy_(torch.randn(g.numel(), generator=torch.Generator().manual_seed(seed)).to(dtype))
        seed += 1
    if where is not None:
        tensor, pos = where
        full = [g for g in grads if g.numel() > 0]
        g = full[0] if tensor == "first" else full[-1]
        i = {"first": 0, "middle": g.numel() // 2, "last": g.numel() - 1}[pos]
        g[i] = math.nan if pos == "middle" else (-math.inf if tensor == "last" else math.inf)
    return grads


PLANTS = [None] + [(t, p) for t in ["first", "last"] for p in ["first", "middle", "last"]]
GRAD_SIZES = [CHUNK + 9, 0, 17, 3 * CHUNK + 5, 1, 8, 0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=name)
@pytest.mark.parametrize("where", PLANTS, ids=str)
def test_unscale_check_matches_torch_cuda(dtype, where):
    for offsets in [None, [1, 0, 3, 2, 0, 1, 0]]:
        grads = planted(GRAD_SIZES, dtype, 7, where, offsets)
        ref = [g.clone() for g in grads]
        inv_scale = torch.tensor([1.0 / 1024 * 1.37], device="cuda")
        found_inf = torch.zeros(1, device="cuda")
        ref_found = torch.zeros(1, device="cuda")
        ampc.ops.unscale_check(grads, found_inf, inv_scale)
        torch._amp_foreach_non_finite_check_and_unscale_(ref, ref_found, inv_scale)
        assert found_inf.item() == ref_found.item() == (0.0 if where is None else 1.0)
        for i, (g, r) in enumerate(zip(grads, ref)):
            assert_bits(g, r, f"unscale {name(dtype)} {where} offsets {offsets} tensor {i}")


@pytest.mark.parametrize("dtype", DTYPES, ids=name)
@pytest.mark.parametrize("where", [None, ("first", "first"), ("last", "last")], ids=str)
def test_unscale_check_f64_reference_and_cpu_cuda(dtype, where):
    grads = planted(GRAD_SIZES, dtype, 8, where, [1, 0, 3, 2, 0, 1, 0])
    inv = 1.0 / 3000.0
    # the product of a 16-bit value and an fp32 value is exact in float64, so rounding it
    # to fp32 and then to dtype is what one fp32 multiply and one rounding give
    ref = [(g.double() * float(torch.tensor(inv, dtype=torch.float32))).float().to(dtype)
           for g in grads]
    cpu = [g.cpu() for g in grads]
    inv_scale = torch.tensor([inv], device="cuda")
    found_inf = torch.zeros(1, device="cuda")
    cpu_found = torch.zeros(1)
    ampc.ops.unscale_check(grads, found_inf, inv_scale)
    ampc.ops.unscale_check(cpu, cpu_found, inv_scale.cpu())
    assert found_inf.item() == cpu_found.item() == (0.0 if where is None else 1.0)
    for i, (g, r, c) in enumerate(zip(grads, ref, cpu)):
        assert_bits(g, r, f"unscale {name(dtype)} tensor {i} vs float64")
        assert_bits(g, c, f"unscale {name(dtype)} tensor {i} vs CPU path")


@pytest.mark.parametrize("dtype", DTYPES, ids=name)
def test_unscale_check_found_inf_is_sticky_cuda(dtype):
    grads = planted([1000, CHUNK + 1], dtype, 9, None)
    want = [(g.float() * 0.5).to(dtype) for g in grads]
    found_inf = torch.ones(1, device="cuda")
    ampc.ops.unscale_check(grads, found_inf, torch.tensor([0.5], device="cuda"))
    assert found_inf.item() == 1.0
    for g, w in zip(grads, want):
        assert_bits(g, w, "unscale with found_inf preset")
    # inv_scale = 1 leaves the grads as they are
    before = [g.clone() for g in grads]
    found_inf.zero_()
    ampc.ops.unscale_check(grads, found_inf, torch.ones(1, device="cuda"))
    assert found_inf.item() == 0.0
    for g, b in zip(grads, before):
        assert_bits(g, b, "unscale by 1")


def test_unscale_check_empty_list_cuda():
    found_inf = torch.zeros(1, device="cuda")
    ampc.ops.unscale_check([], found_inf, torch.ones(1, device="cuda"))
    ampc.ops.unscale_check([torch.empty(0, device="cuda")], found_inf,
                           torch.ones(1, device="cuda"))
    assert found_inf.item() == 0.0


# ---- check_norm (unscale_check in check_only mode) ----

@pytest.mark.parametrize("dtype", DTYPES, ids=name)
@pytest.mark.parametrize("where", [None, ("first", "middle"), ("last", "last")], ids=str)
def test_check_norm_cuda(dtype, where):
    grads = planted(GRAD_SIZES + [5 * CHUNK + 77], dtype, 10, where,
                    [1, 0, 3, 2, 0, 1, 0, 0])
    before = [g.clone() for g in grads]
    inv_scale = torch.tensor([-1.0 / 512], device="cuda")   # |inv_scale| is what counts
    found_inf = torch.zeros(1, device="cuda")
    norm = ampc.ops.unscale_check(grads, found_inf, inv_scale, check_only=True)
    assert norm.dtype == torch.float32 and norm.dim() == 0 and norm.is_cuda
    for i, (g, b) in enumerate(zip(grads, before)):
        assert_bits(g, b, f"check_norm wrote to grads[{i}]")
    if where is not None:
        assert found_inf.item() == 1.0
        assert not math.isfinite(norm.item())
        return
    assert found_inf.item() == 0.0
    want = f64_norm(grads, inv_scale)
    assert abs(norm.item() - want) <= 1e-5 * want, f"norm {norm.item()!r} want {want!r}"
    # deterministic, and the same as the CPU path
    again = ampc.ops.unscale_check(grads, found_inf, inv_scale, check_only=True)
    assert again.item() == norm.item()
    cpu = ampc.ops.unscale_check([g.cpu() for g in grads], torch.zeros(1), inv_scale.cpu(),
                                 check_only=True)
    assert abs(cpu.item() - norm.item()) <= 2e-5 * want


def test_check_norm_empty_and_raw_op_cuda():
    for grads in [[], [torch.empty(0, device="cuda"), torch.empty(0, device="cuda")]]:
        for preset in [0.0, 1.0]:
            found_inf = torch.full((1,), preset, device="cuda")
            norm = ampc.ops.unscale_check(grads, found_inf, torch.full((1,), 2.0, device="cuda"),
                                          check_only=True)
            assert norm.item() == 0.0
            assert found_inf.item() == preset
    grads = planted([100, CHUNK + 5], torch.bfloat16, 11, None)
    found_inf = torch.zeros(1, device="cuda")
    norm = torch.ops.ampc.check_norm(grads, found_inf, torch.ones(1, device="cuda"))
    want = f64_norm(grads, 1.0)
    assert abs(norm.item() - want) <= 1e-5 * want


# ---- update_scale ----

def found_inf_sequence(n, seed):
    gen = torch.Generator().manual_seed(seed)
    r = torch.randint(0, 10, (n,), generator=gen)
    # mostly clean steps, so the scale also grows; 2.0 = found_inf summed over devices
    return torch.where(r == 0, 1.0, torch.where(r == 1, 2.0, 0.0)).cuda()


@pytest.mark.parametrize("start,growth,backoff,interval",
                         [(65536.0, 2.0, 0.5, 3), (2.0**120, 2.0**3, 0.25, 1),
                          (1.0, 1.0001, 0.999, 2), (3.0e38, 2.0, 0.5, 1)])
def test_update_scale_matches_torch_cuda(start, growth, backoff, interval):
    steps = 2000
    found = found_inf_sequence(steps, seed=int(start) % 1000 + interval)
    scale = torch.full((1,), start, device="cuda")
    tracker = torch.zeros(1, dtype=torch.int32, device="cuda")
    ref_scale, ref_tracker = scale.clone(), tracker.clone()
    got = torch.empty(steps, 2, dtype=torch.float64, device="cuda")
    want = torch.empty_like(got)
    for i in range(steps):
        f = found[i:i + 1]
        ampc.ops.update_scale(scale, tracker, f, growth, backoff, interval)
        torch._amp_update_scale_(ref_scale, ref_tracker, f, growth, backoff, interval)
        got[i, 0], got[i, 1] = scale[0], tracker[0]
        want[i, 0], want[i, 1] = ref_scale[0], ref_tracker[0]
    bad = (got != want).any(dim=1).nonzero()
    assert bad.numel() == 0, (f"step {int(bad[0, 0])}: got {got[bad[0, 0]].tolist()}, "
                              f"want {want[bad[0, 0]].tolist()}")


@pytest.mark.parametrize("hysteresis,min_scale,max_scale",
                         [(1, 0.0, math.inf), (2, 0.0, math.inf), (3, 1.0, 2.0**20),
                          (1, 2.0**10, 2.0**17)])
def test_update_scale_hysteresis_matches_cpu_cuda(hysteresis, min_scale, max_scale):
    found = found_inf_sequence(1000, seed=hysteresis)
    state = {}
    for dev in ["cuda", "cpu"]:
        scale = torch.full((1,), 2.0**16, device=dev)
        tracker = torch.zeros(1, dtype=torch.int32, device=dev)
        hyst = torch.full((1,), hysteresis, dtype=torch.int32, device=dev)
        hist = []
        for i in range(found.numel()):
            if dev == "cuda" and i % 2:     # the raw op and the wrapper must agree
                torch.ops.ampc.update_scale(scale, tracker, hyst, found[i:i + 1], 2.0, 0.5, 2,
                                            hysteresis, min_scale, max_scale)
            else:
                ampc.ops.update_scale(scale, tracker, found[i:i + 1].to(dev), 2.0, 0.5, 2,
                                      hysteresis=hysteresis, hysteresis_tracker=hyst,
                                      min_scale=min_scale, max_scale=max_scale)
            hist.append(torch.cat([scale.double(), tracker.double(), hyst.double()]))
        state[dev] = torch.stack(hist).cpu()
    assert torch.equal(state["cuda"], state["cpu"])
    assert state["cuda"][:, 0].min() >= min_scale and state["cuda"][:, 0].max() <= max_scale


# ---- graphs, syncs, devices ----

def test_graph_capture_unscale_and_update_cuda():
    sizes = [CHUNK + 3, 100, 0, 4096]
    grads = planted(sizes, torch.float16, 12, None)
    scale = torch.full((1,), 1024.0, device="cuda")
    tracker = torch.zeros(1, dtype=torch.int32, device="cuda")
    found_inf = torch.zeros(1, device="cuda")
    inv_scale = torch.ones(1, device="cuda")

    def step():
        found_inf.zero_()
        inv_scale.copy_(scale.double().reciprocal().float())
        ampc.ops.unscale_check(grads, found_inf, inv_scale)
        ampc.ops.update_scale(scale, tracker, found_inf, 2.0, 0.5, 2)

    side = torch.cuda.Stream()                      # warm up off the capture, as torch asks
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    scale.fill_(1024.0)
    tracker.zero_()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()

    ref_scale, ref_tracker = scale.clone(), tracker.clone()
    for i in range(8):
        fresh = planted(sizes, torch.float16, 100 + i, ("last", "middle") if i in (3, 4) else None)
        for g, f in zip(grads, fresh):
            g.copy_(f)
        ref, ref_found = [f.clone() for f in fresh], torch.zeros(1, device="cuda")
        ref_inv = ref_scale.double().reciprocal().float()
        torch._amp_foreach_non_finite_check_and_unscale_(ref, ref_found, ref_inv)
        torch._amp_update_scale_(ref_scale, ref_tracker, ref_found, 2.0, 0.5, 2)
        graph.replay()
        assert found_inf.item() == ref_found.item(), f"replay {i}"
        assert scale.item() == ref_scale.item() and tracker.item() == ref_tracker.item()
        for j, (g, r) in enumerate(zip(grads, ref)):
            assert_bits(g, r, f"replay {i} tensor {j}")


def test_graph_capture_check_norm_and_cast_cuda():
    # check_norm takes scratch memory from torch's allocator while capturing
    grads = planted([3 * CHUNK + 1, 10], torch.bfloat16, 13, None)
    found_inf = torch.zeros(1, device="cuda")
    inv_scale = torch.full((1,), 0.5, device="cuda")
    masters = cuda_list([3 * CHUNK + 1, 10], torch.float32, seed=14)
    params = [torch.empty_like(m, dtype=torch.bfloat16) for m in masters]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        ampc.ops.unscale_check(grads, found_inf, inv_scale, check_only=True)
        ampc.ops.cast_(params, masters)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        norm = ampc.ops.unscale_check(grads, found_inf, inv_scale, check_only=True)
        ampc.ops.cast_(params, masters, stochastic=True, seed=5)
    for i in range(3):
        for g in grads:
            g.copy_(torch.randn(g.numel(), generator=torch.Generator().manual_seed(i)))
        graph.replay()
        want = f64_norm(grads, 0.5)
        assert abs(norm.item() - want) <= 1e-5 * want, f"replay {i}"
        cpu = ampc.ops.cast([m.cpu() for m in masters], torch.bfloat16, stochastic=True, seed=5)
        for p, c in zip(params, cpu):
            assert_bits(p, c, f"replay {i} stochastic cast")
    assert found_inf.item() == 0.0


def test_no_host_sync_cuda():
    grads = planted([CHUNK + 1, 10], torch.float16, 15, None)
    masters = cuda_list([CHUNK + 1, 10], torch.float32, seed=16)
    params = [torch.empty_like(m, dtype=torch.float16) for m in masters]
    found_inf = torch.zeros(1, device="cuda")
    inv_scale = torch.full((1,), 0.25, device="cuda")
    scale = torch.full((1,), 4.0, device="cuda")
    tracker = torch.zeros(1, dtype=torch.int32, device="cuda")
    hyst = torch.full((1,), 2, dtype=torch.int32, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        ampc.ops.cast(masters, torch.bfloat16, stochastic=True, seed=3)
        ampc.ops.cast_(params, masters)
        ampc.ops.unscale_check(grads, found_inf, inv_scale, check_only=True)
        ampc.ops.unscale_check(grads, found_inf, inv_scale)
        ampc.ops.update_scale(scale, tracker, found_inf, 2.0, 0.5, 100)
        ampc.ops.update_scale(scale, tracker, found_inf, 2.0, 0.5, 100, hysteresis=2,
                              hysteresis_tracker=hyst, min_scale=1.0, max_scale=2.0**24)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert found_inf.item() == 0.0 and scale.item() == 4.0 and tracker.item() == 2


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_second_device_cuda():
    with torch.cuda.device(0):
        src = cuda_list([CHUNK + 5], torch.float32, seed=17)[0].to("cuda:1")
        found_inf = torch.zeros(1, device="cuda:1")
        (out,) = ampc.ops.cast([src], torch.float16)
        ampc.ops.unscale_check([out], found_inf, torch.full((1,), 0.5, device="cuda:1"))
        assert torch.cuda.current_device() == 0
    assert out.device == src.device
    assert_bits(out, (src.to(torch.float16).float() * 0.5).to(torch.float16), "cuda:1")


# ---- tensors over 2^31 elements ----

@pytest.mark.slow
def test_over_2_31_elements_cuda():
    n = 2**31 + 3 * CHUNK + 5
    big = torch.randn(n, dtype=torch.float16, device="cuda")
    small = torch.randn(1000, dtype=torch.float16, device="cuda")
    tail = slice(n - 3 * CHUNK - 100, n)        # elements past 2^31

    out = ampc.ops.cast([big, small], torch.bfloat16)
    assert torch.equal(out[0].view(torch.int16), big.to(torch.bfloat16).view(torch.int16))
    assert_bits(out[1], small.to(torch.bfloat16), "cast of the tensor after the big one")
    del out

    # stochastic: element k of the list draws bits k, past 2^31 too
    (sr,) = ampc.ops.cast([big], torch.bfloat16, stochastic=True, seed=9)
    (sr_cpu,) = ampc.ops.cast([big.cpu()], torch.bfloat16, stochastic=True, seed=9)
    assert torch.equal(sr.view(torch.int16), sr_cpu.cuda().view(torch.int16))
    del sr, sr_cpu

    found_inf = torch.zeros(1, device="cuda")
    norm = ampc.ops.unscale_check([big, small], found_inf, torch.ones(1, device="cuda"),
                                  check_only=True)
    want = f64_norm(list(big.split(2**28)) + [small], 1.0)     # in pieces: float64 is big
    assert abs(norm.item() - want) <= 1e-5 * want
    assert found_inf.item() == 0.0

    big[n - 1] = math.inf
    want_tail = (big[tail].float() * 0.5).to(torch.float16)
    ampc.ops.unscale_check([big, small], found_inf, torch.full((1,), 0.5, device="cuda"))
    assert found_inf.item() == 1.0
    assert_bits(big[tail], want_tail, "unscale past 2^31")
