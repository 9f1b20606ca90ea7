"""ampc.autocast's weight cache under FSDP2: FSDP2 frees the unsharded params between
uses (their storage resized to 0), so from the second autocast region on the cache must
not hand a freed param to a kernel. Outputs and grads with the cache on equal those with
it off, with reshard_after_forward True and False. 2 ranks, gloo, CPU."""
import pytest
import torch
import torch.distributed as dist
from torch import nn

import ampc
from ampc.amp import _weight_cache
from test_distributed import assert_same_bits, batch, fsdp, full, make_model, run_ranks

pytestmark = [
    pytest.mark.skipif(not dist.is_available(), reason="torch without distributed"),
]


def _regions(rank, reshard):
    _weight_cache.FUSED["cpu"] = True    # the CUDA default; on here so the cache runs
    out = {}
    for cache in (False, True):
        model = fsdp(make_model(), reshard_after_forward=reshard)
        trace = []
        for step in range(3):               # regions 2 and 3 meet params FSDP2 freed
            x, y = batch(step, rank)
            model.zero_grad(set_to_none=True)
            with ampc.autocast("cpu", dtype=torch.bfloat16, cache_enabled=cache):
                pred = model(x)
                loss = nn.functional.mse_loss(pred.float(), y)
            loss.backward()
            trace.append((pred.detach().clone(), [full(p.grad) for p in model.parameters()]))
        out[cache] = trace
    return out


@pytest.mark.parametrize("reshard", [True, False], ids=["reshard", "keep_unsharded"])
def test_fsdp2_weight_cache_on_equals_off(tmp_path, reshard):
    for rank, result in enumerate(run_ranks(_regions, reshard, tmp_path=tmp_path)):
        assert_same_bits(result[True], result[False], f"rank {rank}: cache on vs off")
