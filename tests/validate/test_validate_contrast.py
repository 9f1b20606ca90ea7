"""The contrast setups of compare() train what they say, fp16 without loss scaling fails
where torch.amp's scaler holds, and fp16_ready finds the module fp16 cannot hold."""
import functools
import importlib.util
import math
import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ampc import validate


def _example():
    """examples/fp16_contrast.py: its model, data and 1e-6-weighted objective (AdamW does
    not see the weight, so fp32 trains as usual, but the gradients at the output, ~1e-9,
    are under fp16's smallest subnormal 2**-24)."""
    path = os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, "examples",
                        "fp16_contrast.py")
    spec = importlib.util.spec_from_file_location("fp16_contrast", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


example = _example()
make_model, mse, tiny_loss = example.make_model, example.mse, example.tiny_loss
make_batch = functools.partial(example.make_batch, batch=64)


def direct(make_region, prepare, steps, lr):
    """The losses of a training loop written out by hand."""
    torch.manual_seed(0)
    model = prepare(make_model())
    opt = torch.optim.AdamW(model.parameters(), lr=lr, fused=True)     # as compare's
    losses = []
    for k in range(steps):
        x, y = make_batch(k)
        opt.zero_grad()
        with make_region():
            out = model(x)
        loss = mse(out, y)
        loss.backward()
        losses.append(loss.item())
        opt.step()
    return model, losses


def test_contrast_setups_are_named_and_not_defaults():
    assert set(validate.CONTRAST_SETUPS) == {"torch.amp.noscale", "pure"}
    assert set(validate.CONTRAST_SETUPS) <= set(validate.ALL_SETUPS)
    assert not set(validate.CONTRAST_SETUPS) & set(validate.SETUPS)


def test_noscale_is_torch_autocast_without_a_scaler():
    report = validate.compare(make_model, make_batch, mse, steps=5, lr=1e-2, device="cpu",
                              setups=("torch.amp.noscale@fp16",), seeds=(0,), progress=False)
    run = report.runs[0]
    assert run.name == "torch.amp.noscale fp16"
    assert run.scales == [1.0] * 5 and run.skipped == []
    _, losses = direct(lambda: torch.autocast("cpu", dtype=torch.float16), lambda m: m, 5, 1e-2)
    assert run.losses == pytest.approx(losses, rel=1e-6)


def test_pure_bf16_holds_bf16_weights_and_a_plain_optimizer():
    report = validate.compare(make_model, make_batch, mse, steps=5, lr=1e-2, device="cpu",
                              setups=("pure@bf16",), seeds=(0,), progress=False)
    run = report.runs[0]
    assert run.name == "pure bf16"
    assert all(p.dtype == torch.bfloat16 for p in run.model.parameters())
    assert type(run.optimizer) is torch.optim.AdamW          # no master copy anywhere
    assert all(s["exp_avg"].dtype == torch.bfloat16 for s in run.optimizer.state.values())

    def cast(m):
        m.to(torch.bfloat16)
        m.register_forward_pre_hook(lambda mod, args: tuple(a.bfloat16() for a in args))
        return m
    model, losses = direct(__import__("contextlib").nullcontext, cast, 5, 1e-2)
    assert run.losses == pytest.approx(losses, rel=1e-6)
    for a, b in zip(run.model.parameters(), model.parameters()):
        assert torch.equal(a, b)
    # and it is not fp32: the first step already differs from the fp32 run's weights
    assert report.base.losses[1] != run.losses[1]


def test_fp16_without_loss_scaling_fails_where_the_scaler_holds():
    report = validate.compare(make_model, make_batch, tiny_loss, steps=40, lr=1e-2, device="cpu",
                              setups=("torch.amp@fp16", "torch.amp.noscale@fp16", "pure@bf16"),
                              seeds=(0,), progress=False)
    base, scaled, unscaled, pure = report.base, *report.runs
    # the planted case is what it says: in fp16 the loss's gradient flushes to zero
    out = make_model()(make_batch(0)[0]).detach().requires_grad_()
    g = torch.autograd.grad(tiny_loss(out, make_batch(0)[1]), out)[0]
    assert g.abs().median() < 2.0 ** -25 and (g.half() == 0).float().mean() > 0.99
    assert base.losses[-1] < 0.2 * base.losses[0]                  # fp32 trains
    assert scaled.losses[-1] == pytest.approx(base.losses[-1], rel=0.02)
    assert pure.losses[-1] == pytest.approx(base.losses[-1], rel=0.05)
    assert unscaled.losses[-1] > 3 * base.losses[-1]               # stalled
    assert scaled.skipped == [] and scaled.scales[-1] >= 2.0 ** 15
    rows = {r["setup"]: r for r in report.rows}
    assert rows["torch.amp.noscale fp16"]["final_gap"] > 1.0
    assert rows["torch.amp fp16"]["final_gap"] < 0.02


@pytest.mark.parametrize("spec, match", [("pure@fp8", "dtype must be fp16 or bf16"),
                                         ("noscale", "unknown setup 'noscale'")])
def test_contrast_setup_bad_names(spec, match):
    with pytest.raises(ValueError, match=match):
        validate.compare(make_model, make_batch, steps=1, setups=(spec,), progress=False)


# ---- fp16_ready ----

class Boost(nn.Module):
    """Multiplies by 1e5: an output fp16 cannot hold (a bf16-trained layer's range)."""

    def forward(self, x):
        return x * 1e5


def ready_model(boost):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), *([Boost()] if boost else []), nn.LayerNorm(32),
                         nn.Linear(32, 4))


