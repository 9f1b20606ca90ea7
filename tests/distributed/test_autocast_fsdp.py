"""FSDP2 with checkpoint_wrapper under ampc.autocast, in one process (gloo, world size 1, CPU).

FSDP2 frees each unsharded parameter's storage after its module's forward and gathers it again
before the next use: ampc's weight cache must never cast such a parameter (a kernel would
read address 0), and the recomputation of checkpoint_wrapper must see the dtypes the forward
saw. Three steps give torch.autocast's losses and gradients bit for bit, with the fused weight
cast on and off."""

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import ampc
from ampc.amp import _weight_cache

if not dist.is_available():
    pytest.skip("torch.distributed is not available", allow_module_level=True)

from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402


@pytest.fixture
def one_rank(tmp_path):
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _build():
    torch.manual_seed(0)
    m = nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.GELU()) for _ in range(3)], nn.Linear(16, 4))
    for i in range(3):
        m[i] = checkpoint_wrapper(m[i])
        fully_shard(m[i])
    fully_shard(m)
    return m


def _steps(region):
    m, x = _build(), torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    losses = []
    for _ in range(3):
        with region("cpu"):
            loss = m(x).float().square().mean()
        loss.backward()
        losses.append(loss.detach())
    return losses, [p.grad.full_tensor() for p in m.parameters()]


@pytest.mark.usefixtures("one_rank")
@pytest.mark.parametrize("fused", [False, True])
def test_fsdp2_with_checkpoint_wrapper_matches_torch(fused, monkeypatch):
    monkeypatch.setitem(_weight_cache.FUSED, "cpu", fused)
    want_losses, want_grads = _steps(torch.autocast)
    got_losses, got_grads = _steps(ampc.autocast)
    assert all(torch.equal(a, b) for a, b in zip(got_losses, want_losses))
    assert all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(got_grads, want_grads))
