"""ampc.autocast's semantics against torch.autocast's: regions, nesting, threads, what is not
autocast, errors, the decorator, custom_fwd/custom_bwd, the weight cache, gradients of small
models, and torch.compile."""
import threading
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ampc

from ampc.amp import _casts as CASTS, _weight_cache as WC, autocast_mode as AC

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


def mats(n=8, dtype=FP32, requires_grad=False):
    g = torch.Generator().manual_seed(n)
    return [torch.randn(n, n, generator=g, dtype=dtype).requires_grad_(requires_grad) for _ in range(2)]


# ---- regions ----

@pytest.mark.smoke
def test_autocast_default_dtypes_and_queries():
    assert ampc.get_autocast_dtype("cpu") is BF16 and ampc.get_autocast_dtype("cuda") is FP16
    assert not ampc.is_autocast_enabled("cpu")
    with ampc.autocast("cpu") as ctx:
        assert isinstance(ctx, ampc.autocast)
        assert ampc.is_autocast_enabled("cpu") and not ampc.is_autocast_enabled("cuda")
        assert torch.mm(*mats()).dtype is BF16
    with ampc.autocast("cpu", dtype=FP16):
        assert ampc.get_autocast_dtype("cpu") is FP16 and torch.mm(*mats()).dtype is FP16
    assert not ampc.is_autocast_enabled("cpu") and ampc.get_autocast_dtype("cpu") is BF16


def test_autocast_nesting_disabled_region_and_dtype_change():
    a, b = mats()
    with ampc.autocast("cpu"):
        e = torch.mm(a, b)
        with ampc.autocast("cpu", enabled=False):
            assert not ampc.is_autocast_enabled("cpu")
            assert torch.mm(a, b).dtype is FP32
            assert torch.mm(a, e.float()).dtype is FP32       # inputs from outside: user casts
            with ampc.autocast("cpu"):                         # inherits the outer dtype
                assert ampc.get_autocast_dtype("cpu") is BF16
                assert torch.mm(a, b).dtype is BF16
            with ampc.autocast("cpu", dtype=FP16):
                assert torch.mm(a, b).dtype is FP16
        assert ampc.is_autocast_enabled("cpu") and torch.mm(a, e).dtype is BF16
    assert e.dtype is BF16
    assert torch.mm(a, b).dtype is FP32


@pytest.mark.smoke
def test_autocast_matches_torch_values_and_dtype_for_mixed_inputs():
    a, b = mats()
    for dt in (BF16, FP16):
        with torch.autocast("cpu", dtype=dt):
            want = torch.addmm(a, b.to(FP16), a.t())
        with ampc.autocast("cpu", dtype=dt):
            got = torch.addmm(a, b.to(FP16), a.t())      # fp16 input, non-contiguous input
        assert got.dtype is want.dtype and torch.equal(got, want)


def test_autocast_state_is_thread_local():
    seen = {}

    def worker():
        seen["enabled"] = ampc.is_autocast_enabled("cpu")
        seen["mm"] = torch.mm(*mats()).dtype
        with ampc.autocast("cpu", dtype=FP16):
            seen["inner"] = torch.mm(*mats()).dtype

    with ampc.autocast("cpu"):
        t = threading.Thread(target=worker)
        t.start()
        t.join()
        assert torch.mm(*mats()).dtype is BF16 and ampc.get_autocast_dtype("cpu") is BF16
    assert seen == {"enabled": False, "mm": FP32, "inner": FP16}


def test_autocast_leaves_float64_integer_and_other_device_tensors_alone():
    with ampc.autocast("cpu"):
        assert torch.mm(*mats(dtype=torch.float64)).dtype is torch.float64
        i = torch.arange(4).reshape(2, 2)
        assert torch.mm(i, i).dtype is torch.int64
        m = torch.empty(4, 4, device="meta")
        assert torch.mm(m, m).dtype is FP32 and torch.mm(m, m).device.type == "meta"
        # a float64 argument of a promote op is left alone (and the op promotes)
        assert torch.cat([torch.ones(2, dtype=torch.float64), torch.ones(2)]).dtype is torch.float64
        # fp16 meeting bf16 autocast in a promote op: torch's error
        with pytest.raises(RuntimeError, match="Unexpected floating ScalarType in at::autocast::prioritize"):
            torch.cat([torch.ones(2, dtype=torch.float64), torch.ones(2, dtype=FP16)])


