"""ampc.GradScaler explains a collapse: after a streak of skipped steps it arms autocast's
overflow locator for one step and warns, once, naming the first module and op that turned
finite values into inf or nan (forward or backward), with the fixes to try. A healthy run
says nothing and waits for the device no more than it did."""
import re
import warnings

import pytest
import torch
import torch.nn as nn
from test_grad_scaler_extras import FoldingSGD, SyncCounter

import ampc
from ampc.amp import _overflow


class Planted(nn.Module):
    """A small net whose ``planted`` layer overflows float16 in the forward (inputs near
    116, weights 300, 16 of them: about 5.6e5 against float16's 65504)."""

    def __init__(self, where="forward"):
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.planted, self.out = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 1)
        self.where = where
        if where == "forward":
            with torch.no_grad():
                self.planted.weight.fill_(300.0)
        else:
            self.root = Root()

    def forward(self, x):
        h = torch.relu(self.inp(x))
        if self.where == "forward":
            return self.out(self.planted(h + 100.0))
        return self.out(self.root(h))


class Root(nn.Module):
    """Finite forward, infinite backward: sqrt at 0 has an infinite slope."""

    def forward(self, h):
        return h + torch.sqrt(h - h)


def _train(model, opt, scaler, steps, dtype=torch.float16):
    torch.manual_seed(1)
    x, y = torch.randn(32, 8), torch.randn(32, 1)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for _ in range(steps):
            opt.zero_grad()
            with ampc.autocast("cpu", dtype=dtype):
                loss = nn.functional.mse_loss(model(x).float(), y)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    return [str(w.message) for w in seen if "ampc.GradScaler" in str(w.message)]


OPTS = {"sgd": lambda m: torch.optim.SGD(m.parameters(), lr=1e-3),            # reads the flag
        "fused": lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3, fused=True),  # reads nothing
        "folding": lambda m: FoldingSGD(m.parameters(), lr=1e-3)}


@pytest.mark.parametrize("opt", list(OPTS))
def test_collapse_names_the_planted_module_and_op_once(opt):
    model = Planted()
    scaler = ampc.GradScaler("cpu")
    got = _train(model, OPTS[opt](model), scaler, 40)
    assert len(got) == 1, got                                   # once, however long it lasts
    text = got[0]
    print(text)
    assert "linear in module Planted.planted, in the forward pass" in text
    assert re.search(r"inputs were finite \(largest magnitude 300\) and its "
                     r"torch.float16 output holds inf", text)
    assert "float16's largest finite value is 65504" in text
    assert "ampc.policy.module_scope(model.planted, dtype=torch.float32)" in text
    assert "lower the learning rate" in text and "bfloat16" in text
    streak = "10 steps in a row" if opt == "sgd" else "at least 10 steps in a row"
    assert streak in text
    assert _overflow.armed is None


def test_the_streak_is_read_exactly_where_the_host_knows_it():
    # SGD: step() reads each skip flag; the report comes after exactly 10 skips and one
    # armed step, the 11th update
    model = Planted()
    scaler = ampc.GradScaler("cpu")
    opt = OPTS["sgd"](model)
    assert _train(model, opt, scaler, 10) == []
    assert len(_train(model, opt, scaler, 1)) == 1


def test_backward_overflow_is_named_too():
    model = Planted("backward")
    scaler = ampc.GradScaler("cpu", explain_skips=3)
    got = _train(model, OPTS["sgd"](model), scaler, 6)
    assert len(got) == 1, got
    assert "was sqrt in module Planted.root, in the backward pass" in got[0]
    assert "the gradient it received was finite" in got[0]
    assert "model.root" in got[0]


def test_raise_option_raises_with_the_message():
    model = Planted()
    scaler = ampc.GradScaler("cpu", raise_on_skips=True)
    with pytest.raises(RuntimeError, match=r"ampc.GradScaler: 10 steps in a row were skipped .*"
                                           r"linear in module Planted.planted"):
        _train(model, OPTS["sgd"](model), scaler, 40)
    assert _overflow.armed is None


@pytest.mark.parametrize("opt", list(OPTS))
def test_healthy_run_says_nothing(opt):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    # an init_scale that overflows first: a few skips while the scale settles are no collapse
    scaler = ampc.GradScaler("cpu", init_scale=2.0 ** 22)
    assert _train(model, OPTS[opt](model), scaler, 40) == []
    assert 0 < int(scaler.skipped_steps()) < 10, int(scaler.skipped_steps())
    assert _overflow.armed is None


def test_off_and_bad_settings():
    model = Planted()
    assert _train(model, OPTS["sgd"](model), ampc.GradScaler("cpu", explain_skips=None), 25) == []
    with pytest.raises(ValueError, match=r"^ampc.GradScaler: explain_skips must be None or an int >= 1"):
        ampc.GradScaler("cpu", explain_skips=0)
    with pytest.raises(ValueError, match=r"^ampc.GradScaler: raise_on_skips must be a bool"):
        ampc.GradScaler("cpu", raise_on_skips="yes")


def test_floor_reached_is_explained():
    model = Planted()
    scaler = ampc.GradScaler("cpu", init_scale=4.0, min_scale=1.0, explain_skips=50)
    got = _train(model, OPTS["folding"](model), scaler, 6)
    assert len(got) == 1 and "at min_scale" in got[0] and "Planted.planted" in got[0]


@pytest.mark.parametrize("opt", ["fused", "folding"])
def test_watching_adds_no_host_sync(monkeypatch, opt):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    optimizer = OPTS[opt](model)
    scaler = ampc.GradScaler("cpu", explain_skips=4)
    x, y = torch.randn(32, 8), torch.randn(32, 1)
    counter = SyncCounter(monkeypatch)
    for _ in range(25):                        # six boundaries of the window
        counter.paused = True
        optimizer.zero_grad()
        with ampc.autocast("cpu", dtype=torch.float16):
            loss = nn.functional.mse_loss(model(x).float(), y)
        scaler.scale(loss).backward()
        counter.paused = False
        scaler.step(optimizer)
        scaler.update()
    assert counter.calls == [], counter.calls


@pytest.mark.cuda
def test_collapse_on_cuda_is_named_without_a_host_sync_before_it(monkeypatch):
    # the pinned copy and its event: healthy steps read nothing, the collapse is still seen
    model = Planted().cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    scaler = ampc.GradScaler("cuda")
    x, y = torch.randn(32, 8, device="cuda"), torch.randn(32, 1, device="cuda")
    counter = SyncCounter(monkeypatch)
    got = []
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for step in range(45):
            opt.zero_grad()
            with ampc.autocast("cuda", dtype=torch.float16):
                loss = nn.functional.mse_loss(model(x).float(), y)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            got = [str(w.message) for w in seen if "ampc.GradScaler" in str(w.message)]
            if step and not scaler._skip_watch.recorder and not got:   # step 0 makes the buffers
                assert counter.calls == [], (step, counter.calls)
            counter.calls.clear()
    assert len(got) == 1 and "linear in module Planted.planted, in the forward pass" in got[0]