BATCHES = [(torch.randn(16, 8, generator=torch.Generator().manual_seed(k)),
            torch.randint(0, 4, (16,), generator=torch.Generator().manual_seed(k)))
           for k in range(2)]


def test_fp16_ready_passes_a_model_fp16_holds():
    report = validate.fp16_ready(ready_model(False), BATCHES)
    assert report.ready and report.overflow == [] and report.underflow == []
    assert [r["module"] for r in report.rows] == ["0", "1", "2"]
    assert "ready for fp16" in report.table()
    # fp16 autocast on the same model indeed gives a finite loss
    with torch.autocast("cpu", dtype=torch.float16):
        out = ready_model(False)(BATCHES[0][0])
    assert torch.isfinite(F.cross_entropy(out.float(), BATCHES[0][1]))


def test_fp16_ready_names_the_planted_overflowing_layer():
    model = ready_model(True)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    report = validate.fp16_ready(model, BATCHES)
    assert not report.ready and report.overflow == ["1"]
    row = next(r for r in report.rows if r["module"] == "1")
    ref = max(float((model[0](x) * 1e5).detach().abs().max()) for x, _ in BATCHES)
    assert row["type"] == "Boost" and row["max_output"] == pytest.approx(ref, rel=1e-6)
    assert "overflow in 1" in report.table()
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    assert all(p.grad is None for p in model.parameters())
    # what it predicts: in fp16 that layer's output is inf
    with torch.autocast("cpu", dtype=torch.float16):
        h = model[1](model[0](BATCHES[0][0]))
    assert torch.isinf(h.half()).any()


def test_fp16_ready_takes_a_bf16_model():
    model = ready_model(True).to(torch.bfloat16)
    report = validate.fp16_ready(model, [(x.bfloat16(), y) for x, y in BATCHES])
    assert report.overflow == ["1"]


def test_fp16_ready_finds_gradients_no_loss_scale_can_save():
    def tinier(out, y):
        return 1e-12 * F.cross_entropy(out.float(), y)
    report = validate.fp16_ready(ready_model(False), BATCHES, tinier, max_scale=2.0 ** 16)
    assert report.config["loss_scale"] == 2.0 ** 16
    assert set(report.underflow) == {"0", "1", "2"} and report.overflow == []
    # at the scale the model's own largest gradient allows, the same gradients are kept
    report = validate.fp16_ready(ready_model(False), BATCHES, tinier, max_scale=2.0 ** 60)
    assert report.ready
    assert report.config["loss_scale"] * report.config["max_grad"] <= 65504
    assert 2 * report.config["loss_scale"] * report.config["max_grad"] > 65504


def test_fp16_ready_buffers_are_restored():
    model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Linear(8, 4))
    before = model[1].running_mean.clone()
    validate.fp16_ready(model, BATCHES)
    assert torch.equal(model[1].running_mean, before)
    assert int(model[1].num_batches_tracked) == 0


@pytest.mark.parametrize("args, kwargs, error, match", [
    (("model", BATCHES), {}, TypeError, "fp16_ready: model must be an nn.Module"),
    ((None, BATCHES[0][0]), {}, TypeError, "fp16_ready: batches must be a list"),
    ((None, []), {}, ValueError, "fp16_ready: batches is empty"),
    ((None, [BATCHES[0][0]]), {}, TypeError, r"fp16_ready: batches\[0\] must be a pair"),
    ((None, BATCHES, 3), {}, TypeError, "fp16_ready: loss_fn must be callable"),
    ((None, BATCHES), {"max_scale": 0.5}, ValueError, "fp16_ready: max_scale"),
    ((None, BATCHES), {"max_scale": math.inf}, ValueError, "fp16_ready: max_scale"),
    ((None, BATCHES), {"tolerance": 1.5}, ValueError, "fp16_ready: tolerance"),
])
def test_fp16_ready_bad_arguments(args, kwargs, error, match):
    model = ready_model(False)
    args = (model if args[0] is None else args[0],) + args[1:]
    with pytest.raises(error, match=match):
        validate.fp16_ready(*args, **kwargs)


def test_fp16_ready_refuses_a_model_already_non_finite():
    model = ready_model(False)
    with torch.no_grad():
        model[1].weight[0] = math.inf
    with pytest.raises(ValueError, match="fp16_ready: module 1 gives non-finite output"):
        validate.fp16_ready(model, BATCHES)

    def nan_grad(out, y):      # finite forward, NaN gradients from the output on
        out.register_hook(lambda g: torch.full_like(g, math.nan))
        return F.cross_entropy(out.float(), y)
    with pytest.raises(ValueError, match="fp16_ready: module 2 gives non-finite gradients"):
        validate.fp16_ready(ready_model(False), BATCHES, nan_grad)
