"""ampc.autocast inside torch's own autocast state: torch's getters see ampc regions, nested
torch regions take effect both ways, policy edits still win, backward runs outside the mode,
custom_fwd/custom_bwd work, and torch's C++ autocast closes the CPU gaps of a Python-level mode
(ops inside C++ composites)."""
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ampc
from ampc.amp import _weight_cache, autocast_mode as AC

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


def mats(n=8, seed=0, requires_grad=False):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, n, generator=g).requires_grad_(requires_grad) for _ in range(2)]


@pytest.fixture(autouse=True)
def _clean_registry():
    yield
    ampc.policy.reset()
    assert not torch.is_autocast_enabled("cpu") and AC._st.depth == 0


@pytest.mark.smoke
def test_torch_getters_report_an_ampc_region():
    assert not torch.is_autocast_enabled("cpu")
    with ampc.autocast("cpu", dtype=FP16, cache_enabled=False):
        assert torch.is_autocast_enabled("cpu") and not torch.is_autocast_enabled("cuda")
        assert torch.get_autocast_dtype("cpu") is FP16
        assert not torch.is_autocast_cache_enabled()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")     # the legacy getters are deprecated
            assert torch.is_autocast_cpu_enabled() and torch.get_autocast_cpu_dtype() is FP16
        with ampc.autocast("cpu", enabled=False):
            assert not torch.is_autocast_enabled("cpu")
        assert torch.is_autocast_enabled("cpu")
    assert not torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") is BF16
    assert torch.is_autocast_cache_enabled()


def _run(outer, inner):
    """(x @ y in ``outer``; x @ y and a Linear in ``inner`` nested in it; x @ y after
    ``inner`` exits). The Linear runs in one region only: torch's own cache keeps one cast
    per weight whatever the dtype, so torch fails on a weight used under two dtypes."""
    lin = nn.Linear(8, 8)
    a, b = mats()
    with outer:
        before = a @ b
        with inner:
            mid = (a @ b, lin(a))
        after = (a @ b,)
    return before, mid, after


def _same(x, y):
    return x.dtype == y.dtype and torch.equal(x, y)


@pytest.mark.parametrize("outer_args, inner_args", [
    (dict(), dict(enabled=False)),
    (dict(), dict(dtype=FP16)),
    (dict(dtype=FP16), dict()),
    (dict(enabled=False), dict()),
    (dict(), dict(cache_enabled=False)),
])
@pytest.mark.parametrize("kinds", ["ampc in torch", "torch in ampc", "ampc in ampc"])
def test_nested_regions_behave_as_two_torch_regions(kinds, outer_args, inner_args):
    outer_cls, inner_cls = {"ampc in torch": (torch.autocast, ampc.autocast),
                            "torch in ampc": (ampc.autocast, torch.autocast),
                            "ampc in ampc": (ampc.autocast, ampc.autocast)}[kinds]
    torch.manual_seed(1)
    want = _run(torch.autocast("cpu", **outer_args), torch.autocast("cpu", **inner_args))
    torch.manual_seed(1)
    got = _run(outer_cls("cpu", **outer_args), inner_cls("cpu", **inner_args))
    assert _same(want[0], got[0])
    assert all(_same(w, g) for w, g in zip(want[1] + want[2], got[1] + got[2]))


@pytest.mark.smoke
def test_nested_torch_disable_keeps_a_loss_in_fp32():
    a, b = mats()
    with ampc.autocast("cpu"):
        assert (a @ b).dtype is BF16
        with torch.autocast("cpu", enabled=False):
            assert (a @ b).dtype is FP32 and F.linear(a, b).dtype is FP32
            assert not ampc.is_autocast_enabled("cpu")
        assert (a @ b).dtype is BF16


@pytest.mark.smoke
def test_policy_edits_win_over_torch_lists_inside_regions():
    a, b = mats()
    ampc.policy.set_policy("mm", "fp32", device_type="cpu")
    ampc.policy.set_policy("softmax", "fp32_set_opt_dtype", device_type="cpu")
    ref = torch.mm(a, b)
    for region in (lambda: ampc.autocast("cpu"), lambda: torch.autocast("cpu")):
        with ampc.autocast("cpu"), region():
            assert torch.is_autocast_enabled("cpu")
            assert torch.mm(a, b).dtype is FP32 and torch.equal(torch.mm(a, b), ref)
            assert (a @ b).dtype is BF16                      # matmul keeps torch's list
            assert torch.softmax(a.bfloat16(), 0).dtype is FP32
    with torch.autocast("cpu"):                           # a torch region alone: torch's lists
        assert torch.mm(a, b).dtype is BF16


