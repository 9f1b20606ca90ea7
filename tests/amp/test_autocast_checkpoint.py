"""Activation checkpointing under ampc.autocast gives the dtypes and the gradients (bit for bit
on the CPU) of the same model without checkpointing, in every checkpointing mode, under the
default policy, an edited policy and scopes, with backward called inside or outside the region.
torch restores its own autocast state for the recomputation; when an op with an ampc policy of
its own runs inside a checkpointed forward, ampc carries the region into the recomputation."""
import functools

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed._composable import checkpoint as composable_checkpoint
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper
from torch.utils.checkpoint import checkpoint

import ampc

BF16, FP32 = torch.bfloat16, torch.float32


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln = nn.LayerNorm(16)
        self.fc1, self.fc2 = nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, x):
        h = self.fc1(self.ln(x))
        h = F.gelu(h) * torch.softmax(h, -1)
        return x + self.fc2(h)


class Net(nn.Module):
    def __init__(self, call_block):
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(16, 4)
        self.call_block = call_block

    def forward(self, x):
        for b in self.blocks:
            x = self.call_block(b, x)
        return self.head(x)


def _plain(block, x):
    return block(x)


MODES = {
    "none": lambda net: None,
    "non-reentrant": lambda net: setattr(net, "call_block", functools.partial(checkpoint, use_reentrant=False)),
    "reentrant": lambda net: setattr(net, "call_block", functools.partial(checkpoint, use_reentrant=True)),
    "wrapper, no reentrant": lambda net: _wrap(net, CheckpointImpl.NO_REENTRANT),
    "wrapper, reentrant": lambda net: _wrap(net, CheckpointImpl.REENTRANT),
    "composable": lambda net: [composable_checkpoint(b) for b in net.blocks],
}


def _wrap(net, impl):
    net.blocks = nn.ModuleList([checkpoint_wrapper(b, checkpoint_impl=impl) for b in net.blocks])


def _edit():
    ampc.policy.set_policy("softmax", "fp32", device_type="cpu")
    ampc.policy.set_policy("layer_norm", "fp32_keep_dtype", device_type="cpu")
    ampc.policy.set_policy("gelu", "lower_precision_fp", device_type="cpu")


POLICIES = ["default", "edited", "scope", "module scope"]


def _train_step(mode, policy, backward_inside):
    torch.manual_seed(0)
    net = Net(_plain)
    MODES[mode](net)
    x = torch.randn(3, 5, 16, requires_grad=True)
    handle = None
    if policy == "edited":
        _edit()
    if policy == "module scope":
        target = net.blocks[1]
        target = getattr(target, "_checkpoint_wrapped_module", target)
        handle = ampc.policy.module_scope(target, ops={"softmax": "fp32", "gelu": "lower_precision_fp"})
    dtypes = []
    hooks = [m.register_forward_hook(lambda m, a, out: dtypes.append((a[0].dtype, out.dtype))) for m in net.modules()
             if isinstance(m, (nn.Linear, nn.LayerNorm))]
    try:
        with ampc.autocast("cpu"):
            with ampc.policy.scope(ops={"softmax": "fp32"}) if policy == "scope" else torch.enable_grad():
                out = net(x)
            for h in hooks:
                h.remove()
            loss = out.float().square().mean()
            if backward_inside:
                loss.backward()
        if not backward_inside:
            loss.backward()
    finally:
        ampc.policy.reset()
        if handle is not None:
            handle.remove()
    grads = [x.grad] + [p.grad for p in net.parameters()]
    return out, dtypes, grads


@pytest.mark.parametrize("backward_inside", [False, True])
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("mode", [m for m in MODES if m != "none"])
def test_checkpointing_matches_no_checkpointing(mode, policy, backward_inside):
    want_out, want_dtypes, want_grads = _train_step("none", policy, backward_inside)
    got_out, got_dtypes, got_grads = _train_step(mode, policy, backward_inside)
    assert got_dtypes == want_dtypes
    assert got_out.dtype == want_out.dtype and torch.equal(got_out, want_out)
    assert len(got_grads) == len(want_grads)
    for g, w in zip(got_grads, want_grads):
        assert g is not None and g.dtype == w.dtype and torch.equal(g, w)


@pytest.mark.parametrize("policy", POLICIES[1:])
def test_edits_change_what_is_checkpointed(policy):
    """The edits and scopes are really in force in the matrix above (else it would prove nothing)."""
    _, default_dtypes, _ = _train_step("none", "default", False)
    _, edited_dtypes, _ = _train_step("non-reentrant", policy, False)
    assert default_dtypes != edited_dtypes and (FP32, BF16) in edited_dtypes


def test_recomputation_sees_the_edit():
    seen = []
    net = Net(functools.partial(checkpoint, use_reentrant=False))
    x = torch.randn(2, 16, requires_grad=True)
    real_softmax = torch.softmax

    def spy(t, dim):
        seen.append(t.dtype)
        return real_softmax(t, dim)

    spied = ampc.policy.register(spy, policy="fp32", device_type="cpu", name="ckpt_spy")
    try:
        net.blocks[0].forward = lambda t: spied(net.blocks[0].fc1(t), -1).sum(-1, keepdim=True) + t
        with ampc.autocast("cpu"):
            out = net(x)
        out.float().sum().backward()
    finally:
        ampc.policy.reset()
    assert seen == [FP32, FP32]          # forward and recomputation both cast to fp32