def test_autocast_inplace_and_out_calls_are_not_autocast():
    a, b = mats()
    want_inplace, want_out = a.clone().addmm_(a, b), torch.mm(a, b)
    with ampc.autocast("cpu"):
        c = a.clone()
        c.addmm_(a, b)
        out = torch.empty(8, 8)
        torch.mm(a, b, out=out)
    assert c.dtype is FP32 and torch.equal(c, want_inplace)
    assert out.dtype is FP32 and torch.equal(out, want_out)


def test_autocast_respects_explicit_dtype_of_fp32_set_opt_dtype_ops():
    x = torch.randn(16, dtype=BF16)
    ampc.policy.set_policy("softmax", "fp32_set_opt_dtype", "cpu")
    try:
        with ampc.autocast("cpu"):
            assert torch.softmax(x, 0).dtype is FP32
            assert torch.equal(torch.softmax(x, 0), torch.softmax(x, 0, dtype=FP32))
            assert torch.softmax(x, 0, dtype=BF16).dtype is BF16
            assert x.softmax(0, FP16).dtype is FP16
            assert F.softmax(x, 0).dtype is FP32               # F passes dtype=None along
            assert F.softmax(x, 0, dtype=BF16).dtype is BF16
            assert torch.softmax(torch.ones(3, dtype=torch.float64), 0).dtype is torch.float64
    finally:
        ampc.policy.set_policy("softmax", None, "cpu")


# ---- bad input ----

def test_autocast_errors_name_the_argument():
    with pytest.raises(ValueError, match=r"ampc.autocast: Expected `device_type` of type `str`"):
        ampc.autocast(3)
    with pytest.raises(RuntimeError, match="unsupported autocast device_type 'tpu0'"):
        ampc.autocast("tpu0")
    with pytest.raises(RuntimeError, match="'xpu' is not supported by ampc"):
        ampc.autocast("xpu")
    with pytest.raises(RuntimeError, match=r"In CPU autocast, but the target dtype torch.float64 is not supported"):
        ampc.autocast("cpu", dtype=torch.float64)
    with pytest.raises(RuntimeError, match=r"target dtype torch.int32 is not supported"):
        ampc.autocast("cpu", dtype=torch.int32)
    with pytest.raises(TypeError, match="ampc.autocast: dtype must be a torch.dtype"):
        ampc.autocast("cpu", dtype="bf16")
    with pytest.raises(RuntimeError, match="unsupported autocast device_type"):
        ampc.is_autocast_enabled("nope")
    ampc.autocast("cpu", dtype=torch.float64, enabled=False)    # a disabled region checks nothing
    with pytest.raises(ValueError, match=r"ampc.set_autocast_dtype: dtype must be one of .* on cpu"):
        ampc.set_autocast_dtype("cpu", FP32)
    ampc.set_autocast_dtype("cpu", FP16)
    try:
        with ampc.autocast("cpu"):
            assert torch.mm(*mats()).dtype is FP16
    finally:
        ampc.set_autocast_dtype("cpu", BF16)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")
def test_autocast_cuda_without_gpu_warns_and_disables_like_torch():
    with pytest.warns(UserWarning, match="CUDA is not available"):
        ctx = ampc.autocast("cuda")
    with ctx:
        assert not ampc.is_autocast_enabled("cuda")
    with pytest.warns(UserWarning, match="CUDA is not available"):
        legacy = ampc.autocast()                 # torch.cuda.amp.autocast() form
    assert legacy.device == "cuda" and legacy.fast_dtype is FP16
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        off = ampc.autocast(False, BF16)         # legacy positional (enabled, dtype)
    assert off.fast_dtype is BF16 and not off._enabled


# ---- decorator ----

def test_autocast_decorator_reenters_in_recursion():
    @ampc.autocast("cpu")
    def depth(n):
        assert ampc.is_autocast_enabled("cpu")
        if n:
            with ampc.autocast("cpu", enabled=False):
                depth(n - 1)
            assert ampc.is_autocast_enabled("cpu")   # restored after the nested call
        return torch.mm(*mats()).dtype

    assert depth(3) is BF16
    assert not ampc.is_autocast_enabled("cpu") and AC._st.depth == 0 and not AC._st.saved


# ---- custom_fwd / custom_bwd ----

class _MyMM(torch.autograd.Function):
    @staticmethod
    @ampc.custom_fwd(device_type="cpu", cast_inputs=FP32)
    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)
        ctx.inside = (a.dtype, b.dtype, ampc.is_autocast_enabled("cpu"))
        return a.mm(b)

    @staticmethod
    @ampc.custom_bwd(device_type="cpu")
    def backward(ctx, g):
        a, b = ctx.saved_tensors
        ctx.bwd_enabled = ampc.is_autocast_enabled("cpu")
        return g.mm(b.t()), a.t().mm(g)


