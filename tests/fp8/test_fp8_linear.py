"""ampc.fp8.Linear and ampc.fp8.autocast: the forward and backward against a reference
built from torch's own casts and a float64 matmul, the scaling state and its updates, the
state_dict, conversion of nn.Linear, the region's rules and errors."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ampc
from ampc import fp8


E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FMAX = {E4M3: 448.0, E5M2: 57344.0}


def q(x, scale, dtype):
    """The scaled cast as its contract states it, in torch."""
    return (x.float() * scale).clamp(-FMAX[dtype], FMAX[dtype]).to(dtype)


def new_scale(amaxes, old, fmax, margin=0):
    """TransformerEngine's rule on a history's amax."""
    sf = torch.tensor(fmax, dtype=torch.float32) / amaxes / 2.0 ** margin
    ok = (amaxes > 0) & torch.isfinite(amaxes) & torch.isfinite(sf)
    return torch.where(ok, sf, old)


def make(in_f=32, out_f=48, bias=True, seed=0):
    torch.manual_seed(seed)
    return fp8.Linear(in_f, out_f, bias=bias)


def test_outside_a_region_it_is_nn_linear():
    lin = make()
    ref = nn.Linear(32, 48)
    ref.load_state_dict(lin.state_dict(), strict=False)
    x = torch.randn(5, 32)
    assert torch.equal(lin(x), ref(x))
    assert isinstance(lin, nn.Linear)


@pytest.mark.parametrize("rows", [32, 20])         # 20: the weight gradient pads to 32
def test_first_step_forward_and_backward_match_the_reference(rows):
    lin = make()
    x = torch.randn(rows, 32, requires_grad=True)
    dy = torch.randn(rows, 48) * 1e-3
    with fp8.autocast(recipe=fp8.DelayedScaling(amax_history_len=8)):
        y = lin(x)
    y.backward(dy)
    # first step: every scale is 1
    x8, w8, dy8 = q(x.detach(), 1.0, E4M3), q(lin.weight.detach(), 1.0, E4M3), q(dy, 1.0, E5M2)
    y_ref = x8.double() @ w8.double().t() + lin.bias.double()
    dx_ref = dy8.double() @ w8.double()
    dw_ref = dy8.double().t() @ x8.double()
    for ours, ref in ((y, y_ref), (x.grad, dx_ref), (lin.weight.grad, dw_ref)):
        assert ours.dtype == torch.float32
        assert torch.allclose(ours.double(), ref, rtol=1e-5, atol=1e-6 * ref.abs().max().item())
    assert torch.equal(lin.bias.grad, dy.sum(0))
    # the amaxes went into row 0 of the histories, the scales follow TE's rule
    amax_fwd = torch.stack([x.detach().abs().max(), lin.weight.detach().abs().max()])
    assert torch.equal(lin.fp8_fwd_amax_history[0], amax_fwd)
    assert not lin.fp8_fwd_amax_history[1:].any()
    assert torch.allclose(lin.fp8_fwd_scale, new_scale(amax_fwd, torch.ones(2), 448.0), rtol=1e-6)
    assert torch.allclose(lin.fp8_fwd_scale_inv, 1 / lin.fp8_fwd_scale, rtol=1e-6)
    amax_bwd = dy.abs().max().reshape(1)
    assert torch.equal(lin.fp8_bwd_amax_history[0], amax_bwd)
    assert torch.allclose(lin.fp8_bwd_scale, new_scale(amax_bwd, torch.ones(1), 57344.0), rtol=1e-6)


def test_second_step_casts_with_the_delayed_scales():
    lin = make(bias=False)
    recipe = fp8.DelayedScaling(amax_history_len=4, margin=1)
    x1, x2 = torch.randn(16, 32), torch.randn(16, 32) * 3
    with fp8.autocast(recipe=recipe):
        lin(x1)
        scale = lin.fp8_fwd_scale.clone()
        y2 = lin(x2)
    assert torch.allclose(scale, new_scale(torch.stack([x1.abs().max(), lin.weight.abs().max()]),
                                           torch.ones(2), 448.0, margin=1), rtol=1e-6)
    x8, w8 = q(x2, scale[0], E4M3), q(lin.weight.detach(), scale[1], E4M3)
    ref = (x8.double() @ w8.double().t()) / (scale[0].double() * scale[1].double())
    assert torch.allclose(y2.double(), ref, rtol=1e-5, atol=1e-6 * ref.abs().max().item())
    # "max" over the history: x1's amax is smaller, x2's now leads
    assert torch.equal(lin.fp8_fwd_amax_history[1, 0], x1.abs().max())
    assert torch.equal(lin.fp8_fwd_amax_history[0, 0], x2.abs().max())


def test_current_scaling_uses_this_steps_amax():
    lin = make(bias=False)
    x = torch.randn(16, 32) * 100
    with fp8.autocast(recipe=fp8.Float8CurrentScaling()):
        y = lin(x)
    assert lin.fp8_fwd_amax_history.shape == (1, 2)
    s = new_scale(torch.stack([x.abs().max(), lin.weight.abs().max()]), torch.ones(2), 448.0)
    x8, w8 = q(x, s[0], E4M3), q(lin.weight.detach(), s[1], E4M3)
    ref = (x8.double() @ w8.double().t()) / (s[0].double() * s[1].double())
    assert torch.allclose(y.double(), ref, rtol=1e-5, atol=1e-6 * ref.abs().max().item())


def test_format_e4m3_casts_the_gradient_to_e4m3():
    lin = make(bias=False)
    x = torch.randn(16, 32, requires_grad=True)
    dy = torch.randn(16, 48)
    with fp8.autocast(recipe=fp8.DelayedScaling(fp8_format=fp8.Format.E4M3)):
        lin(x).backward(dy)
    w8 = q(lin.weight.detach(), 1.0, E4M3)
    ref = q(dy, 1.0, E4M3).double() @ w8.double()
    assert torch.allclose(x.grad.double(), ref, rtol=1e-5, atol=1e-6 * ref.abs().max().item())
    assert torch.allclose(lin.fp8_bwd_scale, new_scale(dy.abs().max().reshape(1), torch.ones(1),
                                                       448.0), rtol=1e-6)


def test_under_torch_autocast_the_output_is_bf16_and_3d_inputs_work():
    lin = make()
    x = torch.randn(2, 8, 32, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16), fp8.autocast():
        y = lin(x)
    assert y.dtype == torch.bfloat16 and y.shape == (2, 8, 48)
    y.float().sum().backward()
    assert x.grad.shape == x.shape and x.grad.dtype == torch.float32
    assert lin.weight.grad.dtype == torch.float32


def test_autocast_converts_nn_linear_children_and_not_others():
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 16), nn.Conv1d(2, 2, 1))
    with fp8.autocast():
        model[:3](torch.randn(16, 32))
    assert type(model[0]) is fp8.Linear and type(model[2]) is fp8.Linear
    assert type(model[3]) is nn.Conv1d
    with fp8.autocast(modules=()):
        other = nn.Sequential(nn.Linear(32, 32))
        other(torch.randn(16, 32))
    assert type(other[0]) is nn.Linear


def test_disabled_and_nested_regions():
    lin = make()
    x = torch.randn(16, 32)
    plain = F.linear(x, lin.weight, lin.bias)
    with fp8.autocast():
        with fp8.autocast(enabled=False):
            assert torch.equal(lin(x), plain)
        assert not torch.equal(lin(x), plain)
    assert torch.equal(lin(x), plain)


def test_state_dict_keys_and_loading_plain_and_resized_states():
    lin = make()
    keys = set(lin.state_dict())
    assert keys == {"weight", "bias", "fp8_fwd_amax_history", "fp8_fwd_scale",
                    "fp8_fwd_scale_inv", "fp8_bwd_amax_history", "fp8_bwd_scale",
                    "fp8_bwd_scale_inv"}
    # an nn.Linear checkpoint loads strictly: the FP8 state starts afresh
    plain = nn.Linear(32, 48)
    lin.load_state_dict(plain.state_dict())
    assert torch.equal(lin.weight, plain.weight) and (lin.fp8_fwd_scale == 1).all()
    # a state with another history length loads with that length
    with fp8.autocast(recipe=fp8.DelayedScaling(amax_history_len=3)):
        lin(torch.randn(16, 32))
    other = make()
    other.load_state_dict(lin.state_dict())
    assert other.fp8_fwd_amax_history.shape == (3, 2)
    assert torch.equal(other.fp8_fwd_amax_history, lin.fp8_fwd_amax_history)
    assert torch.equal(other.fp8_fwd_scale, lin.fp8_fwd_scale)


def test_convert_keeps_the_parameters():
    torch.manual_seed(2)
    model = nn.Sequential(nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 16))
    w = model[0].weight
    fp8.convert(model)
    assert type(model[0]) is fp8.Linear and model[0].weight is w
    assert "0.fp8_fwd_scale" in model.state_dict()


def test_errors():
    with pytest.raises(ValueError, match="ampc.fp8.Linear: .*multiples of 16, got 20 and 48"):
        with fp8.autocast():
            fp8.Linear(20, 48)(torch.randn(16, 20))
    with pytest.raises(TypeError, match="ampc.fp8.autocast: recipe must be"):
        fp8.autocast(recipe="delayed")
    with pytest.raises(TypeError, match="ampc.fp8.autocast: modules"):
        fp8.autocast(modules=(nn.Conv1d,))
    with pytest.raises(ValueError, match="ampc.fp8.DelayedScaling: amax_history_len"):
        fp8.DelayedScaling(amax_history_len=0)
    with pytest.raises(ValueError, match="ampc.fp8.DelayedScaling: amax_compute_algo"):
        fp8.DelayedScaling(amax_compute_algo="mean")
    with pytest.raises(ValueError, match="ampc.fp8.DelayedScaling: margin"):
        fp8.DelayedScaling(margin=-1)
    with pytest.raises(TypeError, match="ampc.fp8.Float8CurrentScaling: fp8_format"):
        fp8.Float8CurrentScaling(fp8_format="HYBRID")


def test_recipes_by_name_and_checked():
    from ampc.fp8.recipe import by_name, check_recipe
    assert by_name("delayed") == fp8.DelayedScaling() and type(by_name("delayed")) is fp8.DelayedScaling
    assert by_name("current") == fp8.Float8CurrentScaling()
    assert by_name("delayed") is not by_name("delayed")        # a new one each time
    for bad in ("Delayed", "mx", None, 1):
        with pytest.raises(ValueError, match=r"^ampc.autoprecision.search: fp8_recipe must be "
                                             r"'delayed' or 'current', got "):
            by_name(bad, "ampc.autoprecision.search: fp8_recipe")
    recipe = fp8.Float8CurrentScaling()
    assert check_recipe(recipe) is recipe
    for bad in ("delayed", True, fp8.Format.HYBRID):
        with pytest.raises(TypeError, match=r"^ampc.fp8.recipe.check_recipe: recipe must be an "
                                            r"ampc.fp8.DelayedScaling or ampc.fp8.Float8CurrentScaling, "
                                            rf"got {type(bad).__name__}$"):
            check_recipe(bad)


def test_the_region_leaves_no_hook_behind():
    from torch.nn.modules import module as m
    before = len(m._global_forward_pre_hooks)
    with fp8.autocast():
        with fp8.autocast():
            assert len(m._global_forward_pre_hooks) == before + 1
    assert len(m._global_forward_pre_hooks) == before


def test_bf16_weights_of_ampc_prepare_train_in_fp8():
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 16))
    model, opt = ampc.prepare(model, ampc.optim.AdamW, torch.bfloat16, lr=1e-2)
    x, y = torch.randn(32, 32), torch.randn(32, 16)
    losses = []
    for _ in range(20):
        opt.zero_grad()
        with fp8.autocast():
            out = model(x.to(torch.bfloat16))
        loss = F.mse_loss(out.float(), y)
        loss.backward()
        assert model[0].weight.grad.dtype == torch.bfloat16
        opt.step()
        losses.append(loss.item())
    assert type(model[0]) is fp8.Linear and model[0].weight.dtype == torch.bfloat16
    assert losses[-1] < 0.8 * losses[0]
