"""Activation checkpointing of ampc.fp8.Linear: training with torch.utils.checkpoint (reentrant
and not) gives, bit for bit, the losses, gradients and FP8 scaling state of the same training
without it, under delayed scaling (history > 1) and current scaling, with fp32 activations or
ampc.autocast's bf16 around the FP8 region, with backward called inside or outside the region,
and with several forwards before their backwards. The recomputation casts with the scales the
forward cast with and leaves the state alone (ampc/fp8/_recompute.py); the controls show that
a recomputation that casts with the module's scales of the moment fails these tests.
"""
import contextlib
import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._dynamo.testing import CompileCounterWithBackend
from torch.utils.checkpoint import CheckpointError, checkpoint

import ampc
from ampc import fp8
from ampc.fp8 import _recompute

MODES = {"none": None, "non-reentrant": False, "reentrant": True}
RECIPES = {"delayed": fp8.DelayedScaling(amax_history_len=4),
           "current": fp8.Float8CurrentScaling()}


def _plain(fn, *args):
    return fn(*args)


class Net(nn.Module):
    """fc1 and head outside any checkpoint; fc2 and fc3 in one checkpoint, fc4 in another."""

    def __init__(self, mode):
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(32, 64), nn.Linear(64, 64), nn.Linear(64, 64)
        self.fc4, self.head = nn.Linear(64, 32), nn.Linear(32, 16)
        reentrant = MODES[mode]
        self.call = _plain if reentrant is None else functools.partial(checkpoint,
                                                                       use_reentrant=reentrant)

    def block_a(self, h):
        return h + self.fc3(F.gelu(self.fc2(h)))

    def block_b(self, h):
        return self.fc4(F.gelu(h))

    def forward(self, x):
        h = self.call(self.block_a, torch.tanh(self.fc1(x)))
        return self.head(self.call(self.block_b, h) * 2)


def _batches(n, rows=24):           # 24 rows: the weight gradient's GEMM pads them
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(rows, 32, generator=g) * (1 + i), torch.randn(rows, 16, generator=g))
            for i in range(n)]


def _region(recipe, bf16, device="cpu"):
    stack = contextlib.ExitStack()
    if bf16:
        stack.enter_context(ampc.autocast(device))
    stack.enter_context(fp8.autocast(recipe=recipe))
    return stack


def _state(net):
    return {k: v.clone() for k, v in net.state_dict().items() if "fp8_" in k}


def _grads(net):
    return [p.grad.clone() for p in net.parameters()]


def _model(mode):
    torch.manual_seed(0)
    return fp8.convert(Net(mode))


def train(mode, recipe, *, bf16=False, backward_inside=False, steps=3, model=None,
          device="cpu"):
    """Losses, per-step gradients and the FP8 state after each step."""
    call = (_model(mode) if model is None else model).to(device)
    net = getattr(call, "_orig_mod", call)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    losses, grads, states = [], [], []
    for x, y in _batches(steps):
        x, y = x.to(device), y.to(device)
        opt.zero_grad(set_to_none=True)
        with _region(recipe, bf16, device):
            loss = F.mse_loss(call(x).float(), y)
            if backward_inside:
                loss.backward()
        if not backward_inside:
            loss.backward()
        opt.step()
        losses.append(loss.detach())
        grads.append(_grads(net))
        states.append(_state(net))
    return losses, grads, states


def assert_same(got, want):
    (gl, gg, gs), (wl, wg, ws) = got, want
    assert all(torch.equal(a, b) for a, b in zip(gl, wl)), (gl, wl)
    for step, (a, b) in enumerate(zip(gg, wg)):
        for i, (ga, gb) in enumerate(zip(a, b)):
            assert ga.dtype == gb.dtype and torch.equal(ga, gb), f"step {step}, grad {i}"
    for step, (a, b) in enumerate(zip(gs, ws)):
        assert a.keys() == b.keys() and len(a) % 6 == 0 and a
        for k in a:
            assert torch.equal(a[k], b[k]), f"step {step}, {k}"


