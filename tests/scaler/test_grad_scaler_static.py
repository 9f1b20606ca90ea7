"""Static loss scaling: ampc.GradScaler(..., dynamic=False), on the CPU.

The scale stays init_scale (or what update(new_scale) sets) whatever the gradients hold;
a step with an inf or a nan is still skipped and counted. Judged against a run that does
the same by hand (scale the loss, skip the step with a planted value, unscale the others
by the same fp32 reciprocal) and against torch's scaler made static through its setters
(growth and backoff factors 1.0, the form the checkpoint takes). All exact.
"""
import copy
import io

import pytest
import torch

import ampc
from test_grad_scaler import (INF, NAN, OPTIMIZERS, PLANTS, assert_same_trace, backward, batch,
                              make_model, plant, train)
from test_grad_scaler_extras import FoldingSGD

STEPS = 12


def static_torch(init_scale, **kw):
    """torch's scaler with a fixed scale: the form a static checkpoint takes."""
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale, **kw)
    scaler.set_growth_factor(1.0)
    scaler.set_backoff_factor(1.0)
    return scaler


def by_hand(make_opt, init_scale, steps, plants):
    """Loss times the scale, planted steps skipped, grads times float32(1/scale)."""
    model = make_model()
    opt = make_opt(model)
    inv = torch.tensor(1.0 / init_scale, dtype=torch.float64).float()
    params = []
    for step in range(steps):
        opt.zero_grad(set_to_none=step % 2 == 0)
        x, y = batch(step)
        (torch.nn.functional.mse_loss(model(x), y) * init_scale).backward()
        if step not in plants:
            for p in model.parameters():
                p.grad.mul_(inv)
            opt.step()
        params.append([p.detach().clone() for p in model.parameters()])
    return params


@pytest.mark.parametrize("init_scale", [1000.0, 2.0 ** 12])
@pytest.mark.parametrize("opt", ["sgd", "adam-single"])
def test_static_run_equals_skipping_by_hand(opt, init_scale):
    model = make_model()
    scaler = ampc.GradScaler("cpu", init_scale=init_scale, growth_interval=2, dynamic=False)
    trace = train(scaler, model, OPTIMIZERS[opt](model), STEPS, PLANTS)
    want = by_hand(OPTIMIZERS[opt], init_scale, STEPS, PLANTS)
    for step, (scale, _, ran, params) in enumerate(trace):
        assert scale == init_scale, f"step {step}: the scale moved to {scale}"
        assert (ran is None) == (step in PLANTS), f"step {step}: ran {ran}"
        for i, (a, b) in enumerate(zip(params, want[step])):
            assert a.equal(b), f"step {step} param {i}: {(a - b).abs().max()}"
    assert int(scaler.skipped_steps()) == len(PLANTS)
    assert not scaler.is_dynamic()
    assert (scaler.get_growth_factor(), scaler.get_backoff_factor()) == (1.0, 1.0)


@pytest.mark.parametrize("opt", ["sgd", "sgd-fused", "adamw-fused", "ampc-adamw", "folding"])
def test_static_matches_torch_with_factors_of_one(opt):
    make = {"ampc-adamw": lambda m: ampc.optim.AdamW(m.parameters(), lr=1e-2),
            "folding": lambda m: FoldingSGD(m.parameters(), lr=0.05)}.get(opt) or OPTIMIZERS[opt]
    traces = {}
    for name, scaler in {"ampc": ampc.GradScaler("cpu", init_scale=300.0, growth_interval=3,
                                                 dynamic=False),
                         "torch": static_torch(300.0, growth_interval=3)}.items():
        model = make_model()
        traces[name] = train(scaler, model, make(model), STEPS, PLANTS)
    assert_same_trace(traces["ampc"], traces["torch"], f"static {opt}")
    assert {t[0] for t in traces["ampc"]} == {300.0}
    assert any(t[1] == 0 for t in traces["ampc"][5:]), "the tracker never wrapped around"