def test_passthrough_edit_turns_torchs_cast_off():
    a, b = mats()
    ampc.policy.set_policy("mm", "passthrough", device_type="cpu")
    with ampc.autocast("cpu"):
        assert torch.mm(a, b).dtype is FP32 and torch.mm(a, b.bfloat16().float()).dtype is FP32
        assert torch.equal(torch.mm(a, b), a.mm(b))


def test_scopes_move_torchs_state_so_ops_inside_composites_follow():
    a, b = mats()
    three = torch.randn(2, 8, 8)
    with ampc.autocast("cpu"):
        with ampc.policy.scope(dtype=FP32):
            assert torch.get_autocast_dtype("cpu") is FP32
            # einsum is a C++ composite: torch's autocast casts the bmm inside it
            assert torch.einsum("bij,bjk->bik", three, three).dtype is FP32
        with ampc.policy.scope(enabled=False):
            assert not torch.is_autocast_enabled("cpu") and (a @ b).dtype is FP32
            with ampc.policy.scope(enabled=True):
                assert torch.is_autocast_enabled("cpu") and (a @ b).dtype is BF16
        assert torch.get_autocast_dtype("cpu") is BF16
        assert torch.einsum("bij,bjk->bik", three, three).dtype is BF16
    with ampc.policy.scope(dtype=FP16):        # outside a region a scope changes nothing
        assert not torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") is BF16


def test_edited_op_inside_a_python_composite_is_seen():
    mha = nn.MultiheadAttention(16, 2, batch_first=True)
    x = torch.randn(2, 5, 16)
    seen = []
    real = torch.softmax

    def spy(*args, **kwargs):
        seen.append(args[0].dtype)
        return real(*args, **kwargs)

    spied = ampc.policy.register(spy, policy="fp32", device_type="cpu", name="softmax_spy")
    ampc.policy.set_policy("softmax", "fp32", device_type="cpu")
    with ampc.autocast("cpu"):
        out, w = mha(x, x, x)
        assert F.softmax(torch.randn(3, dtype=BF16), 0).dtype is FP32
        assert spied(torch.randn(3), 0).dtype is FP32 and seen == [FP32]
    assert out.dtype is BF16 and w.dtype is FP32      # the attention weights came from the fp32 softmax


# ---- the CPU differences a Python-level mode had, gone ----

def _both(fn, *args):
    outs = []
    for region in (torch.autocast("cpu"), ampc.autocast("cpu")):
        torch.manual_seed(0)
        with region:
            outs.append(fn(*args))
    return outs


def _assert_same(want, got):
    if isinstance(want, torch.Tensor):
        assert want.dtype == got.dtype and torch.equal(want, got), (want.dtype, got.dtype)
    else:
        for w, g in zip(want, got):
            _assert_same(w, g)


@pytest.mark.parametrize("mode", ["reflect", "replicate"])
def test_pad_reflect_and_replicate_match_torch(mode):
    x = torch.randn(1, 2, 6, 6, dtype=BF16)
    want, got = _both(lambda t: F.pad(t, (1, 1, 2, 2), mode=mode), x)
    assert want.dtype is FP32
    _assert_same(want, got)


def test_bilinear_pinv_gru_and_one_operand_einsum_match_torch():
    torch.manual_seed(0)
    x1, x2, w = torch.randn(4, 5), torch.randn(4, 6), torch.randn(3, 5, 6)
    _assert_same(*_both(F.bilinear, x1, x2, w))
    _assert_same(*_both(torch.linalg.pinv, torch.randn(6, 4)))
    gru = nn.GRU(8, 16, batch_first=True)
    _assert_same(*_both(gru, torch.randn(2, 5, 8)))
    want, got = _both(lambda t: torch.einsum("ii->i", t), torch.randn(5, 5))
    assert want.dtype is FP32
    _assert_same(want, got)


# ---- backward runs outside the mode; custom_fwd / custom_bwd ----

class _Probe(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, g):
        ctx.modes = torch._C._len_torch_function_stack()
        _Probe.seen = ctx.modes
        return g * 2


