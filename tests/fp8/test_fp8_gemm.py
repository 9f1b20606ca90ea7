"""ampc.fp8.gemm: the CPU reference path against a float64 reference and against
torch._scaled_mm on the CPU, its options and its errors; the raw op's argument checks;
cuBLASLt against torch._scaled_mm on a GPU (cuda-marked)."""
import pytest
import torch

import ampc
from ampc.fp8 import gemm

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
EPS32 = 2.0 ** -24


def fp8(shape, dtype=E4M3, seed=0, spread=8.0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * spread).to(dtype).to(device)


def operands(m, k, n, da=E4M3, db=E4M3, seed=0, device="cpu"):
    """a [m, k] row-major, b [k, n] column-major, two scales."""
    a = fp8((m, k), da, seed, device=device)
    b = fp8((n, k), db, seed + 1, device=device).t()
    sa = torch.tensor([0.37], device=device)
    sb = torch.tensor([1.9], device=device)
    return a, b, sa, sb


def f64_reference(a, b, sa, sb, bias=None):
    out = (a.double() @ b.double()) * (sa.double() * sb.double())
    if bias is not None:
        out = out + bias.double()
    return out


def fp32_error_bound(a, b, sa, sb, bias=None):
    """What fp32 accumulation over k products may lose, element by element, plus the
    rounding of the scaling and the bias (a few fp32 ulps)."""
    k = a.shape[1]
    mag = (a.double().abs() @ b.double().abs()) * (sa.double() * sb.double()).abs()
    if bias is not None:
        mag = mag + bias.double().abs()
    return (k + 4) * EPS32 * mag + 1e-30


@pytest.mark.parametrize("m,k,n", [(1, 16, 16), (7, 32, 48), (64, 128, 32), (33, 272, 80)])
@pytest.mark.parametrize("da,db", [(E4M3, E4M3), (E4M3, E5M2), (E5M2, E4M3)])
def test_cpu_fp32_out_within_fp32_accumulation_of_float64(m, k, n, da, db):
    a, b, sa, sb = operands(m, k, n, da, db, seed=m + k)
    out = gemm(a, b, sa, sb, out_dtype=torch.float32)
    ref = f64_reference(a, b, sa, sb)
    assert out.dtype == torch.float32 and out.shape == (m, n)
    assert ((out.double() - ref).abs() <= fp32_error_bound(a, b, sa, sb)).all()


def test_cpu_exact_on_small_integers():
    """Small integers in fp8 with power-of-two scales: every product and partial sum is
    exact in fp32, so the result is the float64 one bit for bit; a path that rounded the
    operands or accumulated in bf16 would not be."""
    g = torch.Generator().manual_seed(3)
    a = torch.randint(-15, 16, (24, 64), generator=g).float().to(E4M3)
    b = torch.randint(-15, 16, (32, 64), generator=g).float().to(E4M3).t()
    sa, sb = torch.tensor([0.5]), torch.tensor([4.0])
    out = gemm(a, b, sa, sb, out_dtype=torch.float32)
    assert torch.equal(out.double(), f64_reference(a, b, sa, sb))
    assert out.abs().max() > 1000      # sums of up to 64 products of up to 225 each


def test_cpu_bf16_out_is_one_rounding_of_the_fp32_result():
    a, b, sa, sb = operands(40, 64, 32, seed=5)
    bias = torch.randn(32, generator=torch.Generator().manual_seed(6)).to(torch.bfloat16)
    out = gemm(a, b, sa, sb, bias=bias, out_dtype=torch.bfloat16)
    full = gemm(a, b, sa, sb, bias=bias, out_dtype=torch.float32)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, full.to(torch.bfloat16))
    ref = f64_reference(a, b, sa, sb, bias)
    half_ulp = ref.abs() * 2.0 ** -8        # bf16 keeps 8 significant bits
    assert ((out.double() - ref).abs() <= half_ulp + fp32_error_bound(a, b, sa, sb, bias)).all()


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_bias", [False, True])
def test_cpu_against_torch_scaled_mm(out_dtype, with_bias):
    a, b, sa, sb = operands(48, 96, 64, seed=7)
    bias = torch.randn(64).to(torch.bfloat16) if with_bias else None
    ours = gemm(a, b, sa, sb, bias=bias, out_dtype=out_dtype)
    try:
        theirs = torch._scaled_mm(a, b, sa.reshape(()), sb.reshape(()), bias=bias,
                                  out_dtype=out_dtype)
    except RuntimeError as e:   # oneDNN has no FP8 matmul without AVX-512 (AVX2-only CPUs)
        if "primitive descriptor" not in str(e):
            raise
        pytest.skip("torch's CPU _scaled_mm cannot run on this CPU; ampc's path is checked "
                    "against float64 by the tests above")
    assert ours.dtype == theirs.dtype == out_dtype
    # torch's CPU path scales the operands before its matmul and we scale the fp32
    # result after it (as cuBLASLt does): the two differ by fp32 roundings only
    ref = f64_reference(a, b, sa, sb, bias)
    tol = 2 * fp32_error_bound(a, b, sa, sb, bias)
    if out_dtype == torch.bfloat16:     # two roundings that may fall either side
        tol = tol + ref.abs() * 2.0 ** -7
    assert ((ours.double() - theirs.double()).abs() <= tol).all()