@pytest.mark.parametrize("backward_inside", [False, True], ids=["bwd-outside", "bwd-inside"])
@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "ampc-bf16"])
@pytest.mark.parametrize("recipe", sorted(RECIPES))
@pytest.mark.parametrize("mode", ["non-reentrant", "reentrant"])
def test_checkpointing_matches_no_checkpointing(mode, recipe, bf16, backward_inside):
    kw = dict(bf16=bf16, backward_inside=backward_inside)
    want = train("none", RECIPES[recipe], **kw)
    assert_same(train(mode, RECIPES[recipe], **kw), want)
    if recipe == "delayed":     # the history moved once per step, and not all alike
        hist = want[2][-1]["fc2.fp8_fwd_amax_history"]
        assert (hist[:3] > 0).all() and (hist[3] == 0).all() and not torch.equal(hist[0], hist[1])


@pytest.mark.cuda
@pytest.mark.parametrize("recipe", sorted(RECIPES))
@pytest.mark.parametrize("mode", ["non-reentrant", "reentrant"])
def test_checkpointing_matches_no_checkpointing_cuda(mode, recipe):
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("needs a CUDA GPU with FP8 (sm_89 or newer)")
    kw = dict(bf16=True, backward_inside=False, device="cuda")
    assert_same(train(mode, RECIPES[recipe], **kw), train("none", RECIPES[recipe], **kw))


def _old_recomputation(monkeypatch):
    """The recomputation before records: it casts with (and updates) the module's state."""
    monkeypatch.setattr(_recompute, "recording", lambda: None)
    monkeypatch.setattr(_recompute, "replayed", lambda module: None)


@pytest.mark.parametrize("mode", ["non-reentrant", "reentrant"])
def test_control_a_recomputation_with_the_moved_scales_fails(mode, monkeypatch):
    """Without the replay, a backward inside the region recomputes with the updated scales and
    updates the history again: the state after one step already differs."""
    recipe = RECIPES["delayed"]
    want = train("none", recipe, backward_inside=True, steps=1)
    _old_recomputation(monkeypatch)
    got = train(mode, recipe, backward_inside=True, steps=1)
    assert torch.equal(got[0][0], want[0][0])           # the forward itself is the same
    hist = got[2][0]["fc2.fp8_fwd_amax_history"]
    assert (hist[:2] > 0).all()                        # two updates in one step
    assert not torch.equal(hist, want[2][0]["fc2.fp8_fwd_amax_history"])
    assert any(not torch.equal(a, b) for a, b in zip(got[1][0], want[1][0]))
    with pytest.raises(AssertionError):
        assert_same(got, want)


def test_control_without_the_replay_a_backward_outside_recomputes_without_fp8(monkeypatch):
    """Backward outside the region: without the replay the recomputation ran no FP8 at all;
    reentrant checkpointing takes its gradients, non-reentrant refuses."""
    recipe = RECIPES["current"]
    want = train("none", recipe, steps=1)
    _old_recomputation(monkeypatch)
    with pytest.raises(AssertionError):
        assert_same(train("reentrant", recipe, steps=1), want)
    with pytest.raises(CheckpointError, match="A different number of tensors was saved"):
        train("non-reentrant", recipe, steps=1)


@pytest.mark.parametrize("mode", ["non-reentrant", "reentrant"])
def test_current_scaling_recomputed_with_its_own_amax_is_already_exact(mode, monkeypatch):
    """Current scaling takes the scale from the tensor being cast, which the recomputation
    rebuilds bit for bit: casting it again gives the forward's casts and rewrites the same
    state. The replay is exact there too, and saves the amax pass."""
    recipe = RECIPES["current"]
    want = train("none", recipe, backward_inside=True)
    _old_recomputation(monkeypatch)
    assert_same(train(mode, recipe, backward_inside=True), want)


@pytest.mark.parametrize("order", ["in order", "reversed", "summed"])
@pytest.mark.parametrize("recipe", sorted(RECIPES))
@pytest.mark.parametrize("mode", ["non-reentrant", "reentrant"])
def test_several_forwards_before_their_backwards(mode, recipe, order):
    """Gradient accumulation with the forwards first: each checkpoint replays its own
    forward's scales, whichever backward runs first."""
    def run(m):
        net = _model(m)
        losses = []
        for x, y in _batches(3):
            with fp8.autocast(recipe=RECIPES[recipe]):
                losses.append(F.mse_loss(net(x).float(), y))
        if order == "summed":
            sum(losses).backward()
        else:
            for loss in (losses if order == "in order" else losses[::-1]):
                loss.backward()
        return [torch.stack(losses).detach()], [_grads(net)], [_state(net)]

    want = run("none")
    assert_same(run(mode), want)
    if recipe == "delayed":
        assert (want[2][0]["fc2.fp8_fwd_amax_history"][:3] > 0).all()


