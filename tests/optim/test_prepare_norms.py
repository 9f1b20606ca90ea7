"""ampc.prepare keeps in fp32 the norms of the models people load, not only torch's classes:
transformers' LlamaRMSNorm and T5LayerNorm, a model's own norm class, found by what the
module computes; a module that only scales by a 1-d weight is cast like the rest; the
model says which it kept and why."""
import pytest
import torch
from torch import nn

import ampc
import ampc.optim

transformers = pytest.importorskip("transformers")
from transformers.models.llama.modeling_llama import LlamaRMSNorm  # noqa: E402
from transformers.models.t5.modeling_t5 import T5LayerNorm  # noqa: E402

f32, bf16 = torch.float32, torch.bfloat16


class ManualLayerNorm(nn.Module):
    """A user's LayerNorm written out: mean, var, sqrt."""

    def __init__(self, d):
        super().__init__()
        self.w, self.b = nn.Parameter(torch.ones(d)), nn.Parameter(torch.zeros(d))

    def forward(self, x):
        mean, var = x.mean(-1, keepdim=True), x.var(-1, keepdim=True, unbiased=False)
        return (x - mean) / torch.sqrt(var + 1e-5) * self.w + self.b


class LayerScale(nn.Module):
    """A 1-d weight that only scales its input: not a norm."""

    def __init__(self, d):
        super().__init__()
        self.gamma = nn.Parameter(torch.full((d,), 0.5))

    def forward(self, x):
        return x * self.gamma


class PeakNorm(nn.Module):
    """Divides by a peak read to the host: detection cannot run it on meta tensors."""

    def __init__(self, d):
        super().__init__()
        self.w = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return x / (x.abs().max().item() + 1e-6) * self.w


def net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(20, 32), LlamaRMSNorm(32), nn.GELU(), nn.Linear(32, 32),
                         T5LayerNorm(32), LayerScale(32), nn.Linear(32, 32), ManualLayerNorm(32),
                         nn.PReLU(32), nn.Linear(32, 32), PeakNorm(32), nn.Linear(32, 1))


def batch(k):
    g = torch.Generator().manual_seed(k)
    x = torch.randn(64, 20, generator=g)
    return x, (x[:, :5].sum(1, keepdim=True) * 0.5).sin()


def test_foreign_and_user_norms_stay_fp32_and_train():
    model, opt = ampc.prepare(net(), ampc.optim.AdamW, bf16, lr=3e-3)
    assert model.ampc_kept_fp32 == {"1": "detected", "4": "detected", "7": "detected"}
    kept = {"1", "4", "7"}
    for name, p in model.named_parameters():
        mod = name.split(".")[0]
        assert p.dtype == (f32 if mod in kept else bf16), name
        assert ("master" in opt.state[p]) == (mod not in kept), name
    seen = []                                  # after prepare's hooks: what the norm computes in
    for i in (1, 4, 7):
        model[i].register_forward_pre_hook(lambda m, a: seen.append(a[0].dtype))
    before = {i: {n: t.clone() for n, t in model[i].state_dict().items()} for i in (1, 4, 7)}
    losses = []
    for k in range(40):
        x, y = batch(k % 4)
        opt.zero_grad()
        loss = ((model(x).float() - y) ** 2).mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert set(seen) == {f32}
    assert all(torch.isfinite(torch.tensor(losses))) and sum(losses[-4:]) < 0.5 * sum(losses[:4])
    for i in (1, 4, 7):                        # trained, and still fp32
        for n, t in model[i].state_dict().items():
            assert t.dtype == f32 and not torch.equal(t, before[i][n]), (i, n)


def test_a_tiny_llama_keeps_every_rmsnorm_and_says_so():
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=2, num_attention_heads=2,
                                   num_key_value_heads=2, max_position_embeddings=32,
                                   bos_token_id=0, eos_token_id=0, pad_token_id=0)
    torch.manual_seed(0)
    model, opt = ampc.prepare(transformers.LlamaForCausalLM(cfg), ampc.optim.AdamW, bf16, lr=1e-3)
    norms = {n for n, m in model.named_modules() if isinstance(m, LlamaRMSNorm)}
    assert len(norms) == 5 and model.ampc_kept_fp32 == dict.fromkeys(norms, "detected")
    for n in norms:
        assert model.get_submodule(n).weight.dtype == f32
    assert model.lm_head.weight.dtype == bf16
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    first = None
    for _ in range(8):
        opt.zero_grad()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        first = first or loss.item()
    assert loss.item() < first


def test_the_list_extends_detection_and_detection_can_be_turned_off():
    model, _ = ampc.prepare(net(), ampc.optim.AdamW, bf16,
                            keep_fp32=ampc.master.NORM_LAYERS + (PeakNorm,))
    assert model.ampc_kept_fp32["10"] == "keep_fp32" and model[10].w.dtype == f32
    model, _ = ampc.prepare(net(), ampc.optim.AdamW, bf16, detect_norms=False)
    assert model.ampc_kept_fp32 == {} and model[1].weight.dtype == bf16     # torch's classes only


def test_bad_settings_are_refused_before_anything_changes():
    model = net()
    for kwargs, msg in (({"keep_fp32": ("LayerNorm",)}, r"keep_fp32 must be a tuple of nn\.Module"),
                        ({"keep_fp32": [nn.LayerNorm]}, r"keep_fp32 must be a tuple of nn\.Module"),
                        ({"detect_norms": "yes"}, r"detect_norms must be True or False")):
        with pytest.raises(TypeError, match=r"ampc\.prepare: " + msg):
            ampc.prepare(model, ampc.optim.AdamW, bf16, **kwargs)
    assert all(p.dtype == f32 for p in model.parameters())
    assert not hasattr(model, "ampc_kept_fp32") and not model._forward_pre_hooks
