"""ampc.memory.linear_cross_entropy: F.cross_entropy(F.linear(...)) in slices of tokens, with the
same loss and gradients (float64 to rounding, fp32 and bf16 autocast against torch's own), a
lower peak, a trained GPT-2 that follows torch's, and clear errors for bad input."""
import pytest
import torch
import torch.nn.functional as F

import ampc.memory
from ampc.memory import linear_cross_entropy as lce


def _inputs(dtype, vocab=300, hidden=24, bias=True, ignored=True):
    g = torch.Generator().manual_seed(0)
    h = torch.randn(3, 40, hidden, generator=g, dtype=dtype).requires_grad_()
    w = (torch.randn(vocab, hidden, generator=g, dtype=dtype) / hidden ** 0.5).requires_grad_()
    b = torch.randn(vocab, generator=g, dtype=dtype).requires_grad_() if bias else None
    t = torch.randint(0, vocab, (3, 40), generator=g)
    if ignored:
        t[0, :7] = -100
        t[2, 30:] = -100
    return h, w, b, t


def _torch(h, w, b, t, reduction="mean"):
    return F.cross_entropy(F.linear(h, w, b).float().flatten(0, -2), t.flatten(), reduction=reduction)


def _grads(loss, inputs):
    return torch.autograd.grad(loss * 1.7, [x for x in inputs if x is not None])


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("chunk", [1, 7, 64, None, 1000])
def test_float64_equals_torch(reduction, chunk):
    h, w, b, t = _inputs(torch.float64)
    ref = F.cross_entropy(F.linear(h, w, b).flatten(0, -2), t.flatten(), reduction=reduction)
    got = lce(h, w, t, b, reduction=reduction, chunk_tokens=chunk)
    torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)
    for a, c in zip(_grads(got, (h, w, b)), _grads(ref, (h, w, b))):
        torch.testing.assert_close(a, c, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_masked_classes_and_huge_logits_equal_torch(dtype):
    """Classes masked with a -inf bias and logits far past exp's range: the softmax is taken
    after each row's largest logit is subtracted, as torch's is, so loss and gradients stay
    finite and equal torch's (an exp of the raw logits would overflow to inf and give NaN)."""
    h, w, b, t = _inputs(dtype)
    with torch.no_grad():
        w.mul_(400.0)                                  # logits of several thousand
        b[::3] = float("-inf")                         # a third of the classes masked
        t[t % 3 == 0] = 1                              # no target is a masked class
    ref = F.cross_entropy(F.linear(h, w, b).flatten(0, -2), t.flatten())   # in dtype
    got = lce(h, w, t, b, chunk_tokens=16)
    assert ref.isfinite() and got.isfinite()
    tol = dict(rtol=1e-10, atol=1e-9) if dtype == torch.float64 else dict(rtol=1e-4, atol=1e-3)
    torch.testing.assert_close(got, ref, **tol)
    for a, c in zip(_grads(got, (h, w, b)), _grads(ref, (h, w, b))):
        assert a.isfinite().all()
        torch.testing.assert_close(a, c, **tol)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_rows_that_spread_past_exp_s_range_give_torch_s_values_and_masked_classes_zero(dtype):
    """Rows whose logits spread further than exp's normal range below their largest (their
    exp is flushed to 0, where torch's CPU exp takes a slow path) and classes masked with a
    -inf bias: the loss and gradients are torch's, and every masked class's gradient is
    exactly 0, as torch's is."""
    h, w, b, t = _inputs(dtype)
    with torch.no_grad():
        w.mul_(60.0)                                   # rows spread over several hundred
        b[1::4] = float("-inf")
        t[t % 4 == 1] = 0
    logits = F.linear(h, w, b).detach()
    spread = logits.amax(-1) - logits.masked_fill(logits.isinf(), float("inf")).amin(-1)
    assert (spread > 200).float().mean() > 0.5         # past fp32's exp range (87)
    ref = F.cross_entropy(F.linear(h, w, b).flatten(0, -2), t.flatten())
    got = lce(h, w, t, b, chunk_tokens=16)
    tol = dict(rtol=1e-10, atol=1e-9) if dtype == torch.float64 else dict(rtol=1e-4, atol=1e-3)
    torch.testing.assert_close(got, ref, **tol)
    mine, theirs = _grads(got, (h, w, b)), _grads(ref, (h, w, b))
    for a, c in zip(mine, theirs):
        torch.testing.assert_close(a, c, **tol)
    assert (mine[1][1::4] == 0).all() and (mine[2][1::4] == 0).all()
    assert (theirs[1][1::4] == 0).all()


def test_fp32_agrees_with_torch_and_float64():
    h, w, b, t = _inputs(torch.float32)
    h64, w64, b64 = (x.detach().double().requires_grad_() for x in (h, w, b))
    ref = F.cross_entropy(F.linear(h64, w64, b64).flatten(0, -2), t.flatten())
    got = lce(h, w, t, b, chunk_tokens=16)
    theirs = _torch(h, w, b, t)
    assert abs(got.item() - ref.item()) <= 2 * abs(theirs.item() - ref.item()) + 1e-6
    for a, c in zip(_grads(got, (h, w, b)), _grads(ref, (h64, w64, b64))):
        torch.testing.assert_close(a.double(), c, rtol=1e-4, atol=1e-6)


def test_bf16_autocast_follows_torch_s_autocast():
    h, w, b, t = _inputs(torch.float32, bias=False)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = lce(h, w, t, chunk_tokens=32)
        theirs = _torch(h, w, None, t)
    h64, w64 = (x.detach().double().requires_grad_() for x in (h, w))
    ref = _torch(h64, w64, None, t)
    assert abs(got.item() - ref.item()) < 0.02 * ref.item()
    assert abs(got.item() - theirs.item()) < 0.02 * ref.item()
    for a, c, r in zip(_grads(got, (h, w)), _grads(theirs, (h, w)), _grads(ref, (h64, w64))):
        assert a.dtype == torch.float32
        # as close to float64 as torch's own autocast is, give or take bf16's rounding
        assert (a.double() - r).norm() <= 2 * (c.double() - r).norm() + 1e-3 * r.norm()


def test_bf16_tensors_give_bf16_grads():
    h, w, b, t = _inputs(torch.bfloat16)
    got = lce(h, w, t, b)
    gh, gw, gb = _grads(got, (h, w, b))
    assert (gh.dtype, gw.dtype, gb.dtype) == (torch.bfloat16,) * 3
    h64, w64, b64 = (x.detach().double().requires_grad_() for x in (h, w, b))
    for a, r in zip((gh, gw, gb), _grads(_torch(h64, w64, b64, t), (h64, w64, b64))):
        assert (a.double() - r).norm() < 0.02 * r.norm()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_weight_s_gradient_is_held_in_its_dtype_and_near_torch_s(dtype):
    """Between forward and backward the weight's gradient is held in bf16 for a bf16 weight
    (half the bytes), in fp32 for an fp32 or fp16 one (an fp16 sum could overflow); summed
    over 8 slices with a rounding each, the bf16 gradient stays within 3x torch's own
    autocast error against float64."""
    g = torch.Generator().manual_seed(1)
    h = torch.randn(512, 64, generator=g).to(dtype).requires_grad_()
    w = (torch.randn(2048, 64, generator=g) * 0.05).to(dtype).requires_grad_()
    t = torch.randint(0, 2048, (512,), generator=g)
    held = []
    with torch.autograd.graph.saved_tensors_hooks(lambda x: held.append(x) or x, lambda x: x):
        loss = lce(h, w, t, chunk_tokens=64)
    assert [x.dtype for x in held if x.shape == w.shape] == [
        torch.bfloat16 if dtype == torch.bfloat16 else torch.float32]
    (gw,) = torch.autograd.grad(loss, [w])
    w64 = w.detach().double().requires_grad_()
    (ref,) = torch.autograd.grad(_torch(h.detach().double(), w64, None, t), [w64])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        (theirs,) = torch.autograd.grad(_torch(h, w, None, t), [w])
    assert gw.dtype == dtype
    assert (gw.double() - ref).norm() <= 3 * (theirs.double() - ref).norm()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sums_made_a_block_of_rows_at_a_time_hold(monkeypatch, dtype):
    """The weight's gradient is summed, and scaled in the backward, a block of rows at a time
    (a block is 1 MiB): with blocks of one row, the loss and gradients are those of the whole
    sums, for fp32 and for bf16 weights (whose fp32 sums are cast block by block)."""
    h, w, b, t = _inputs(dtype)
    whole = _grads(lce(h, w, t, b, chunk_tokens=16), (h, w, b))
    import ampc.memory._head_loss as head_loss
    monkeypatch.setattr(head_loss, "_SLICE_BYTES", 16)       # one row a block
    rows = _grads(lce(h, w, t, b, chunk_tokens=16), (h, w, b))
    for a, c in zip(rows, whole):
        assert a.dtype == c.dtype == dtype
        torch.testing.assert_close(a, c, rtol=1e-5 if dtype == torch.float32 else 1e-2,
                                   atol=1e-6 if dtype == torch.float32 else 1e-3)


def test_only_what_needs_a_gradient_gets_one():
    h, w, b, t = _inputs(torch.float64)
    w.requires_grad_(False)
    (gh,) = torch.autograd.grad(lce(h, w, t), [h])
    ref = F.cross_entropy(F.linear(h, w).flatten(0, -2), t.flatten())
    torch.testing.assert_close(gh, torch.autograd.grad(ref, [h])[0])
    with torch.no_grad():
        torch.testing.assert_close(lce(h, w, t), ref.detach())


def test_the_logits_are_never_whole():
    # a step's peak from ampc.memory.report: the head + loss of 512 tokens x 8192 classes
    class Head(torch.nn.Module):
        def __init__(self, chunked):
            super().__init__()
            self.body = torch.nn.Linear(64, 64)
            self.head = torch.nn.Linear(64, 8192, bias=False)
            self.chunked = chunked

        def forward(self, x):
            return self.body(x)

    def loss_fn(model):
        def f(hidden, t):
            if model.chunked:
                return lce(hidden, model.head.weight, t)
            return F.cross_entropy(model.head(hidden).flatten(0, -2), t.flatten())
        return f

    x = torch.randn(4, 128, 64)
    t = torch.randint(0, 8192, (4, 128))
    peaks = {}
    for chunked in (False, True):
        torch.manual_seed(0)
        model = Head(chunked)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        peaks[chunked] = ampc.memory.report(model, opt, (x, t), loss_fn(model), warmup=1).peak
    logits = 512 * 8192 * 4
    assert peaks[False] - peaks[True] > 1.5 * logits, peaks


def test_gpt2_trains_like_the_whole_logits():
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(vocab_size=2000, n_positions=64, n_embd=64, n_layer=2, n_head=4,
                                     resid_pdrop=0, embd_pdrop=0, attn_pdrop=0)
    tokens = torch.randint(0, 2000, (4, 64), generator=torch.Generator().manual_seed(3))
    curves = []
    for chunked in (False, True):
        torch.manual_seed(0)
        model = transformers.GPT2LMHeadModel(config)         # the head is tied to the embedding
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        curve = []
        for _ in range(15):
            if chunked:
                hidden = model.transformer(input_ids=tokens).last_hidden_state
                loss = lce(hidden[:, :-1], model.lm_head.weight, tokens[:, 1:])
            else:
                logits = model(input_ids=tokens).logits
                loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())
            loss.backward()
            opt.step()
            opt.zero_grad()
            curve.append(loss.item())
        curves.append(curve)
    assert curves[0][-1] < 0.8 * curves[0][0]
    for a, b in zip(*curves):
        assert abs(a - b) < 1e-3 * a


