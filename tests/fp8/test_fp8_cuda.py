"""The fp8 ops on CUDA, against torch on the GPU and against ampc's CPU path.

Tolerances:
  cast_fp8       fp8 codes bit for bit against torch's CUDA
                 ``(x.float() * scale).clamp(-fmax, fmax).to(fp8)``; against the CPU path
                 bit for bit but the sign of NaN codes (CUDA's multiply returns +NaN, the
                 CPU's keeps a NaN operand's sign); amax equal to torch's (NaN by position).
  cast_from_fp8  as the CPU tests: fp32 bit for bit, fp16/bf16 NaN by position.
  update_scales  scales, inverse scales and history bit for bit against the CPU path over
                 1,000 steps; a captured CUDA graph of cast, amax and update replays the
                 eager results.
"""
import math
import random

import pytest
import torch

import ampc
from reference import assert_same
from test_fp8_cast import (E4M3, FMAX, FP8, NAMES, SCALES, WIDE, fp8_bits, fp8_ties,
                           random_values, special_values, torch_amax, torch_cast)
from test_fp8_scaling import amax_stream

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

CHUNK = 65536
SIZES = [0, 1, 7, 8, 9, 15, 16, 17, 4095, 4096, 4097, CHUNK - 1, CHUNK, CHUNK + 1, 3 * CHUNK + 5]


def without_nan_sign(q):
    """fp8 codes with the sign of NaN codes cleared (the one CPU/CUDA difference)."""
    b = fp8_bits(q).clone()
    nan = torch.isnan(q.float())
    b[nan] &= 0x7F
    return b


def cuda_cast_fp8(srcs, dtypes, scales, what):
    """cast_fp8 on the GPU equals torch on the GPU, and the CPU path up to NaN signs."""
    dev = [x.cuda() for x in srcs]
    dst = [torch.empty(x.shape, dtype=d, device="cuda") for x, d in zip(dev, dtypes)]
    scale = torch.tensor(scales, dtype=torch.float32, device="cuda")
    amax = torch.full((len(srcs),), -1.0, device="cuda")
    ampc.ops.cast_fp8(dst, dev, scale, amax)
    cpu_dst = [torch.empty(x.shape, dtype=d) for x, d in zip(srcs, dtypes)]
    cpu_amax = torch.empty(len(srcs))
    ampc.ops.cast_fp8(cpu_dst, srcs, scale.cpu(), cpu_amax)
    for i, (x, q) in enumerate(zip(dev, dst)):
        label = f"{what} tensor {i} ({NAMES[x.dtype]}->{NAMES[q.dtype]}, scale {scales[i]})"
        want = torch_cast(x, scale[i], q.dtype, keep_nan_sign=False)     # torch's own, on the GPU
        assert_same(fp8_bits(q).cpu(), fp8_bits(want).cpu(), label)
        assert_same(without_nan_sign(q.cpu()), without_nan_sign(cpu_dst[i]), f"{label} vs CPU")
        assert_same(amax[i].cpu(), torch_amax(x).cpu(), f"{label} amax")
        assert_same(amax[i].cpu(), cpu_amax[i], f"{label} amax vs CPU")
    return dst, amax


@pytest.mark.parametrize("fmt", FP8, ids=NAMES.get)
@pytest.mark.parametrize("wide", WIDE, ids=NAMES.get)
def test_every_code_round_trips_cuda(fmt, wide):
    q = torch.arange(256, dtype=torch.int32, device="cuda").to(torch.uint8).view(fmt)
    back = torch.empty(256, dtype=wide, device="cuda")
    one = torch.ones(1, device="cuda")
    ampc.ops.cast_from_fp8([back], [q], one)
    assert_same(back.cpu(), (q.float() * one[0]).to(wide).cpu(), "codes",
                nan_payload=wide == torch.float32)
    cuda_cast_fp8([back.cpu()], [fmt], [1.0], "codes back")


@pytest.mark.parametrize("wide", WIDE, ids=NAMES.get)
@pytest.mark.parametrize("fmt", FP8, ids=NAMES.get)
def test_random_sizes_scales_cuda(fmt, wide):
    srcs = [random_values(n, wide, seed=n) for n in SIZES]
    cuda_cast_fp8(srcs, [fmt] * len(srcs), [SCALES[i % len(SCALES)] for i in range(len(srcs))],
                  "random")


@pytest.mark.parametrize("fmt", FP8, ids=NAMES.get)
def test_ties_and_specials_cuda(fmt):
    x = fp8_ties(fmt)
    cuda_cast_fp8([x, x.to(torch.bfloat16), x.to(torch.float16)], [fmt] * 3, [1.0] * 3, "ties")
    for wide in WIDE:
        s = special_values(wide)
        cuda_cast_fp8([s] * 5, [fmt] * 5, [1.0, 2.0 ** 20, 0.0, math.inf, math.nan], "specials")