def test_a_second_backward_through_a_retained_graph_replays_again():
    recipe = RECIPES["delayed"]

    def run(m):
        net = _model(m)
        x, y = _batches(1)[0]
        with fp8.autocast(recipe=recipe):
            loss = F.mse_loss(net(x).float(), y)
        loss.backward(retain_graph=True)
        loss.backward()
        return [loss.detach()], [_grads(net)], [_state(net)]

    assert_same(run("non-reentrant"), run("none"))


class Mixed(nn.Module):
    """A checkpointed block whose first layer runs outside FP8."""

    def __init__(self, ckpt):
        super().__init__()
        self.a, self.b = fp8.Linear(32, 32), fp8.Linear(32, 16)
        self.ckpt = ckpt

    def block(self, x):
        with fp8.autocast(enabled=False):
            h = F.gelu(self.a(x))
        return self.b(h)

    def forward(self, x):
        return checkpoint(self.block, x, use_reentrant=False) if self.ckpt else self.block(x)


@pytest.mark.parametrize("backward_inside", [False, True])
def test_a_layer_out_of_fp8_inside_a_checkpoint_is_recomputed_out_of_fp8(backward_inside):
    def run(ckpt):
        torch.manual_seed(0)
        net = Mixed(ckpt)
        x = torch.randn(16, 32, requires_grad=True)
        with fp8.autocast(recipe=RECIPES["delayed"]):
            loss = net(x).float().square().mean()
            if backward_inside:
                loss.backward()
        if not backward_inside:
            loss.backward()
        return [loss.detach()], [[x.grad] + _grads(net)], [_state(net)]

    want = run(False)
    assert (want[2][0]["a.fp8_fwd_amax_history"] == 0).all()      # a ran without FP8
    assert (want[2][0]["b.fp8_fwd_amax_history"][0] > 0).all()
    assert_same(run(True), want)


def test_a_layer_run_without_any_region_after_one_opened_inside_the_checkpoint():
    """The checkpointed function opens its own region for one layer and calls another with
    none open; the backward runs inside a region: the second layer is recomputed without FP8."""
    def run(ckpt):
        torch.manual_seed(0)
        a, b = fp8.Linear(32, 32), fp8.Linear(32, 16)

        def block(x):
            with fp8.autocast(recipe=RECIPES["delayed"]):
                h = a(x)
            return b(F.gelu(h))

        x = torch.randn(16, 32, requires_grad=True)
        out = checkpoint(block, x, use_reentrant=False) if ckpt else block(x)
        with fp8.autocast(recipe=RECIPES["current"]):
            out.square().sum().backward()
        return [x.grad, a.weight.grad, b.weight.grad, a.fp8_fwd_amax_history,
                b.fp8_fwd_amax_history]

    got, want = run(True), run(False)
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    assert (want[3][0] > 0).all() and (want[4] == 0).all()


def test_a_checkpoint_run_outside_the_region_is_recomputed_without_fp8_inside_one():
    """The forward ran no FP8 (no region), the backward runs inside a region: the
    recomputation runs no FP8 either."""
    def run(ckpt):
        torch.manual_seed(0)
        lin = fp8.Linear(32, 16)
        x = torch.randn(16, 32, requires_grad=True)
        out = checkpoint(lin, x, use_reentrant=False) if ckpt else lin(x)
        with fp8.autocast():
            out.square().sum().backward()
        return x.grad, lin.weight.grad, lin.fp8_fwd_amax_history

    (gx, gw, hist), (wx, ww, _) = run(True), run(False)
    assert torch.equal(gx, wx) and torch.equal(gw, ww) and (hist == 0).all()