def test_cpu_amax_out_is_max_abs_of_the_unrounded_result():
    a, b, sa, sb = operands(32, 48, 16, seed=9)
    bias = torch.randn(16).to(torch.bfloat16)
    amax = torch.full((1,), -1.0)
    out = gemm(a, b, sa, sb, bias=bias, out_dtype=torch.bfloat16, amax_out=amax)
    full = gemm(a, b, sa, sb, bias=bias, out_dtype=torch.float32)
    assert amax.item() == full.abs().max().item()
    assert abs(amax.item() - out.float().abs().max().item()) <= amax.item() * 2.0 ** -8


def test_cpu_inside_autocast_keeps_the_fp32_matmul():
    a, b, sa, sb = operands(16, 32, 16, seed=11)
    plain = gemm(a, b, sa, sb, out_dtype=torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        inside = gemm(a, b, sa, sb, out_dtype=torch.float32)
    with ampc.autocast("cpu", dtype=torch.bfloat16):
        inside_ampc = gemm(a, b, sa, sb, out_dtype=torch.float32)
    assert torch.equal(plain, inside) and torch.equal(plain, inside_ampc)


def test_cpu_specials_propagate():
    a, b, sa, sb = operands(16, 16, 16, seed=12)
    a = a.clone()
    a[3, 5] = float("nan")
    out = gemm(a, b, sa, sb, out_dtype=torch.float32)
    assert out[3].isnan().all() and not out[[0, 1, 2, 4]].isnan().any()
    inf_scale = gemm(a[:2].contiguous(), b, torch.tensor([float("inf")]), sb,
                     out_dtype=torch.float32)
    assert not inf_scale.isfinite().any()


# ---- errors name the argument ----

def _good():
    a, b, sa, sb = operands(16, 32, 16)
    return dict(a=a, b=b, scale_inv_a=sa, scale_inv_b=sb)


@pytest.mark.parametrize("change,kind,words", [
    (dict(a=torch.randn(16, 32)), TypeError, "a must be torch.float8_e4m3fn"),
    (dict(b="x"), TypeError, "b must be a Tensor"),
    (dict(a=fp8((16, 32), E5M2), b=fp8((16, 32), E5M2).t()), TypeError, "both torch.float8_e5m2"),
    (dict(a=fp8((16, 24)), b=fp8((16, 24)).t()), ValueError, "k (24) and n (16)"),
    (dict(b=fp8((24, 32)).t()), ValueError, "k (32) and n (24)"),
    (dict(b=fp8((16, 16))), ValueError, "b must have 32 rows"),
    (dict(b=fp8((32, 16))), ValueError, "b must be column-major"),
    (dict(a=fp8((32, 16)).t()), ValueError, "a must be row-major"),
    (dict(a=fp8((2, 16, 32))), ValueError, "a must be a matrix"),
    (dict(scale_inv_a=torch.ones(2)), ValueError, "scale_inv_a must be a 1-element"),
    (dict(scale_inv_b=torch.ones(1, dtype=torch.float64)), ValueError, "scale_inv_b must be"),
    (dict(scale_inv_b=1.0), TypeError, "scale_inv_b must be a Tensor"),
    (dict(bias=torch.ones(16)), ValueError, "bias must be a torch.bfloat16 vector"),
    (dict(bias=torch.ones(15, dtype=torch.bfloat16)), ValueError, "of n = 16 elements"),
    (dict(out_dtype=torch.float16), TypeError, "out_dtype must be"),
    (dict(amax_out=torch.zeros(1, dtype=torch.bfloat16)), ValueError, "amax_out must be"),
])
def test_bad_inputs_name_the_argument(change, kind, words):
    args = _good()
    args.update(change)
    with pytest.raises(kind, match="ampc.fp8.gemm: " + ".*" + __import__("re").escape(words)):
        gemm(**args)


def test_raw_op_checks_its_arguments_then_refuses_the_cpu():
    op = torch.ops.ampc.fp8_gemm
    a, b, sa, sb = operands(32, 32, 16)
    out = torch.full((32, 16), 7.0, dtype=torch.bfloat16)
    ws = torch.empty(0, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="ampc.fp8_gemm: runs on CUDA only"):
        op(out, a, b.t(), sa, sb, [], [], ws)
    cases = [
        ((out, a, b.t().float(), sa, sb, [], [], ws), "b_t must be torch.float8_e4m3fn"),
        ((torch.empty(32, 8), a, b.t(), sa, sb, [], [], ws), "out must be [32, 16]"),
        ((out.half(), a, b.t(), sa, sb, [], [], ws), "out must be torch.float32 or"),
        ((out, a, b.t(), sa, sb, [torch.zeros(16)], [], ws), "bias must be a torch.bfloat16"),
        ((out, a, b.t(), sa, sb, [], [torch.zeros(2)], ws), "amax must be a 1-element"),
        ((out, a, b.t(), sa, sb, [], [], ws.float()), "workspace must be a torch.uint8"),
        ((out, a, b.t(), sa, sb, [], [out.view(torch.float32)[0, :1]], ws), "overlaps"),
        ((out, a[:, 1:17], b.t(), sa, sb, [], [], ws), "a must be contiguous"),
        ((out, fp8((32, 16)), b.t(), sa, sb, [], [], ws), "b_t must be [n, k] with k = 16"),
        ((out, a, b.t(), sa.double(), sb, [], [], ws), "scale_inv_a must be a 1-element"),
    ]
    for args, words in cases:
        with pytest.raises(RuntimeError, match=__import__("re").escape(words)):
            op(*args)
    assert (out == 7.0).all()       # refused before anything was written


def test_raw_op_has_a_fake_kernel():
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        a = torch.empty(32, 32, dtype=E4M3)
        b_t = torch.empty(16, 32, dtype=E4M3)
        out = torch.empty(32, 16, dtype=torch.bfloat16)
        s = torch.ones(1)
        assert torch.ops.ampc.fp8_gemm(out, a, b_t, s, s, [], [], torch.empty(0, dtype=torch.uint8)) == 0


# ---- CUDA (cuBLASLt) ----

def _fp8_gpu():
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


def tensor_core_bound(a, b, sa, sb, bias=None):
    """FP8 tensor cores add their products with fewer bits than fp32 (about 14 on Hopper, as
    DeepSeek-V3's report measured), and cuBLAS promotes the partial sums to fp32 every few
    k-blocks: allow 2^-10 of the sum of magnitudes."""
    return 2.0 ** -10 * (fp32_error_bound(a, b, sa, sb, bias) / (a.shape[1] + 4) / EPS32)


@pytest.mark.cuda
@pytest.mark.parametrize("m,k,n", [(16, 16, 16), (100, 256, 512), (4096, 1024, 3072)])
@pytest.mark.parametrize("da,db", [(E4M3, E4M3), (E5M2, E4M3), (E4M3, E5M2)])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_cuda_against_torch_scaled_mm(m, k, n, da, db, out_dtype):
    if not _fp8_gpu():
        pytest.skip("needs a GPU with FP8 (sm_89+)")
    a, b, sa, sb = operands(m, k, n, da, db, seed=m, device="cuda")
    bias = torch.randn(n, device="cuda").to(torch.bfloat16)
    for bb in (None, bias):
        ours = gemm(a, b, sa, sb, bias=bb, out_dtype=out_dtype)
        theirs = torch._scaled_mm(a, b, sa.reshape(()), sb.reshape(()), bias=bb,
                                  out_dtype=out_dtype)
        ref = f64_reference(a, b, sa, sb, bb)       # float64 on the GPU: fast
        tol = tensor_core_bound(a, b, sa, sb, bb)
        if out_dtype == torch.bfloat16:
            tol = tol + ref.abs() * 2.0 ** -7
        assert ((ours.double() - theirs.double()).abs() <= tol).all()
        assert ((ours.double() - ref).abs() <= tol).all()


@pytest.mark.cuda
def test_cuda_amax_out_and_cpu_agree():
    if not _fp8_gpu():
        pytest.skip("needs a GPU with FP8 (sm_89+)")
    a, b, sa, sb = operands(64, 128, 64, seed=21)
    amax_c = torch.zeros(1)
    cpu = gemm(a, b, sa, sb, out_dtype=torch.float32, amax_out=amax_c)
    amax_g = torch.zeros(1, device="cuda")
    gpu = gemm(a.cuda(), b.cuda(), sa.cuda(), sb.cuda(), out_dtype=torch.float32, amax_out=amax_g)
    tol = tensor_core_bound(a, b, sa, sb)
    assert ((gpu.cpu().double() - cpu.double()).abs() <= tol).all()
    assert abs(amax_g.item() - amax_c.item()) <= 2.0 ** -10 * amax_c.item()


@pytest.mark.cuda
def test_cuda_refuses_below_sm89():
    if _fp8_gpu():
        pytest.skip("this GPU has FP8")
    a, b, sa, sb = operands(16, 16, 16, device="cuda")
    with pytest.raises(RuntimeError, match="compute capability 8.9 or newer"):
        gemm(a, b, sa, sb)