class _Plain(torch.autograd.Function):
    @staticmethod
    @ampc.custom_fwd(device_type="cpu")
    def forward(ctx, a, b):
        return a.mm(b)

    @staticmethod
    @ampc.custom_bwd(device_type="cpu")
    def backward(ctx, g):
        ctx.bwd_state = (ampc.is_autocast_enabled("cpu"), ampc.get_autocast_dtype("cpu"))
        return g.mm(g.t()).sum() * 0 + g, g


def test_custom_fwd_casts_inputs_and_turns_autocast_off():
    a, b = mats(dtype=BF16, requires_grad=True)
    with ampc.autocast("cpu"):
        out = _MyMM.apply(a, b)
    assert out.dtype is FP32 and out.grad_fn.inside == (FP32, FP32, False)
    out.sum().backward()
    assert a.grad.dtype is BF16 and not out.grad_fn.bwd_enabled
    x, y = mats(requires_grad=True)
    with ampc.autocast("cpu", dtype=FP16):
        z = _Plain.apply(x, y)
    assert z.dtype is FP16                    # ran as the region says
    z.float().sum().backward()
    assert z.grad_fn.bwd_state == (True, FP16)
    with pytest.raises(ValueError, match="custom_fwd: Expected `device_type` of type `str`"):
        ampc.custom_fwd(device_type=None)


# ---- the weight cache (used on CUDA by default; switched on for the CPU here) ----

@pytest.fixture
def fused_cpu(monkeypatch):
    monkeypatch.setitem(WC.FUSED, "cpu", True)


def count_casts(monkeypatch):
    calls = []
    real = CASTS.raw_cast
    monkeypatch.setattr(CASTS, "raw_cast", lambda ts, dt: calls.append(len(ts)) or real(ts, dt))
    return calls


class Two(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(8, 8))
        self.w2 = nn.Parameter(torch.randn(8, 8))
        self.w3 = nn.Parameter(torch.randn(8, 8))

    def forward(self, x):
        return (x @ self.w1) @ self.w2 + self.w3.sum()


@pytest.mark.smoke
@pytest.mark.usefixtures("fused_cpu")
def test_weight_cache_casts_a_modules_weights_in_one_call(monkeypatch):
    m, x = Two(), torch.randn(4, 8, dtype=BF16)
    calls = count_casts(monkeypatch)
    with ampc.autocast("cpu"):
        y1 = m(x)
        y2 = m(x)
    # first matmul: w1 misses and brings w2 and w3 along (one call, 3 tensors); then all hits
    assert calls == [3]
    assert torch.equal(y1, y2)
    with torch.autocast("cpu"):
        assert torch.equal(y1, m(x))
    assert not AC._st.cache


@pytest.mark.usefixtures("fused_cpu")
def test_later_regions_cast_all_weights_in_ddp_sized_buckets(monkeypatch):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.Linear(8, 4))
    x = torch.randn(2, 8, dtype=BF16)
    calls = count_casts(monkeypatch)
    outs, seen = [], []
    for _ in range(2):
        with ampc.autocast("cpu"):
            outs.append(model(x))
        seen.append(list(calls))
        outs[-1].float().sum().backward()          # backward: one grad cast per forward call
        calls.clear()
    assert seen == [[2, 2, 2], [6]]      # first region: per module; then all six in one call
    assert torch.equal(outs[0], outs[1])
    monkeypatch.setattr(WC, "_BUCKET_BYTES", 8 * 8 * 4 + 8 * 4)    # one Linear's weights
    with ampc.autocast("cpu"):
        model(x)
    assert calls == [2, 2, 2]


@pytest.mark.usefixtures("fused_cpu")
def test_weight_cache_invalidated_by_inplace_update():
    """Beyond torch: its own cache keeps the stale cast of a weight updated in place."""
    lin = nn.Linear(8, 8)
    x = torch.randn(2, 8)
    with ampc.autocast("cpu"):
        before = lin(x)
        with torch.no_grad():
            lin.weight.add_(1.0)
        after = lin(x)
    with torch.autocast("cpu"):
        want = lin(x)
    assert not torch.equal(before, after) and torch.equal(after, want)


@pytest.mark.usefixtures("fused_cpu")
def test_weight_cast_made_under_no_grad_still_gets_gradients():
    lin = nn.Linear(8, 8)
    x = torch.randn(2, 8)
    with ampc.autocast("cpu"):
        with torch.no_grad():
            lin(x)
        lin(x).float().sum().backward()
    assert lin.weight.grad is not None and lin.weight.grad.dtype is FP32


