"""The memory moves on what they cannot code or replay: masks holding -inf or finfo.min,
a KV cache, batch norms' running statistics. Each is checked against the plain model."""
import copy
import warnings

import pytest
import torch
from torch import nn

import ampc


class Masked(nn.Module):
    """Attention with an additive mask, which scaled_dot_product_attention saves for its
    backward (as in transformers' models): -inf, or finfo.min, where a key is hidden."""

    def __init__(self, fill):
        super().__init__()
        # (no key bias: its gradient is zero, a softmax row does not see a shift)
        self.q, self.k, self.v = nn.Linear(64, 64), nn.Linear(64, 64, bias=False), nn.Linear(64, 64)
        self.fill = fill

    def forward(self, x):
        t = x.shape[1]
        mask = torch.full((t, t), self.fill).triu(1)
        return nn.functional.scaled_dot_product_attention(self.q(x), self.k(x), self.v(x),
                                                          attn_mask=mask)


def grads(model, x):
    model.zero_grad()
    model(x).square().mean().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("fill", [float("-inf"), torch.finfo(torch.float32).min])
@pytest.mark.parametrize("how, tol", [("8bit", 0.08), ("bf16", 0.02)])
def test_a_saved_mask_is_kept_exactly(fill, how, tol):
    torch.manual_seed(0)
    plain = nn.Sequential(Masked(fill), Masked(fill))
    small = copy.deepcopy(plain)
    ampc.memory.compress(small, ["0", "1"], how, min_numel=16)
    x = torch.randn(4, 96, 64)
    g0, g1 = grads(plain, x), grads(small, x)
    for n in g0:
        assert torch.isfinite(g1[n]).all(), n
        err = ((g1[n] - g0[n]).norm() / g0[n].norm()).item()
        assert err < tol, (n, err)


def test_what_the_code_cannot_hold_is_kept_and_the_rest_coded():
    from ampc.memory._compress import _code
    x = torch.randn(1024)
    assert _code(x, "8bit") is not None and _code(x, "bf16") is not None
    x[700] = float("-inf")
    assert _code(x, "8bit") is None and _code(x, "bf16") is None
    x[700] = torch.finfo(torch.float32).min
    assert _code(x, "8bit") is not None and _code(x, "bf16") is None     # bf16 makes it -inf
    x[3] = float("nan")
    assert _code(x, "8bit") is None and _code(x, "bf16") is None


def mistral():
    transformers = pytest.importorskip("transformers")
    MistralConfig, MistralForCausalLM = transformers.MistralConfig, transformers.MistralForCausalLM
    torch.manual_seed(0)
    cfg = MistralConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, sliding_window=16,
                        vocab_size=512, max_position_embeddings=256)
    return MistralForCausalLM(cfg)      # its config as it comes: use_cache=True


def lm_grads(model, ids):
    model.zero_grad()
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    return out.loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("move, tol", [("8bit", 0.1), ("bf16", 0.02), ("recompute", 0.0)])
def test_mistral_as_it_comes_trains_under_each_move(move, tol):
    """Its layers save the sliding-window mask (-inf) and append to a KV cache."""
    plain = mistral()
    moved = copy.deepcopy(plain)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if move == "recompute":
            handle = ampc.memory.recompute(moved, "model.layers.*")
        else:
            handle = ampc.memory.compress(moved, "model.layers.*", move)
    if move == "recompute":
        assert any("use_cache" in str(w.message) for w in caught)
        assert moved.config.use_cache is False
    ids = torch.randint(0, 512, (4, 32), generator=torch.Generator().manual_seed(1))
    l0, g0 = lm_grads(plain, ids)
    l1, g1 = lm_grads(moved, ids)
    assert l1 == l0
    for n in g0:
        assert torch.isfinite(g1[n]).all(), n
        err = ((g1[n] - g0[n]).norm() / g0[n].norm().clamp_min(1e-30)).item()
        assert err <= tol, (n, err)
    # training on beside the plain run
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (plain, moved)]
    for step in range(10):
        ids = torch.randint(0, 512, (4, 32), generator=torch.Generator().manual_seed(10 + step))
        losses = []
        for m, opt in zip((plain, moved), opts):
            opt.zero_grad()
            loss = m(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            losses.append(loss.item())
        assert abs(losses[1] - losses[0]) <= 0.02 * losses[0], (step, losses)
    handle.remove()
    if move == "recompute":
        assert moved.config.use_cache is True


def test_a_cache_reaching_a_recomputed_layer_is_refused_before_it_changes():
    model = mistral()
    with pytest.warns(UserWarning, match="use_cache"):
        ampc.memory.recompute(model, "model.layers.*")
    ids = torch.randint(0, 512, (2, 8))
    with pytest.raises(RuntimeError, match=r"ampc.memory.recompute: a MistralDecoderLayer .*"
                                           r"KV cache .*use_cache=False"):
        model(input_ids=ids, use_cache=True)
    with torch.no_grad():          # generation: nothing recomputes, the cache works
        out = model(input_ids=ids, use_cache=True)
    assert out.past_key_values.get_seq_length() == 8


def test_batch_norm_statistics_are_updated_once():
    torch.manual_seed(0)
    block = lambda: nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())  # noqa: E731
    plain = nn.Sequential(block(), block(), nn.Conv2d(8, 4, 1))
    moved = copy.deepcopy(plain)
    ampc.memory.recompute(moved, ["0", "1"])
    for step in range(3):
        x = torch.randn(4, 8, 16, 16, generator=torch.Generator().manual_seed(step))
        g0, g1 = grads(plain, x), grads(moved, x)
        assert all(g0[n].equal(g1[n]) for n in g0)
    for (n, a), (_, b) in zip(plain.named_buffers(), moved.named_buffers()):
        assert a.equal(b), n
    assert moved[0][1].num_batches_tracked.item() == 3


class _DoublesItsInput(nn.Module):
    def forward(self, x):
        x.mul_(2)                 # in place on the input it was given
        return x * x


def test_an_in_place_module_is_refused_by_name_before_it_changes():
    # without the refusal torch stops the backward with a version-counter error naming no module
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(inplace=True), nn.Linear(8, 8))
    with pytest.raises(ValueError, match=r"ampc.memory.recompute: '1' \(ReLU\) works in place"):
        ampc.memory.recompute(model, "1")
    assert ampc.memory.recomputed(model) == []
    # a block with the in-place op inside, on its own intermediate, recomputes exactly
    block = nn.Sequential(nn.Linear(8, 8), nn.ReLU(inplace=True), nn.Linear(8, 8))
    model = nn.Sequential(block, nn.Linear(8, 4))
    plain = copy.deepcopy(model)
    x = torch.randn(4, 8)
    plain(x).square().sum().backward()
    ampc.memory.recompute(model, "0")
    model(x).square().sum().backward()
    for p, q in zip(model.parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0)


def test_a_module_changing_its_input_in_place_is_named_in_the_forward():
    model = nn.Sequential(nn.Linear(8, 8), _DoublesItsInput(), nn.Linear(8, 8))
    ampc.memory.recompute(model, "1")
    with pytest.raises(RuntimeError, match="a _DoublesItsInput that recomputes changed its input "
                                           "in place"):
        model(torch.randn(4, 8))
