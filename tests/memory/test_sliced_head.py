"""ampc.memory.sliced_head: a model's Linear head whose logits are made only inside
F.cross_entropy, a slice of tokens at a time, the model's code and the loss unchanged: the
loss and every gradient those of the plain head (and near a float64 reference), the step's
peak lower, any other use of the logits correct (made whole, with a warning)."""
import contextlib
import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ampc

VOCAB, WIDTH = 512, 64


class TinyLM(nn.Module):
    """Embedding, a block, a head: the shape every causal LM has."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.body = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.GELU(), nn.LayerNorm(WIDTH))
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, ids):
        return self.head(self.body(self.emb(ids)))


def tokens(b=4, t=17, seed=1):
    return torch.randint(0, VOCAB, (b, t), generator=torch.Generator().manual_seed(seed))


def lm_loss(logits, ids):
    # the usual next-token loss: a slice of the sequence, a flatten, a cast, cross-entropy
    return F.cross_entropy(logits[:, :-1, :].flatten(0, 1).float(), ids[:, 1:].flatten())


def step(model, ids, sliced, dtype=None):
    model = copy.deepcopy(model)
    if sliced:
        ampc.memory.sliced_head(model, "head")
    with ampc.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
        loss = lm_loss(model(ids), ids)
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


def test_loss_and_gradients_are_the_plain_heads_and_near_float64():
    torch.manual_seed(0)
    model, ids = TinyLM(), tokens()
    with warnings.catch_warnings():
        warnings.simplefilter("error")            # nothing was made whole
        loss, grads = step(model, ids, sliced=True)
    ref_loss, ref_grads = step(model, ids, sliced=False)
    f64_loss, f64_grads = step(model.double(), ids, sliced=False)
    assert abs(float(loss) - float(ref_loss)) < 1e-6 * abs(float(ref_loss))
    for n in ref_grads:
        assert rel(grads[n], ref_grads[n]) < 1e-5, n
        assert rel(grads[n], f64_grads[n]) < 1e-5, n


def test_under_autocast_it_computes_as_the_plain_bf16_head():
    torch.manual_seed(0)
    model, ids = TinyLM(), tokens()
    loss, grads = step(model, ids, sliced=True, dtype=torch.bfloat16)
    ref_loss, ref_grads = step(model, ids, sliced=False, dtype=torch.bfloat16)
    assert abs(float(loss) - float(ref_loss)) < 1e-3 * abs(float(ref_loss))
    for n in ref_grads:                           # bf16 matmuls, summed in other orders
        assert rel(grads[n], ref_grads[n]) < 2e-2, n


@pytest.mark.parametrize("region", ["torch", "ampc", "none"])
def test_the_loss_has_the_plain_heads_dtype_in_every_region(region):
    """A model that takes cross-entropy of its bf16-region logits as they come (no .float(),
    as transformers' BERT and T5 do): under an autocast the plain loss is fp32 (autocast runs
    the loss in fp32), so the sliced one must be too, not rounded to bf16; outside one a bf16
    model's loss is bf16 either way."""
    torch.manual_seed(0)
    model, ids = TinyLM(), tokens()
    if region == "none":
        model = model.to(torch.bfloat16)
    auto = {"torch": torch.autocast, "ampc": ampc.autocast}.get(region)
    got = {}
    for sliced in (False, True):
        m = copy.deepcopy(model)
        if sliced:
            ampc.memory.sliced_head(m, "head")
        with auto("cpu", dtype=torch.bfloat16) if auto else contextlib.nullcontext():
            loss = F.cross_entropy(m(ids).flatten(0, 1), ids.flatten())
        loss.backward()
        got[sliced] = loss.detach()
    assert got[True].dtype == got[False].dtype == (torch.bfloat16 if auto is None else torch.float32)
    # a bf16 loss may round one ulp apart (2^-7 of it): the plain one's sums run in bf16
    tol = 2.0 ** -7 if auto is None else 1e-3
    assert abs(float(got[True]) - float(got[False])) <= tol * abs(float(got[False]))


def test_a_scope_that_casts_its_outputs_casts_the_deferred_logits():
    """A head under a module scope with cast_outputs (fp16 in a bf16 region hands back
    fp32) gives deferred logits of that dtype, as the plain head's, and the same loss."""
    torch.manual_seed(0)
    model, ids = TinyLM(), tokens()
    got = {}
    for sliced in (False, True):
        m = copy.deepcopy(model)
        ampc.policy.module_scope(m.head, dtype=torch.float16, cast_outputs=torch.float32)
        if sliced:
            ampc.memory.sliced_head(m, "head")
        with ampc.autocast("cpu", dtype=torch.bfloat16):
            logits = m(ids)
            got[sliced] = (logits.dtype, lm_loss(logits, ids).item())
    assert got[True][0] == got[False][0] == torch.float32
    assert abs(got[True][1] - got[False][1]) < 1e-3 * abs(got[False][1])