@pytest.mark.parametrize("how", ["Tensor.backward", "autograd.backward", "autograd.grad"])
@pytest.mark.parametrize("edited", [False, True])
def test_backward_runs_outside_the_mode(how, edited):
    if edited:       # edits make the mode follow Python composites: backward must not be one
        ampc.policy.set_policy("softmax", "fp32", device_type="cpu")
    x = torch.randn(4, requires_grad=True)
    _Probe.seen = None
    with ampc.autocast("cpu"):
        loss = _Probe.apply(x).sum()
        hooked = []
        x.register_hook(lambda g: hooked.append(torch._C._len_torch_function_stack()))
        {"Tensor.backward": lambda: loss.backward(),
         "autograd.backward": lambda: torch.autograd.backward(loss),
         "autograd.grad": lambda: torch.autograd.grad(loss, x)}[how]()
    assert _Probe.seen == 0 and hooked == [0]


class _TorchFP32(torch.autograd.Function):
    @staticmethod
    @torch.amp.custom_fwd(device_type="cpu", cast_inputs=FP32)
    def forward(ctx, a, b):
        ctx.inside = (a.dtype, b.dtype, torch.is_autocast_enabled("cpu"), (a @ b).dtype)
        ctx.save_for_backward(a, b)
        return a @ b

    @staticmethod
    @torch.amp.custom_bwd(device_type="cpu")
    def backward(ctx, g):
        a, b = ctx.saved_tensors
        ctx.bwd = (torch.is_autocast_enabled("cpu"), (g @ b.t()).dtype)
        return g @ b.t(), a.t() @ g


class _AmpcPlain(torch.autograd.Function):
    @staticmethod
    @ampc.custom_fwd(device_type="cpu")
    def forward(ctx, a, b):
        return a @ b

    @staticmethod
    @ampc.custom_bwd(device_type="cpu")
    def backward(ctx, g):
        ctx.bwd = (torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"), (g @ g.t()).dtype)
        return g, g


def test_torch_custom_fwd_with_cast_inputs_runs_in_fp32_in_an_ampc_region():
    a, b = mats(requires_grad=True)
    with ampc.autocast("cpu"):
        out = _TorchFP32.apply(a.bfloat16(), b)
    assert out.dtype is FP32
    node = out.grad_fn
    assert node.inside == (FP32, FP32, False, FP32)
    out.sum().backward()
    assert node.bwd == (False, FP32) and a.grad.dtype is FP32


def test_ampc_custom_bwd_runs_backward_under_the_forwards_state():
    a, b = mats(requires_grad=True)
    with ampc.autocast("cpu", dtype=FP16):
        out = _AmpcPlain.apply(a, b)
    assert out.dtype is FP16
    node = out.grad_fn
    out.float().sum().backward()
    assert node.bwd == (True, FP16, FP16)


# ---- a weight whose storage was freed (FSDP2 between uses) ----

@pytest.mark.parametrize("fused", [True, False])
def test_freed_weight_storage_never_reaches_the_cast_kernel(fused, monkeypatch):
    monkeypatch.setitem(_weight_cache.FUSED, "cpu", fused)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    x = torch.randn(2, 8)
    with ampc.autocast("cpu"):
        model(x)                                 # the cache learns both layers' weights
    w = model[0].weight
    saved = w.detach().clone()
    nbytes = w.untyped_storage().nbytes()
    w.untyped_storage().resize_(0)               # freed, as FSDP2 does between uses
    with ampc.autocast("cpu"):
        with pytest.raises(RuntimeError, match="data is not allocated"):
            model(x)                             # a clear error from torch, no crash
        assert model[1](x).dtype is BF16         # the other layer casts as usual
    w.untyped_storage().resize_(nbytes)          # gathered again before its next use
    with torch.no_grad():
        w.copy_(saved)
    with ampc.autocast("cpu"):
        got = model(x)
    with torch.autocast("cpu"):
        want = model(x)
    assert torch.equal(got, want)


def test_a_change_reaches_open_regions_that_have_the_mode_on_and_later_ones():
    a, b = mats()
    ampc.policy.set_policy("addmv", "fp32", device_type="cpu")     # a change: the mode is on
    with ampc.autocast("cpu"):
        assert torch.mm(a, b).dtype is BF16
        ampc.policy.set_policy("mm", "fp32", device_type="cpu")
        assert torch.mm(a, b).dtype is FP32           # from the next call on
    ampc.policy.reset()
    with ampc.autocast("cpu"):                       # no changes: torch's autocast alone
        assert torch._C._len_torch_function_stack() == 0
        ampc.policy.set_policy("mm", "fp32", device_type="cpu")
        assert torch.mm(a, b).dtype is BF16           # this region leaves everything to torch
    with ampc.autocast("cpu"):
        assert torch.mm(a, b).dtype is FP32           # the next one sees the change