def test_static_keeps_a_scale_set_by_hand_and_ignores_the_bounds():
    """update(new_scale) sets the scale, which then stays, also outside min/max_scale
    (the bounds belong to the dynamic rule); hysteresis changes nothing either."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = ampc.GradScaler("cpu", init_scale=512.0, growth_interval=1, dynamic=False,
                             hysteresis=2, min_scale=256.0, max_scale=1024.0)
    plants = {1: [(INF, 0, 0)], 4: [(NAN, 1, 0)], 5: [(NAN, 1, 0)], 6: [(NAN, 1, 0)]}
    scales, skipped = [], []
    for step in range(9):
        opt.zero_grad()
        backward(scaler, model, step, plants)
        scaler.step(opt)
        scaler.update(new_scale={2: 100.0, 7: torch.tensor(4096.0)}.get(step))
        scales.append(scaler.get_scale())
        skipped.append(bool(scaler.last_step_skipped()))
    assert scales == [512.0, 512.0] + [100.0] * 5 + [4096.0] * 2
    assert [s for s, v in enumerate(skipped) if v] == sorted(plants)
    assert int(scaler.skipped_steps()) == len(plants)


def test_static_scale_stuck_at_min_still_raises():
    # a fixed scale at or below min_scale that overflows every step is not training
    scaler = ampc.GradScaler("cpu", init_scale=1.0, dynamic=False, min_scale=1.0,
                             min_scale_patience=3)
    model = make_model()
    opt = FoldingSGD(model.parameters(), lr=0.05)
    with pytest.raises(RuntimeError, match="^ampc.GradScaler: 3 steps in a row had inf"):
        for step in range(10):
            opt.zero_grad()
            backward(scaler, model, step, {step: [(NAN, 0, 0)]})
            scaler.step(opt)
            scaler.update()
    assert step == 2 and scaler.get_scale() == 1.0


def _checkpoint(sd):
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    return torch.load(buf)          # weights_only: plain values only


@pytest.mark.parametrize("dst", ["ampc", "torch"])
def test_static_checkpoint_loads_and_stays_static(dst):
    """An ampc static checkpoint is growth and backoff factors 1.0 in torch's keys: torch's
    scaler loads it (a dynamic one, with its own factors) and continues exactly as ampc's."""
    model = make_model()
    opt = OPTIMIZERS["sgd"](model)
    scaler = ampc.GradScaler("cpu", init_scale=96.0, growth_interval=2, dynamic=False)
    train(scaler, model, opt, 4, {1: [(INF, 0, 0)]})
    sd = _checkpoint(scaler.state_dict())
    assert (sd["scale"], sd["growth_factor"], sd["backoff_factor"]) == (96.0, 1.0, 1.0)
    assert sd["_skipped_steps"] == 1
    target = {"ampc": ampc.GradScaler, "torch": torch.amp.GradScaler}[dst]("cpu")
    target.load_state_dict(sd)
    traces = []
    for s in (scaler, target):
        m = make_model()
        m.load_state_dict(model.state_dict())
        o = OPTIMIZERS["sgd"](m)
        o.load_state_dict(copy.deepcopy(opt.state_dict()))   # momentum not shared
        traces.append(train(s, m, o, 8, PLANTS))
    assert_same_trace(traces[1], traces[0], f"static checkpoint into {dst}")
    assert {t[0] for t in traces[1]} == {96.0}
    if dst == "ampc":
        assert not target.is_dynamic() and target.state_dict() == scaler.state_dict()


def test_torch_checkpoint_with_factors_of_one_loads_as_static():
    src = static_torch(64.0)
    src.scale(torch.ones(()))
    target = ampc.GradScaler("cpu")
    target.load_state_dict(src.state_dict())
    assert not target.is_dynamic() and target.get_scale() == 64.0
    target.load_state_dict(torch.amp.GradScaler("cpu").state_dict())   # and back
    assert target.is_dynamic() and target.get_growth_factor() == 2.0


@pytest.mark.parametrize("kwargs,message", [
    (dict(growth_factor=4.0), "dynamic=False keeps the scale fixed, so growth_factor and "
                              "backoff_factor do not apply; got growth_factor=4.0"),
    (dict(backoff_factor=0.25), "dynamic=False keeps the scale fixed"),
])
def test_static_refuses_factors(kwargs, message):
    with pytest.raises(ValueError, match="^ampc.GradScaler: " + message):
        ampc.GradScaler("cpu", dynamic=False, **kwargs)


def test_dynamic_must_be_a_bool_and_torch_errors_stay():
    with pytest.raises(ValueError, match="^ampc.GradScaler: dynamic must be a bool, got 'no'$"):
        ampc.GradScaler("cpu", dynamic="no")
    # torch's own spelling of a fixed scale keeps torch's error
    with pytest.raises(AssertionError, match="^The growth factor must be > 1.0.$"):
        ampc.GradScaler("cpu", growth_factor=1.0, backoff_factor=1.0)
    assert not ampc.GradScaler("cpu", dynamic=False, enabled=False).is_enabled()


def test_static_scale_of_a_planted_step_leaves_the_params():
    model = make_model()
    opt = FoldingSGD(model.parameters(), lr=0.05)
    scaler = ampc.GradScaler("cpu", init_scale=2.0 ** 15, dynamic=False)
    backward(scaler, model, 0, {})
    plant(model, INF, 2, 0)
    before = [p.detach().clone() for p in model.parameters()]
    scaler.step(opt)
    scaler.update()
    assert all(a.equal(b) for a, b in zip(before, model.parameters()))
    assert bool(scaler.last_step_skipped()) and scaler.get_scale() == 2.0 ** 15