def test_a_transformers_models_own_loss_and_a_tied_head():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(n_embd=64, n_layer=1, n_head=2, vocab_size=VOCAB,
                                  n_positions=32, resid_pdrop=0, embd_pdrop=0, attn_pdrop=0,
                                  bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg)
    ids = tokens(t=24)
    out = {}
    for sliced in (False, True):
        m = copy.deepcopy(model)
        if sliced:
            ampc.memory.sliced_head(m, "lm_head")
        with warnings.catch_warnings():
            warnings.simplefilter("error", UserWarning)
            loss = m(input_ids=ids, labels=ids, use_cache=False).loss   # its own shifted loss
        loss.backward()
        out[sliced] = loss.detach(), m.transformer.wte.weight.grad    # tied to lm_head
    assert abs(float(out[True][0]) - float(out[False][0])) < 1e-5
    assert rel(out[True][1], out[False][1]) < 1e-5


def test_the_steps_peak_is_lower():
    torch.manual_seed(0)
    model, ids = TinyLM(), tokens(b=8, t=129)
    peaks = {}
    for sliced in (False, True):
        m = copy.deepcopy(model)
        if sliced:
            ampc.memory.sliced_head(m, "head", chunk_tokens=64)
        peaks[sliced] = ampc.memory.report(m, torch.optim.AdamW(m.parameters()),
                                           (ids, ids), lm_loss).peak
    # the logits are 8 x 128 x 512 fp32 (2 MiB) with their fp32 copy and log-softmax
    assert peaks[True] < peaks[False] - (2 << 20), peaks


def test_other_uses_make_the_logits_whole_with_a_warning():
    torch.manual_seed(0)
    model, ids = TinyLM(), tokens()
    plain = model(ids)
    ampc.memory.sliced_head(model, "head")
    logits = model(ids)
    assert isinstance(logits, ampc.memory.DeferredLogits)
    assert logits.shape == plain.shape and logits.dtype == plain.dtype
    with pytest.warns(UserWarning, match="sliced_head: argmax needs the whole logits"):
        picked = logits.argmax(-1)
    assert torch.equal(picked, plain.argmax(-1))
    assert torch.allclose(F.softmax(model(ids), -1), F.softmax(plain, -1), atol=1e-6)
    # the vocabulary reshaped away: made whole too, still right
    assert torch.allclose(model(ids).reshape(-1), plain.reshape(-1), atol=1e-6)
    with torch.no_grad():                          # evaluation: the plain head
        assert type(model(ids)) is torch.Tensor


def test_refusals_and_remove():
    model = TinyLM()
    with pytest.raises(TypeError, match=r"sliced_head: 'body.2' is torch.nn.modules.normalization.LayerNorm, not torch.nn.Linear; only a torch.nn.Linear head"):
        ampc.memory.sliced_head(model, "body.2")
    with pytest.raises(ValueError, match="sliced_head: chunk_tokens must be"):
        ampc.memory.sliced_head(model, "head", chunk_tokens=0)
    with pytest.raises(ValueError, match="names no module"):
        ampc.memory.sliced_head(model, "haed")
    handle = ampc.memory.sliced_head(model, "head")
    assert ampc.memory.sliced_heads(model) == ["head"]
    with pytest.raises(ValueError, match="defers its logits already"):
        ampc.memory.sliced_head(model, "head")
    copied = copy.deepcopy(model)                  # a copy defers through its own head
    assert isinstance(copied(tokens()), ampc.memory.DeferredLogits)
    handle.remove()
    assert ampc.memory.sliced_heads(model) == [] and type(model(tokens())) is torch.Tensor


def test_an_fp8_head_is_refused_by_its_full_class_name():
    # an ampc.fp8.Linear is also called "Linear": the message names both classes in full
    model = TinyLM()
    model.head = ampc.fp8.Linear(WIDTH, VOCAB)
    with pytest.raises(TypeError, match=r"'head' is ampc\.fp8\.linear\.Linear, not torch\.nn\.Linear"):
        ampc.memory.sliced_head(model, "head")
    assert ampc.memory.sliced_heads(model) == []
