"""The demo's model: a small GPT, its batches, and sampling from it."""
from __future__ import annotations  # "X | None" hints on Python 3.9 too; none evaluated at import

import time

import torch
import torch.nn.functional as F
from torch import nn

from ._text import VOCAB_SIZE

# width, layers, heads, context, batch. "small" is wide rather than deep: on a CPU with
# AVX-512 BF16 a 16-bit step pays from about width 192 (at 128 it is slower than fp32's).
# "micro" and "tiny" (where 16-bit matmuls are slow) are narrow and deep instead: there the
# activations outweigh the weights and all but one block can be recomputed, so the memory
# moves show (with two blocks, recomputing one halved nothing)
SIZES = {"micro": (32, 6, 2, 64, 8), "tiny": (64, 6, 4, 64, 8), "small": (256, 2, 4, 64, 16),
         "medium": (256, 4, 4, 128, 32), "large": (384, 6, 6, 256, 32)}


class Attention(nn.Module):
    def __init__(self, width, heads):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class Block(nn.Module):
    def __init__(self, width, heads):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attn = Attention(width, heads)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(),
                                 nn.Linear(4 * width, width))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, width, layers, heads, context, vocab=VOCAB_SIZE):
        super().__init__()
        self.context = context
        self.tok = nn.Embedding(vocab, width)
        self.pos = nn.Embedding(context, width)
        self.blocks = nn.Sequential(*[Block(width, heads) for _ in range(layers)])
        self.ln = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)

    def forward(self, idx):
        pos = torch.arange(idx.shape[1], device=idx.device)
        return self.head(self.ln(self.blocks(self.tok(idx) + self.pos(pos))))


def model_maker(size):
    """make_model(): a fresh GPT of ``size`` (a key of SIZES)."""
    width, layers, heads, context, _ = SIZES[size]
    return lambda: GPT(width, layers, heads, context)


def batch_maker(data, context, batch, seed):
    """make_batch(step): ``batch`` random windows of ``data``, the same for a given step."""
    def make_batch(step):
        g = torch.Generator().manual_seed(seed * 1_000_003 + step)
        start = torch.randint(0, len(data) - context - 1, (batch,), generator=g)
        win = torch.stack([data[s:s + context + 1] for s in start.tolist()]).long()
        return win[:, :-1], win[:, 1:]
    return make_batch


@torch.no_grad()
def sample(model, vocab, prompt, n, device, temperature=0.8, seed=0, deadline=float("inf")):
    """``n`` tokens after ``prompt`` (``vocab`` encodes and decodes them), drawn from the
    model at ``temperature`` (from the 80th on, stopping early once ``time.perf_counter()``
    passes ``deadline``)."""
    model.eval()
    g = torch.Generator(device=device).manual_seed(seed)
    ids = vocab.encode(prompt).long().to(device)[None]
    for i in range(n):
        if i >= 80 and time.perf_counter() > deadline:
            break
        logits = model(ids[:, -model.context:])[0, -1].float()
        nxt = torch.multinomial(F.softmax(logits / temperature, -1), 1, generator=g)
        ids = torch.cat([ids, nxt[None]], 1)
    return vocab.decode(ids[0].tolist())
