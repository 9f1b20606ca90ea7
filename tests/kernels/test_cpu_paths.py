"""The CPU kernels have AVX-512, AVX2+F16C and scalar paths chosen at run time. This
machine runs the best one; AMPC_CPU_ISA caps the choice, so each path is checked here
against torch in a fresh process: casts bit-identical to .to() over every fp16/bf16
bit pattern and a sweep of fp32 ones, and unscale bit-identical to torch. Each process
reports the path its kernels took (ampc.ops.cpu_isa(), ampc.ops.stream_bytes()), so a
cap that stopped working, or a CPU that silently fell back, fails here. The fp8 casts are
checked the same way: every fp16/bf16 pattern and the fp32 sweep to both fp8 formats at
three scales, bit-identical to torch, with the amax; every fp8 code back."""
import os
import subprocess
import sys

import pytest


def best_isa():
    """The best path this CPU has, from its flags (as csrc/cpu/cpu.c chooses)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = set(next(line for line in f if line.startswith("flags")).split())
    except (OSError, StopIteration):
        return None
    if "avx512f" in flags:
        return "avx512"
    return "avx2" if {"avx2", "fma", "f16c"} <= flags else "scalar"


def expected_isa(isa):
    best = best_isa()
    if best is None:
        pytest.skip("cannot read the CPU's flags")
    if isa == "avx2" and best == "scalar":
        pytest.skip("this CPU has no AVX2 + FMA + F16C")
    return best if isa == "best" else isa

CHECK = r"""
import torch, ampc
f32, f16, bf16 = torch.float32, torch.float16, torch.bfloat16
def same(a, b):
    an, bn = torch.isnan(a.float()), torch.isnan(b.float())
    assert torch.equal(an, bn)
    w = torch.int32 if a.dtype == f32 else torch.int16
    assert torch.equal(a.view(w)[~an], b.view(w)[~bn])
pats = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16)
wide = (torch.arange(0, 2**32, 4099, dtype=torch.int64) - 2**31).to(torch.int32).view(f32)
inputs = {f16: pats.view(f16), bf16: pats.view(bf16), f32: wide}
for s, x in inputs.items():
    for d in (f32, f16, bf16):
        for n in (x.numel(), 13):            # the vector loops and the scalar tails
            (got,) = ampc.ops.cast([x[:n]], d)
            same(got, x[:n].to(d))
for dt in (f32, f16, bf16):
    g = torch.randn(1000).to(dt); g[17] = float("inf")
    a, b = g.clone(), g.clone()
    fa, fb = torch.zeros(1), torch.zeros(1)
    inv = torch.full((1,), 0.37)
    ampc.ops.unscale_check([a], fa, inv)
    torch._amp_foreach_non_finite_check_and_unscale_([b], fb, inv)
    same(a, b); assert fa.item() == fb.item() == 1.0
for fmt, fmax in ((torch.float8_e4m3fn, 448.0), (torch.float8_e5m2, 57344.0)):
    for s, x in inputs.items():
        for n in (x.numel(), 13):
            for scale in (1.0, 0.37, 4096.0):
                q, amax = torch.empty(n, dtype=fmt), torch.empty(1)
                ampc.ops.cast_fp8([q], [x[:n]], torch.full((1,), scale), amax)
                want = (x[:n].float() * scale).clamp(-fmax, fmax).to(fmt)
                assert torch.equal(q.view(torch.uint8), want.view(torch.uint8)), (fmt, s, n, scale)
                assert torch.equal(amax[0], x[:n].abs().amax().float()) or (
                    amax.isnan().all() and x[:n].isnan().any())
                ampc.ops.fp8_amax([x[:n]], amax)
                assert torch.equal(amax[0], x[:n].abs().amax().float()) or amax.isnan().all()
    codes = torch.arange(256 * 9 + 5, dtype=torch.int32).remainder(256).to(torch.uint8).view(fmt)
    for d in (f32, f16, bf16):
        out = torch.empty(codes.shape, dtype=d)
        ampc.ops.cast_from_fp8([out], [codes], torch.full((1,), 0.75))
        same(out, (codes.float() * 0.75).to(d))
print(ampc.ops.cpu_isa(), ampc.ops.stream_bytes())
print("ok")
"""


@pytest.mark.parametrize("stream", [False, True], ids=["cached", "streaming"])
@pytest.mark.parametrize("isa", ["scalar", "avx2", "best"])
def test_each_cpu_path_matches_torch(isa, stream):
    want = expected_isa(isa)
    env = dict(os.environ)
    env.pop("AMPC_CPU_ISA", None)
    env.pop("AMPC_STREAM_BYTES", None)
    if isa != "best":
        env["AMPC_CPU_ISA"] = isa
    if stream:      # every output counts as larger than the cache (Note [streaming stores])
        env["AMPC_STREAM_BYTES"] = "0"
    out = subprocess.run([sys.executable, "-c", CHECK], env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.endswith("ok\n"), out.stderr[-3000:]
    ran, threshold = out.stdout.split("\n")[-3].split()
    assert ran == want, f"asked for {isa}, expected the {want} path, the kernels ran {ran}"
    assert (int(threshold) == 0) == stream


@pytest.mark.parametrize("isa", ["scalar", "avx2", "best"])
def test_fuzz_on_each_cpu_path(isa):
    expected_isa(isa)
    # streaming stores everywhere, with the offsets that make some outputs unaligned
    env = dict(os.environ, AMPC_STREAM_BYTES="0")
    env.pop("AMPC_CPU_ISA", None)
    if isa != "best":
        env["AMPC_CPU_ISA"] = isa
    fuzz = os.path.join(os.path.dirname(os.path.abspath(__file__)), "test_fuzz.py")
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", fuzz],
                         env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:]