@pytest.mark.parametrize("reentrant", [False, True])
def test_a_layer_called_in_and_out_of_fp8_in_one_checkpoint(reentrant):
    """Out of FP8 under a disabled region: recorded, recomputed alike. Out of FP8 with no
    region open, then in FP8 under one opened inside the checkpointed function: the
    recomputation cannot tell the first call from the second, and refuses."""
    def run(ckpt, disabled_region):
        torch.manual_seed(0)
        lin = fp8.Linear(32, 32)

        def block(x):
            if disabled_region:
                with fp8.autocast(enabled=False):
                    h = lin(x)
                return lin(h)
            h = lin(x)
            with fp8.autocast():
                return lin(h)

        x = torch.randn(16, 32, requires_grad=True)
        with fp8.autocast() if disabled_region else contextlib.nullcontext():
            out = checkpoint(block, x, use_reentrant=reentrant) if ckpt else block(x)
        out.square().sum().backward()
        return [x.grad, lin.weight.grad, lin.bias.grad, lin.fp8_fwd_amax_history]

    got, want = run(True, True), run(False, True)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert (want[3][0] > 0).all() and (want[3][1] == 0).all()     # one FP8 call of two
    with pytest.raises(RuntimeError, match="ampc.fp8: the recomputation of a checkpointed "
                                           "forward called its FP8 layers in another order"):
        run(True, False)


@pytest.mark.parametrize("outer_has_fp8", [True, False])
@pytest.mark.parametrize("reentrant", [False, True])
def test_nested_checkpoints_raise(reentrant, outer_has_fp8):
    torch.manual_seed(0)
    a, b = fp8.Linear(32, 32), fp8.Linear(32, 32)
    ck = functools.partial(checkpoint, use_reentrant=reentrant)

    def inner(x):
        return b(x)

    def outer(x):       # saves tensors after the inner checkpoint: its forward runs again
        h = a(x) if outer_has_fp8 else x * 2
        return ck(inner, h).sin()

    x = torch.randn(16, 32, requires_grad=True)
    with fp8.autocast():
        out = ck(outer, x)
    with pytest.raises(RuntimeError, match="ampc.fp8: an FP8 layer in a checkpoint nested"):
        out.sum().backward()


@pytest.mark.parametrize("recipe", sorted(RECIPES))
@pytest.mark.parametrize("mode", ["non-reentrant", "reentrant"])
def test_compile_of_a_checkpointed_model_matches_eager(mode, recipe):
    """torch.compile ("aot_eager") of the checkpointed model against the eager model without
    checkpointing. The FP8 calls run eagerly (test_fp8_compile.py), so Dynamo leaves a
    checkpoint that holds one to torch's eager checkpointing, whose recomputation replays;
    the ops outside the checkpoints compile."""
    torch._dynamo.reset()
    backend = CompileCounterWithBackend("aot_eager")
    try:
        got = train(mode, RECIPES[recipe], model=torch.compile(_model(mode), backend=backend))
        assert backend.frame_count == 2         # the tanh; the product after block_b
    finally:
        torch._dynamo.reset()
    assert_same(got, train("none", RECIPES[recipe]))


class Blocks(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
        self.b = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))

    def forward(self, x):
        return self.b(self.a(x) + x)


@pytest.mark.parametrize("how", ["wrapper, no reentrant", "wrapper, reentrant", "composable"])
def test_checkpoint_wrapper_and_composable_checkpoint(how):
    """torch.distributed's module checkpointing reaches the same frames."""
    from torch.distributed._composable import checkpoint as composable_checkpoint
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl, checkpoint_wrapper)

    def run(wrap):
        torch.manual_seed(0)
        net = fp8.convert(Blocks())
        if wrap == "composable":
            composable_checkpoint(net.a)
            composable_checkpoint(net.b)
        elif wrap is not None:
            impl = {"wrapper, no reentrant": CheckpointImpl.NO_REENTRANT,
                    "wrapper, reentrant": CheckpointImpl.REENTRANT}[wrap]
            net.a = checkpoint_wrapper(net.a, checkpoint_impl=impl)
            net.b = checkpoint_wrapper(net.b, checkpoint_impl=impl)
        x = torch.randn(16, 32, requires_grad=True)
        with fp8.autocast(recipe=RECIPES["delayed"]):
            loss = net(x).square().mean()
            loss.backward()
        return [loss.detach()], [[x.grad] + _grads(net)], [_state(net)]

    assert_same(run(how), run(None))