@pytest.mark.parametrize("call, match", [
    (lambda h, w, t: lce(h.long(), w, t), "hidden must be a floating tensor"),
    (lambda h, w, t: lce(h, w.t(), t), r"weight must be \(vocab, 24\)"),
    (lambda h, w, t: lce(h, w, t.float()), "target must be an integer tensor"),
    (lambda h, w, t: lce(h, w, t[:, 1:]), "target must have hidden's shape"),
    (lambda h, w, t: lce(h, w, t, torch.zeros(5)), r"bias must be \(300,\)"),
    (lambda h, w, t: lce(h, w, t, reduction="none"), "reduction must be 'mean' or 'sum'"),
    (lambda h, w, t: lce(h, w, t, chunk_tokens=0), "chunk_tokens must be an int >= 1"),
    (lambda h, w, t: lce(h, w, t, chunk_tokens=2.5), "chunk_tokens must be an int >= 1"),
])
def test_bad_input_names_the_argument(call, match):
    h, w, _, t = _inputs(torch.float32)
    with pytest.raises((TypeError, ValueError), match="ampc.memory.linear_cross_entropy: " + match):
        call(h, w, t)


def test_double_backward_is_refused():
    h, w, b, t = _inputs(torch.float64)
    with pytest.raises(RuntimeError, match=r"linear_cross_entropy: .* cannot be differentiated again"):
        torch.autograd.grad(lce(h, w, t, b), [h], create_graph=True)
