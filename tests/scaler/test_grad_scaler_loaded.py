"""A freshly loaded scaler is whole at once: every getter reports the checkpoint's values
before the first scale(), as torch's get_scale() does. Frameworks load checkpoints before
the first step and read the scaler then (to log it, to decide on a skipped step).

The checkpoint comes from a short run with one planted inf (so it holds a skipped step, a
backed-off scale and a growth tracker that is not zero), travels through torch.save and
torch.load(weights_only=True), and is loaded into scalers built with other settings,
dynamic and static. Each getter torch has is compared with torch.amp.GradScaler's on the
same checkpoint; ampc's own getters with the checkpoint's values and with what the same
scaler reports after its first scale().
"""
import io

import pytest
import torch

import ampc
from test_grad_scaler import INF, backward, make_model

# torch's getters; the growth tracker is private but frameworks' tests read it
TORCH_GETTERS = ("get_scale", "get_growth_factor", "get_backoff_factor",
                 "get_growth_interval", "_get_growth_tracker", "is_enabled")


def _checkpoint(dynamic, hysteresis=1):
    """A scaler's state after 5 steps with an inf at step 1, through torch.save and
    torch.load(weights_only=True)."""
    model = make_model()
    opt = ampc.optim.AdamW(model.parameters(), lr=1e-2)
    kwargs = dict(init_scale=256.0, growth_interval=5, hysteresis=hysteresis)
    if dynamic:
        kwargs.update(growth_factor=4.0, backoff_factor=0.25)
    scaler = ampc.GradScaler("cpu", dynamic=dynamic, **kwargs)
    for step in range(5):
        opt.zero_grad()
        backward(scaler, model, step, {1: [(INF, 0, 1)]})
        scaler.step(opt)
        scaler.update()
    buf = io.BytesIO()
    torch.save(scaler.state_dict(), buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def _ampc_getters(scaler):
    return {"skipped_steps": int(scaler.skipped_steps()),
            "last_step_skipped": bool(scaler.last_step_skipped()),
            "_get_hysteresis_tracker": scaler._get_hysteresis_tracker(),
            "is_dynamic": scaler.is_dynamic(),
            "state_dict": scaler.state_dict(),
            **{name: getattr(scaler, name)() for name in TORCH_GETTERS}}


CASES = {"dynamic": (True, 1), "static": (False, 1), "hysteresis": (True, 3)}


@pytest.mark.parametrize("ckpt_case", CASES)
@pytest.mark.parametrize("fresh_dynamic", [True, False], ids=["into_dynamic", "into_static"])
def test_loaded_scaler_reports_the_checkpoint_at_once(ckpt_case, fresh_dynamic):
    dynamic, hysteresis = CASES[ckpt_case]
    sd = _checkpoint(dynamic, hysteresis)
    assert sd["_skipped_steps"] == 1 and sd["_last_step_skipped"] is False
    assert sd["_growth_tracker"] == 3
    # backed off once (x0.25) unless static or held by hysteresis
    assert sd["scale"] == (64.0 if dynamic and hysteresis == 1 else 256.0)

    ours = ampc.GradScaler("cpu", dynamic=fresh_dynamic)
    ours.load_state_dict(sd)
    theirs = torch.amp.GradScaler("cpu")
    theirs.load_state_dict(sd)
    for name in TORCH_GETTERS:
        assert getattr(ours, name)() == getattr(theirs, name)(), name

    before = _ampc_getters(ours)
    assert before["skipped_steps"] == 1
    assert before["last_step_skipped"] is False
    assert before["is_dynamic"] == dynamic
    assert before["_get_hysteresis_tracker"] == sd["_hysteresis_tracker"]
    assert before["state_dict"] == sd
    assert before["get_scale"] == sd["scale"]
    assert before["_get_growth_tracker"] == sd["_growth_tracker"]

    ours.scale(torch.ones(()))          # the device state is made from the loaded values
    assert _ampc_getters(ours) == before


def test_loaded_last_step_skipped_and_a_second_load():
    sd = _checkpoint(True)
    sd.update(_last_step_skipped=True, _skipped_steps=7)
    scaler = ampc.GradScaler("cpu", dynamic=False)
    scaler.load_state_dict(sd)
    assert bool(scaler.last_step_skipped()) and int(scaler.skipped_steps()) == 7
    scaler.scale(torch.ones(()))
    assert bool(scaler.last_step_skipped()) and int(scaler.skipped_steps()) == 7
    # loading again into a scaler that has its device state replaces it
    sd.update(_last_step_skipped=None, _skipped_steps=2, scale=8.0)
    scaler.load_state_dict(sd)
    assert not bool(scaler.last_step_skipped()) and int(scaler.skipped_steps()) == 2
    assert scaler.get_scale() == 8.0


def test_torch_checkpoint_loads_with_zero_counters_before_the_first_scale():
    theirs = torch.amp.GradScaler("cpu", init_scale=32.0, growth_interval=5)
    theirs._lazy_init_scale_growth_tracker(torch.device("cpu"))
    theirs._growth_tracker.fill_(3)
    sd = theirs.state_dict()
    ours = ampc.GradScaler("cpu", dynamic=False)
    ours.load_state_dict(sd)
    assert (ours.get_scale(), ours._get_growth_tracker()) == (32.0, 3)
    assert (int(ours.skipped_steps()), bool(ours.last_step_skipped())) == (0, False)
    assert ours.is_dynamic()


def test_fresh_scaler_getters_unchanged():
    scaler = ampc.GradScaler("cpu", init_scale=16.0)
    assert int(scaler.skipped_steps()) == 0 and not bool(scaler.last_step_skipped())
    assert scaler.get_scale() == 16.0 and scaler._get_growth_tracker() == 0
    off = ampc.GradScaler("cpu", enabled=False)
    assert int(off.skipped_steps()) == 0 and off.get_scale() == 1.0
