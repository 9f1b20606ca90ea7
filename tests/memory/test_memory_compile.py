"""ampc.memory's module handles under torch.compile: a compiled model with modules coded in
8 bits, recomputed, or a sliced head trains as the same model run eagerly (Dynamo traces
recompute whole; it breaks the graph at a coded module's saved-tensor hooks and at the
sliced head's deferred logits, which then run eagerly). Recomputed, the compiled graph saves
fewer bytes for its backward than the same model compiled without."""
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


def steps(m, n=3, shape=(64, 64), classes=32):
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(n):
        x = torch.randn(*shape, generator=g)
        y = torch.randint(0, classes, shape[:1], generator=g)
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
    if what == "recompute":
        plain = model()
        torch._dynamo.reset()
        assert saved_bytes(torch.compile(compiled)) < saved_bytes(torch.compile(plain))


def saved_bytes(m):
    """What a step of ``m`` keeps for its backward, by ampc.memory.report (lr 0: the weights
    stay)."""
    g = torch.Generator().manual_seed(1)
    batch = (torch.randn(64, 64, generator=g), torch.randint(0, 32, (64,), generator=g))
    return sum(ampc.memory.report(m, torch.optim.SGD(m.parameters(), lr=0.0), batch).saved.values())


class Attention(nn.Module):
    """q, k and v as views with gaps of one qkv output, saved by attention: a compiled
    backward checks the strides of what it saved, so coded ones must come back in them."""

    def __init__(self, width=64, heads=4):
        super().__init__()
        self.heads = heads
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


def attention_model():
    torch.manual_seed(0)
    return nn.Sequential(Attention(), nn.GELU(), Attention(), nn.Flatten(), nn.Linear(64 * 16, 8))


def attention_steps(m):
    return steps(m, shape=(8, 16, 64), classes=8)


def test_coded_views_with_gaps_train_compiled_as_eager():
    eager, compiled = attention_model(), attention_model()
    for m in (eager, compiled):
        ampc.memory.compress(m, ["0", "2"], "8bit", min_numel=16)
    torch._dynamo.reset()
    a, wa = attention_steps(eager)
    b, wb = attention_steps(torch.compile(compiled))
    plain, wp = attention_steps(attention_model())
    assert a == pytest.approx(b, rel=1e-5)
    # the compiled graph saves other tensors than eager (its own fusions), so other codes:
    # its weights are as close to the plain run's as eager's coded run is
    for x, y, z in zip(wa, wb, wp):
        assert (y - z).norm() <= 2.5 * (x - z).norm() + 1e-7
    assert any((y - z).norm() > 0 for y, z in zip(wb, wp))     # and it did code them


def test_the_memory_report_of_a_compiled_model():
    m = attention_model()
    ampc.memory.compress(m, "0", "8bit", min_numel=16)
    ampc.memory.recompute(m, "2")
    torch._dynamo.reset()
    c = torch.compile(m)
    g = torch.Generator().manual_seed(1)
    batch = (torch.randn(8, 16, 64, generator=g), torch.randint(0, 8, (8,), generator=g))
    r = ampc.memory.report(c, torch.optim.SGD(c.parameters(), lr=0.1), batch)
    assert r.peak > 0 and sum(r.saved.values()) > 0
    # inside the compiled graph no module's hooks run: what it saves is the wrapper's
    assert set(r.saved) <= {"(model) (compiled)", "0", "2", "(loss)"}, r.saved
