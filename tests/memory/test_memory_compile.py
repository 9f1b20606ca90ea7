"""ampc.memory's module handles under torch.compile: a compiled model with modules coded in
8 bits, recomputed, or a sliced head trains as the same model run eagerly (Dynamo traces
recompute whole; it breaks the graph at a coded module's saved-tensor hooks and at the
sliced head's deferred logits, which then run eagerly)."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ampc


def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64), nn.Linear(64, 32))


SET = {"compress": lambda m: ampc.memory.compress(m, "2", "8bit", min_numel=16),
       "recompute": lambda m: ampc.memory.recompute(m, ["0", "1"]),
       "sliced_head": lambda m: ampc.memory.sliced_head(m, "3")}


def steps(m, n=3):
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(n):
        x, y = torch.randn(64, 64, generator=g), torch.randint(0, 32, (64,), generator=g)
        opt.zero_grad()
        loss = F.cross_entropy(m(x), y)
        loss.backward()
        opt.step()
        losses.append(float(loss))
    return losses, [p.detach().clone() for p in m.parameters()]


@pytest.mark.parametrize("what", list(SET))
def test_compiled_trains_as_eager(what):
    eager = model()
    SET[what](eager)
    compiled = model()
    SET[what](compiled)
    torch._dynamo.reset()
    a, wa = steps(eager)
    b, wb = steps(torch.compile(compiled))
    assert a == pytest.approx(b, rel=1e-5)
    for x, y in zip(wa, wb):
        assert torch.allclose(x, y, rtol=1e-4, atol=1e-6)