@pytest.mark.usefixtures("fused_cpu")
def test_cache_disabled_leaves_every_cast_to_torch(monkeypatch):
    lin, x = nn.Linear(8, 8), torch.randn(2, 8)
    calls = count_casts(monkeypatch)
    with ampc.autocast("cpu", cache_enabled=False):
        assert not torch.is_autocast_cache_enabled()
        got = [lin(x), lin(x)]
    with torch.autocast("cpu", cache_enabled=False):
        want = lin(x)
    assert calls == [] and not AC._st.cache
    assert all(torch.equal(g, want) for g in got)


# ---- gradients of small models against torch.autocast ----

class CNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.c1, self.c2 = nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.fc = nn.Linear(8 * 4 * 4, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.c1(x)), 2)
        x = F.adaptive_avg_pool2d(F.relu(self.bn(self.c2(x))), 4)
        return self.fc(x.flatten(1))


def transformer():
    return nn.TransformerEncoder(nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True), 2)


def grads_under(ctx, model, x, target):
    model.zero_grad(set_to_none=True)
    with ctx:
        out = model(x)
        loss = F.cross_entropy(out.reshape(-1, out.shape[-1]).float(), target)
    loss.backward()
    return out.dtype, [p.grad for p in model.parameters()]


@pytest.mark.smoke
@pytest.mark.parametrize("name", ["cnn", "transformer"])
@pytest.mark.parametrize("dt", [BF16, FP16])
def test_gradients_match_torch_autocast(name, dt):
    torch.manual_seed(0)
    if name == "cnn":
        model, x, target = CNN(), torch.randn(4, 3, 16, 16), torch.randint(0, 10, (4,))
    else:
        model, x, target = transformer(), torch.randn(2, 6, 32), torch.randint(0, 32, (12,))
    want_dtype, want = grads_under(torch.autocast("cpu", dtype=dt), model, x, target)
    got_dtype, got = grads_under(ampc.autocast("cpu", dtype=dt), model, x, target)
    assert got_dtype is want_dtype
    for g, w in zip(got, want):
        assert g.dtype is FP32
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


# ---- torch.compile ----

def test_compiled_model_under_ampc_autocast_matches_eager():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.LayerNorm(32), nn.Linear(32, 8))
    x = torch.randn(4, 16)
    with ampc.autocast("cpu"):
        eager = model(x)
    compiled = torch.compile(model)
    with ampc.autocast("cpu"):
        got = compiled(x)
    got.float().sum().backward()
    assert got.dtype is eager.dtype is BF16
    torch.testing.assert_close(got, eager, rtol=1.6e-2, atol=1e-2)
    assert all(p.grad.dtype is FP32 for p in model.parameters())
    with ampc.autocast("cpu"):
        explained = torch._dynamo.explain(model)(x)
    assert explained.graph_count == 1 and explained.graph_break_count == 0


def test_double_backward_through_casts_matches_torch():
    x0 = torch.randn(4, 4, dtype=torch.float64).float()
    results = []
    for ctx in (torch.autocast("cpu"), ampc.autocast("cpu")):
        x = x0.clone().requires_grad_(True)
        with ctx:
            y = torch.mm(x, x).float().pow(2).sum()
        (g,) = torch.autograd.grad(y, x, create_graph=True)
        g.square().sum().backward()
        assert g.dtype is FP32 and x.grad.dtype is FP32
        results.append((g.detach(), x.grad))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.cuda
def test_cuda_region_policies_and_kernel_casts(monkeypatch):
    calls = count_casts(monkeypatch)
    lin = nn.Linear(8, 8).cuda()
    x = torch.randn(4, 8, device="cuda")
    with ampc.autocast("cuda"):
        assert lin(x).dtype is FP16 and calls == [2]      # weight and bias in one call; x: torch's
        assert torch.softmax(x.half(), 0).dtype is FP32
        assert torch.arange(4, device="cuda").sum().dtype is torch.int64
        assert torch.mm(*[m.cuda() for m in mats()]).dtype is FP16
        assert torch.mm(*mats()).dtype is FP32             # CPU tensors: not this region's
        p = torch.rand(4, device="cuda")
        with pytest.raises(RuntimeError, match="are unsafe to autocast"):
            F.binary_cross_entropy(p, p)
    with torch.autocast("cuda"):
        want = lin(x)
    with ampc.autocast("cuda"):
        assert torch.equal(lin(x), want)


