"""ampc.GradScaler with ampc.optim's optimizers, on the CPU.

Exact: ampc's scaler and torch's drive ampc.optim.AdamW through the same protocol and
must give the same bits; folding the unscale into the step gives the bits of unscale_
then step. Clipped steps agree to rel 1e-5 (the norm is measured differently, see
test_grad_scaler_extras.py). fp16 training is judged by its loss against fp32 training.
"""
import math

import pytest
import torch

import ampc
from test_grad_scaler import INF, NAN, PLANTS, assert_same_trace, make_model, train
from test_grad_scaler_extras import SyncCounter, batch16

SCALERS = {"ampc": ampc.GradScaler, "torch": torch.amp.GradScaler}


def adamw(model):
    return ampc.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)


def run(scaler_cls, steps=12, unscale=False, clip=None, fold_clip=None):
    model = make_model()
    opt = adamw(model)
    scaler = scaler_cls("cpu", init_scale=2.0 ** 12, growth_interval=3)
    norms = []

    def clip_folded(s, step):
        norms.append(s.clip_grad_norm_(opt, fold_clip))

    trace = train(scaler, model, opt, steps, PLANTS, unscale=unscale, clip=clip,
                  before_step=clip_folded if fold_clip else None)
    return trace, opt, norms


@pytest.mark.smoke
def test_same_bits_as_torch_scaler():
    ours, opt, _ = run(ampc.GradScaler)
    theirs, their_opt, _ = run(torch.amp.GradScaler)
    assert_same_trace(ours, theirs, "ampc.optim.AdamW")
    # skipped steps are skipped on the device: the step count only counts the others
    steps = [float(opt.state[p]["step"]) for p in opt.param_groups[0]["params"]]
    assert steps == [12.0 - len(PLANTS)] * len(steps)


def test_folded_unscale_gives_the_bits_of_unscale_then_step():
    folded, _, _ = run(ampc.GradScaler)
    unscaled, _, _ = run(ampc.GradScaler, unscale=True)
    assert_same_trace(folded, unscaled, "folded vs unscale_")


def test_folded_clip_matches_unscale_then_clip():
    ours, _, norms = run(ampc.GradScaler, fold_clip=0.05)
    theirs, _, _ = run(torch.amp.GradScaler, unscale=True, clip=0.05)
    clipped = 0
    for step, (o, t) in enumerate(zip(ours, theirs)):
        assert o[:3] == t[:3], f"step {step}: {o[:3]} vs {t[:3]}"
        for a, b in zip(o[3], t[3]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        clipped += math.isfinite(norms[step]) and float(norms[step]) > 0.05
    assert clipped >= 3, "max_norm never clipped: the test is not testing"
    unclipped, _, _ = run(ampc.GradScaler, fold_clip=1e6)
    assert_same_trace(unclipped, run(torch.amp.GradScaler, unscale=True, clip=1e6)[0],
                      "folded clip that does not clip")


@pytest.mark.smoke
def test_no_host_sync_in_the_whole_step(monkeypatch):
    model = make_model(dtype=torch.float16)
    opt = ampc.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = ampc.GradScaler("cpu", init_scale=1024.0, min_scale=1.0, hysteresis=2)
    counter = SyncCounter(monkeypatch)
    for step in range(5):
        opt.zero_grad()
        x, y = batch16(step)
        loss = torch.nn.functional.mse_loss(model(x).float(), y)
        counter.paused = True
        scaler.scale(loss).backward()
        counter.paused = False
        scaler.clip_grad_norm_(opt, 0.5)
        scaler.step(opt)                 # the optimizer's own step is counted too
        scaler.update()
        assert counter.calls == [], f"step {step}: host reads {counter.calls}"


def _fp16_training(make, steps=80):
    """Trains an fp16 model (fp32 for make=None) on a linear target; returns the losses."""
    model = make_model()
    if make is not None:
        model = model.half()
    opt, scaler, clip = make(model) if make else (
        torch.optim.AdamW(model.parameters(), lr=1e-2), None, None)
    losses = []
    for step in range(steps):
        opt.zero_grad()
        x, y = batch16(step)
        loss = torch.nn.functional.mse_loss(model(x if make else x.float()).float(), y)
        if scaler is None:
            loss.backward()
            opt.step()
        else:
            scaler.scale(loss).backward()
            clip(scaler, opt)
            scaler.step(opt)
            scaler.update()
        losses.append(loss.item())
    return losses


def test_fp16_master_weights_train_where_torch_cannot():
    def torch_setup(model):
        return (torch.optim.AdamW(model.parameters(), lr=1e-2),
                torch.amp.GradScaler("cpu"), lambda s, o: s.unscale_(o))

    def ampc_setup(model):
        return (ampc.optim.AdamW(model.parameters(), lr=1e-2),
                ampc.GradScaler("cpu", enabled="auto", dtype=torch.float16),
                lambda s, o: s.clip_grad_norm_(o, 1.0))

    with pytest.raises(ValueError, match="^Attempting to unscale FP16 gradients.$"):
        _fp16_training(torch_setup, steps=1)
    ours, fp32 = _fp16_training(ampc_setup), _fp16_training(None)
    assert all(math.isfinite(v) for v in ours)
    assert ours[-1] < 0.05 * ours[0], f"no convergence: {ours[0]} -> {ours[-1]}"
    tail = sum(ours[-10:]) / 10
    assert abs(tail - sum(fp32[-10:]) / 10) < 0.1 * tail + 1e-3, f"{ours[-10:]} vs {fp32[-10:]}"


def test_bf16_and_fp16_planted_infs_skip_everything():
    for dtype in (torch.float16, torch.bfloat16):
        model = make_model(dtype=dtype)
        opt = ampc.optim.AdamW(model.parameters(), lr=1e-2)
        scaler = ampc.GradScaler("cpu", init_scale=256.0)
        x, y = batch16(0)
        scaler.scale(torch.nn.functional.mse_loss(model(x.to(dtype)).float(), y)).backward()
        list(model.parameters())[1].grad[0] = NAN if dtype == torch.float16 else INF
        before = [p.detach().clone() for p in model.parameters()]
        masters = [opt.state[p].get("master") for p in model.parameters()]
        scaler.clip_grad_norm_(opt, 1.0)
        scaler.step(opt)
        scaler.update()
        assert all(b.equal(p) for b, p in zip(before, model.parameters())), dtype
        assert all(float(opt.state[p]["step"]) == 0 for p in model.parameters()), dtype
        assert masters == [None] * 4 or all(m is None or m.isfinite().all() for m in masters)
        assert bool(scaler.last_step_skipped()) and scaler.get_scale() == 128.0, dtype
