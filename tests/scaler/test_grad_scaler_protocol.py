"""torch's optimizer protocol, to the letter: ampc.GradScaler and torch.amp.GradScaler drive
the same optimizers, and the optimizers see the same things.

- An optimizer whose step() takes the deprecated ``grad_scaler`` keyword gets the scaler
  itself, with torch's FutureWarning, and neither grad_scale nor found_inf.
- Otherwise an optimizer that unscales in its own step (_step_supports_amp_scaling) gets
  grad_scale = scale * its own grad_scale (1 if none), a new tensor that later updates do
  not change; after unscale_, what it holds itself. Both attributes are gone after step().
"""
import warnings

import pytest
import torch

import ampc
from test_grad_scaler import INF, PLANTS, assert_same_trace, backward, make_model, train
from test_grad_scaler_extras import FoldingSGD

SCALERS = {"ampc": ampc.GradScaler, "torch": torch.amp.GradScaler}


class ScalerKeywordSGD(torch.optim.Optimizer):
    """SGD in the old protocol, as torch's fused Adam used it: step(grad_scaler=) asks the
    scaler for the inf check and the scale, unscales, and skips a step with inf/nan."""

    _step_supports_amp_scaling = True
    _ampc_supports_clip_coef = True         # must not make the scaler fold a clip

    def __init__(self, params, lr):
        super().__init__(params, {"lr": lr})
        self.seen = []

    @torch.no_grad()
    def step(self, closure=None, *, grad_scaler=None):
        self.seen.append((grad_scaler, hasattr(self, "grad_scale"), hasattr(self, "found_inf")))
        inv, skip = 1.0, False
        if grad_scaler is not None:
            found = grad_scaler._check_inf_per_device(self)
            skip = any(float(f) for f in found.values())
            inv = grad_scaler._get_scale_async().double().reciprocal().float()
        if skip:
            return "skipped"
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.sub_(group["lr"] * (p.grad * inv))
        return "stepped"


def _record_warnings(fn):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = fn()
    return out, [(w.category, str(w.message), w.filename, w.lineno) for w in caught]


def test_grad_scaler_keyword_protocol_matches_torch():
    runs = {}
    for name, cls in SCALERS.items():
        model = make_model()
        opt = ScalerKeywordSGD(model.parameters(), lr=0.05)
        scaler = cls("cpu", init_scale=2.0 ** 12, growth_interval=3)
        trace, caught = _record_warnings(lambda: train(scaler, model, opt, 12, PLANTS))
        runs[name] = (trace, caught, opt.seen, scaler)
    assert_same_trace(runs["ampc"][0], runs["torch"][0], "grad_scaler= protocol")
    assert [t[2] for t in runs["ampc"][0]].count("skipped") == len(PLANTS)
    # the same FutureWarning, pointing at the same line (the caller of scaler.step)
    assert runs["ampc"][1] == runs["torch"][1] and len(runs["ampc"][1]) == 12
    category, message, filename, _ = runs["ampc"][1][0]
    assert category is FutureWarning and message.startswith("GradScaler is going to stop")
    assert filename.endswith("test_grad_scaler.py")
    for name, (_, _, seen, scaler) in runs.items():
        assert all(s == (scaler, False, False) for s in seen), f"{name}: {seen[0]}"


def test_grad_scaler_keyword_optimizer_gets_no_folded_clip():
    model = make_model()
    opt = ScalerKeywordSGD(model.parameters(), lr=0.05)
    scaler = ampc.GradScaler("cpu", init_scale=64.0)
    backward(scaler, model, 0, {})
    grads = [p.grad.clone() for p in model.parameters()]
    scaler.clip_grad_norm_(opt, 1e6)
    # unscaled in place (unscale_ then torch's clip), since this step takes no clip factor
    assert all(p.grad.equal(g / 64) for p, g in zip(model.parameters(), grads))


def _seen_by_folding_sgd(cls, preset=None, unscale=False, steps=8):
    """What FoldingSGD held during each step: (grad_scale, its value then, found_inf value),
    plus whether the attributes were left on the optimizer after each step."""
    model = make_model()
    opt = FoldingSGD(model.parameters(), lr=0.05)
    scaler = cls("cpu", init_scale=2.0 ** 10, growth_interval=2)
    seen, left = [], []
    for step in range(steps):
        opt.zero_grad()
        backward(scaler, model, step, {2: [(INF, 0, 0)], 3: [(INF, 1, 0)]})
        if unscale:
            scaler.unscale_(opt)
        if preset is not None:
            opt.grad_scale = preset
        scaler.step(opt)
        scale, _, found = opt.seen[-1]
        seen.append((scale, None if scale is None else float(scale), float(found)))
        left.append((hasattr(opt, "grad_scale"), hasattr(opt, "found_inf")))
        scaler.update()
    return seen, left, [p.detach().clone() for p in model.parameters()], scaler


@pytest.mark.parametrize("preset", [None, 0.5], ids=["plain", "preset-grad_scale"])
def test_fused_optimizer_gets_torchs_product(preset):
    runs = {name: _seen_by_folding_sgd(cls, None if preset is None else torch.tensor(preset))
            for name, cls in SCALERS.items()}
    (ours, our_left, our_params, scaler), (theirs, their_left, their_params, _) = \
        runs["ampc"], runs["torch"]
    # values when the step ran, and now, after every later update(): unchanged
    assert [s[1:] for s in ours] == [s[1:] for s in theirs]
    assert [float(s[0]) for s in ours] == [s[1] for s in ours] == [float(s[0]) for s in theirs]
    assert len({s[1] for s in ours}) > 2, "the scale never moved: the test is not testing"
    assert [s[2] for s in ours][2:4] == [1.0, 1.0]
    assert all(s[0] is not scaler._get_scale_async() for s in ours)
    assert our_left == their_left == [(False, False)] * 8     # torch deletes a preset too
    assert all(a.equal(b) for a, b in zip(our_params, their_params))


@pytest.mark.parametrize("preset", [None, 0.5], ids=["plain", "preset-grad_scale"])
def test_fused_optimizer_after_unscale_gets_what_it_holds(preset):
    tensor = None if preset is None else torch.tensor(preset)
    for name, cls in SCALERS.items():
        seen, left, _, _ = _seen_by_folding_sgd(cls, tensor, unscale=True, steps=3)
        assert all(s[0] is tensor for s in seen), f"{name}: {seen}"
        assert left == [(False, False)] * 3, name