def test_python_composites_are_autocast_inside_and_see_later_patches(monkeypatch):
    # F.multi_head_attention_forward is Python: torch autocasts the linear calls inside it;
    # unlisted (as on CUDA) ampc follows it call by call
    monkeypatch.setitem(AC._EFFECTIVE, "cpu", {k: v for k, v in AC._EFFECTIVE["cpu"].items()
                                               if k != "multi_head_attention_forward"})
    mha = nn.MultiheadAttention(16, 4, batch_first=True)
    x = torch.randn(2, 5, 16)
    with torch.autocast("cpu"):
        want = mha(x, x, x, need_weights=False)[0]
    with ampc.autocast("cpu"):
        got = mha(x, x, x, need_weights=False)[0]
    assert got.dtype is want.dtype is BF16 and torch.equal(got, want)
    # a function patched into torch.nn.functional after first use is the one called
    seen = []
    real = F.scaled_dot_product_attention
    monkeypatch.setattr(F, "scaled_dot_product_attention", lambda *a, **k: seen.append(1) or real(*a, **k))
    with ampc.autocast("cpu"):
        mha(x, x, x, need_weights=False)
    assert seen == [1]


def test_cpu_composites_match_torch():
    """Ops whose C++ body calls listed ops (torch autocasts those inside; ampc lists the
    composite itself), and Python wrappers that pass out=None along."""
    torch.manual_seed(0)
    a, b = mats()
    lstm = nn.LSTM(8, 8, batch_first=True)
    x3 = torch.randn(2, 3, 8)
    calls = [lambda: torch.einsum("ij,jk->ik", a, b), lambda: torch.tensordot(a, b, dims=1),
             lambda: torch.linalg.multi_dot([a, b, a]), lambda: lstm(x3)[0],
             lambda: F.cross_entropy(a, torch.arange(8)), lambda: F.nll_loss(a, torch.arange(8)),
             lambda: torch.norm(a), lambda: nn.Conv2d(2, 2, 3, padding_mode="reflect")(torch.randn(1, 2, 5, 5))]
    for i, call in enumerate(calls):
        torch.manual_seed(1)
        try:
            with torch.autocast("cpu"):
                want = call()
        except RuntimeError as e:
            # some CPUs cannot run a case under torch itself (AVX2 only: oneDNN has no bf16
            # LSTM primitive); ampc must then refuse it the same way
            torch.manual_seed(1)
            with pytest.raises(RuntimeError) as got_err, ampc.autocast("cpu"):
                call()
            assert str(got_err.value) == str(e), i
            continue
        torch.manual_seed(1)
        with ampc.autocast("cpu"):
            got = call()
        assert got.dtype is want.dtype and torch.equal(got, want), i


def test_cast_of_a_tensor_without_grad_needs_no_grad():
    # the input joins the weights' cast call; its copy must not make backward compute its grad
    lin = nn.Linear(8, 8)
    x = torch.randn(4, 8)
    graphs = []
    for ctx in (torch.autocast("cpu"), ampc.autocast("cpu")):
        with ctx:
            out = lin(x)
        graphs.append([fn is not None for fn, _ in out.grad_fn.next_functions])
    assert graphs[0] == graphs[1] and graphs[1].count(True) == 2     # bias and weight only


@pytest.mark.usefixtures("fused_cpu")
def test_inference_mode_matches_torch_and_caches_nothing():
    lin, x = nn.Linear(8, 8), torch.randn(2, 8)
    with torch.inference_mode():
        with torch.autocast("cpu"):
            want = lin(x)
        with ampc.autocast("cpu"):
            got = lin(x)
            assert not AC._st.cache
    assert got.dtype is want.dtype and torch.equal(got, want)


@pytest.mark.parametrize("need_weights", [False, True])
def test_multihead_attention_matches_torch_with_masks(need_weights):
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(16, 4, batch_first=True)
    x = torch.randn(2, 5, 16)
    masks = [{}, {"attn_mask": torch.randn(5, 5)}, {"attn_mask": torch.rand(5, 5) > 0.7},
             {"key_padding_mask": torch.rand(2, 5) > 0.8}]
    for kw in masks:
        runs = []
        for ctx in (torch.autocast("cpu"), ampc.autocast("cpu")):
            mha.zero_grad()
            with ctx:
                out, weights = mha(x, x, x, need_weights=need_weights, **kw)
            out.float().sum().backward()
            runs.append([out, weights] + [p.grad for p in mha.parameters()])
        for want, got in zip(*runs):
            assert (want is None and got is None) or (got.dtype is want.dtype and torch.equal(got, want))