def test_unaligned_views_cuda():
    # views that start off a 16-byte boundary take the element-a-thread path
    base = random_values(CHUNK + 40, torch.float32, seed=9).cuda()
    out = torch.empty(CHUNK + 40, dtype=E4M3, device="cuda")
    for off_in, off_out in [(1, 1), (1, 0), (0, 3), (5, 5)]:
        x = base[off_in:off_in + CHUNK + 1]
        q = out[off_out:off_out + CHUNK + 1]
        amax = torch.empty(1, device="cuda")
        ampc.ops.cast_fp8([q], [x], torch.full((1,), 3.0, device="cuda"), amax)
        assert_same(fp8_bits(q).cpu(), fp8_bits(torch_cast(x, 3.0, E4M3)).cpu(),
                    f"offsets {off_in}, {off_out}")
        assert_same(amax[0].cpu(), torch_amax(x).cpu(), "amax")


def test_many_tensors_cuda():
    # more tensors than a launch's table (64) and than a zeroing launch (480), empty ones too
    g = torch.Generator().manual_seed(3)
    srcs = [(torch.randn(int(n), generator=g) * 50).to(WIDE[i % 3])
            for i, n in enumerate(torch.randint(0, 300, (700,), generator=g))]
    srcs[10] = torch.randn(3 * CHUNK + 1)
    cuda_cast_fp8(srcs, [FP8[i % 2] for i in range(700)], [2.0 ** (i % 9 - 4) for i in range(700)],
                  "700 tensors")
    amax = torch.full((700,), 7.0, device="cuda")
    ampc.ops.fp8_amax([x.cuda() for x in srcs], amax)
    for i, x in enumerate(srcs):
        assert_same(amax[i].cpu(), torch_amax(x), f"fp8_amax tensor {i}")


@pytest.mark.parametrize("fmt", FP8, ids=NAMES.get)
@pytest.mark.parametrize("wide", WIDE, ids=NAMES.get)
def test_cast_from_fp8_cuda(fmt, wide):
    g = torch.Generator().manual_seed(1)
    srcs = [torch.randint(0, 256, (n,), generator=g, dtype=torch.int32).to(torch.uint8)
            .view(fmt).cuda() for n in SIZES]
    scale_inv = torch.tensor([SCALES[i % len(SCALES)] for i in range(len(srcs))],
                             device="cuda")
    dst = [torch.empty(q.shape, dtype=wide, device="cuda") for q in srcs]
    ampc.ops.cast_from_fp8(dst, srcs, scale_inv)
    for i, (q, y) in enumerate(zip(srcs, dst)):
        assert_same(y.cpu(), (q.float() * scale_inv[i]).to(wide).cpu(), f"tensor {i}",
                    nan_payload=wide == torch.float32)


@pytest.mark.parametrize("rows, algo", [(16, "max"), (1, "most_recent"), (1024, "max")])
def test_update_scales_cuda_equals_cpu(rows, algo):
    n = 300
    state = [torch.zeros(rows, n), torch.ones(n), torch.ones(n)]
    dev = [t.cuda() for t in state]
    for amaxes in amax_stream(random.Random(rows), n):
        amax = torch.tensor(amaxes, dtype=torch.float32)
        ampc.ops.fp8_update_scales(state[0], amax, state[1], state[2], fmax=448.0, algo=algo)
        ampc.ops.fp8_update_scales(dev[0], amax.cuda(), dev[1], dev[2], fmax=448.0, algo=algo)
    for c, d, what in zip(state, dev, ("amax_history", "scale", "scale_inv")):
        assert_same(d.cpu(), c, what, nan_payload=True)


def test_graph_capture_of_cast_amax_update():
    x = [torch.randn(5000, device="cuda") * 3, torch.randn(77, device="cuda", dtype=torch.bfloat16)]
    q = [torch.empty(t.shape, dtype=E4M3, device="cuda") for t in x]
    history, scale, scale_inv = (torch.zeros(4, 2, device="cuda"), torch.ones(2, device="cuda"),
                                 torch.ones(2, device="cuda"))
    amax = torch.empty(2, device="cuda")

    def step():
        ampc.ops.cast_fp8(q, x, scale, amax)
        ampc.ops.fp8_update_scales(history, amax, scale, scale_inv, fmax=FMAX[E4M3])

    eager = [t.clone() for t in (history, scale, scale_inv)]
    ampc.ops.cast_fp8(q, x, eager[1], amax)
    ampc.ops.fp8_update_scales(eager[0], amax, eager[1], eager[2], fmax=FMAX[E4M3])
    want_q = [t.clone() for t in q]
    history.zero_(), scale.fill_(1.0), scale_inv.fill_(1.0)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()                                  # warm up outside the capture
    torch.cuda.current_stream().wait_stream(s)
    history.zero_(), scale.fill_(1.0), scale_inv.fill_(1.0)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    graph.replay()
    torch.cuda.synchronize()
    for a, b in zip((history, scale, scale_inv), eager):
        assert torch.equal(a, b)
    for a, b in zip(q, want_q):
        assert torch.equal(fp8_bits(a), fp8_bits(b))
    graph.replay()                              # the second step uses the updated scale
    torch.cuda.synchronize()
    assert torch.equal(fp8_bits(q[0]), fp8_bits(torch_cast(x[0], scale[0], E4M3)))
