"""torch.compile under ampc.autocast: one compile over several training steps (the mode's
tables do not change between steps, so Dynamo's guards keep holding), no graph breaks, and the
eager results within bf16 tolerance, with the default policy and with an edit."""
import copy

import pytest
import torch
import torch.nn as nn
from torch._dynamo.testing import CompileCounterWithBackend
from torch._dynamo.utils import counters

import ampc

BF16 = torch.bfloat16


def _model():
    torch.manual_seed(0)
    # the attention runs Python composites (F.multi_head_attention_forward): a mode that
    # learned new callables into a table Dynamo guards on recompiled it on steps 2 and 3
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(),
                         nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True),
                         nn.Softmax(-1), nn.Linear(32, 8))


def _train(model, steps, data):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, dtypes = [], []
    for x in data[:steps]:
        opt.zero_grad()
        with ampc.autocast("cpu"):
            out = model(x)
            loss = out.float().pow(2).mean()
        loss.backward()
        dtypes.append(out.dtype)
        opt.step()
        losses.append(loss.detach())
    return torch.stack(losses), dtypes


@pytest.mark.parametrize("edited", [False, True])
def test_one_compile_over_five_steps_no_graph_breaks(edited):
    torch._dynamo.reset()
    counters.clear()
    if edited:
        ampc.policy.set_policy("softmax", "fp32", device_type="cpu")
    try:
        data = [torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(i)) for i in range(5)]
        eager = _model()
        compiled_model = copy.deepcopy(eager)
        counter = CompileCounterWithBackend("aot_eager")
        compiled = torch.compile(compiled_model, backend=counter)
        got, got_dtypes = _train(compiled, 5, data)       # first: nothing learned by eager calls
        want, want_dtypes = _train(eager, 5, data)
    finally:
        ampc.policy.reset()
        torch._dynamo.reset()
    assert counter.frame_count == 1, f"compiled {counter.frame_count} times"
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert got_dtypes == want_dtypes == [BF16] * 5
    torch.testing.assert_close(got, want, rtol=2e-2, atol=1e-3)
