"""Activation checkpointing under FSDP2 with ampc.autocast: checkpoint_wrapper around each
block, then fully_shard, gives the gradients of the same run without checkpointing (the
recompute in backward must see the autocast state the forward saw). 2 ranks, gloo, CPU."""
import pytest
import torch
import torch.distributed as dist
from torch import nn

import ampc
from test_distributed import WORLD, assert_same_bits, batch, full, run_ranks

pytestmark = [
    pytest.mark.skipif(not dist.is_available(), reason="torch without distributed"),
]


def make_blocks():
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(24, 24), nn.GELU(), nn.LayerNorm(24))
                           for _ in range(3)], nn.Linear(24, 1))


def _grads(rank, checkpointed, cache):
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (WORLD,))
    model = make_blocks()
    for i, block in enumerate(model):
        if checkpointed and i < 3:
            model[i] = block = checkpoint_wrapper(block)
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    x, y = batch(0, rank)
    for _ in range(2):              # the weight cache's second region included
        model.zero_grad(set_to_none=True)
        with ampc.autocast("cpu", dtype=torch.bfloat16, cache_enabled=cache):
            loss = nn.functional.mse_loss(model(x).float(), y)
        loss.backward()
    return [full(p.grad) for p in model.parameters()]


def _both(rank, cache):
    return _grads(rank, False, cache), _grads(rank, True, cache)


@pytest.mark.parametrize("cache", [True, False], ids=["cache", "no_cache"])
def test_fsdp2_checkpoint_wrapper_gives_the_grads_of_the_plain_run(tmp_path, cache):
    for plain, checkpointed in run_ranks(_both, cache, tmp_path=tmp_path):
        assert_same_bits(checkpointed, plain, "checkpointed vs plain")
