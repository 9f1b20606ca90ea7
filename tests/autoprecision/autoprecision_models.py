"""Models built to have known answers for ampc.autoprecision.search."""
import torch
import torch.nn.functional as F
from torch import nn

VOCAB = 4096


class Known(nn.Module):
    """Five kinds of unit, each with a known sensitivity:

      norm   LayerNorm of an input offset by 1000: bf16 and fp16 round the offset input
             past its spread (must stay fp32)
      hot    Linear whose outputs reach ~1e5, past fp16's 65504 (must not be fp16)
      tiny   Linear whose output enters the loss scaled by 1e-12: its weight gradients
             underflow fp16 even at the loss scale the others allow (must not be fp16)
      head   Linear to 4096 logits of magnitude ~20: bf16's rounding of the logits
             shows in the loss (must not be bf16)
      inp, mid  ordinary Linears: any precision
    """

    def __init__(self, width=64):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.inp = nn.Linear(width, width)
        self.hot = nn.Linear(width, width)
        self.tiny = nn.Linear(width, width)
        self.mid = nn.Linear(width, width)
        self.head = nn.Linear(width, VOCAB)
        with torch.no_grad():
            self.hot.weight.mul_(3e5)
            self.head.weight.mul_(100)

    def forward(self, x):
        h = torch.relu(self.inp(self.norm(x + 1000.0)))
        h = self.hot(h) * 1e-5
        h = h + self.tiny(h) * 1e-12
        h = torch.relu(self.mid(h))
        return self.head(h)


SENSITIVE = {"norm": {"fp32"}, "hot": {"fp32", "bf16"}, "tiny": {"fp32", "bf16"},
             "head": {"fp32", "fp16"}}
ANY = ("inp", "mid")


def known_batches(n=3, batch=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, 64, generator=g), torch.randint(0, VOCAB, (batch,), generator=g))
            for _ in range(n)]


def target_batches(model, n=3, batch=32, seed=0):
    """Batches whose targets are the fp32 model's own top class: the loss is what a model
    that learned something sees (about 1), not the huge loss of random targets."""
    out = []
    for x, _ in known_batches(n, batch, seed):
        with torch.no_grad():
            out.append((x, model(x).argmax(-1)))
    return out


class Block(nn.Module):
    """A residual MLP block: two units whose saved activations outweigh their weights."""

    def __init__(self, d=64):
        super().__init__()
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(x)))


def train_plan(plan, model, opt, batches):
    """Losses of a training step on each batch with ``plan``'s region and loss, as a user's
    loop runs them (model and opt from ``plan.prepare``)."""
    losses = []
    for x, y in batches:
        opt.zero_grad()
        with plan.autocast():
            out = model(x)
        loss = plan.loss(None)(out, y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses
