"""Units found by what a module computes (ampc._module_kinds), not only by class: GPT-2's
Conv1D projections are GEMM units, a model's own RMSNorm a norm unit; what is neither
is left out; detection runs once per module type and shape and leaves the module alone."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ampc
from ampc import _module_kinds
from ampc.autoprecision import _units

transformers = pytest.importorskip("transformers")
from transformers.models.llama.modeling_llama import LlamaRMSNorm  # noqa: E402
from transformers.models.t5.modeling_t5 import T5LayerNorm  # noqa: E402
from transformers.pytorch_utils import Conv1D  # noqa: E402
from test_prepare_norms import LayerScale  # noqa: E402  (a 1-d weight that only scales)


class DepthwiseConv(nn.Module):
    """A convolution written with F.conv2d, weight (C, 1, 3, 3)."""

    def __init__(self, c):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(c, 1, 3, 3))
        self.c = c

    def forward(self, x):
        return F.conv2d(x, self.weight, padding=1, groups=self.c)


class ChannelRMSNorm(nn.Module):
    """Normalises over channels (dim 1) of an image batch; counts its calls."""

    def __init__(self, c):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(c))
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        self.calls += 1
        return x * torch.rsqrt(x.pow(2).mean(1, keepdim=True) + 1e-6) * self.weight[:, None, None]


def test_kind_by_what_the_module_computes():
    assert _module_kinds.kind(Conv1D(24, 16)) == "gemm"          # addmm, weight (in, out)
    assert _module_kinds.kind(DepthwiseConv(8)) == "gemm"
    assert _module_kinds.kind(LlamaRMSNorm(16)) == "norm"
    assert _module_kinds.kind(T5LayerNorm(16)) == "norm"
    assert _module_kinds.kind(ChannelRMSNorm(8)) == "norm"        # channels second
    assert _module_kinds.kind(nn.LayerNorm(16)) == "norm"
    for other in (LayerScale(16), nn.PReLU(16), nn.Embedding(10, 16), nn.GELU(),
                  nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))):   # children hold its tensors
        assert _module_kinds.kind(other) is None, type(other).__name__
    # _units: the class list first, then detection; a type nothing knows is "other"
    assert [_units.kind(m) for m in (nn.Linear(4, 4), Conv1D(8, 8), T5LayerNorm(8), LayerScale(8))] \
        == ["gemm", "gemm", "norm", "other"]


def test_detection_leaves_the_module_alone_and_runs_once_per_type_and_shape(monkeypatch):
    norm = ChannelRMSNorm(8)
    fired = []
    norm.register_forward_pre_hook(lambda m, a: fired.append(1))
    before = norm.weight.detach().clone()
    assert _module_kinds.kind(norm) == "norm"
    assert not fired and norm.calls.item() == 0 and torch.equal(norm.weight, before)
    assert norm.weight.device.type == "cpu"

    traced = []
    real = _module_kinds._trace_kind
    monkeypatch.setattr(_module_kinds, "_cache", {})
    monkeypatch.setattr(_module_kinds, "_trace_kind", lambda m, own: traced.append(1) or real(m, own))
    model = nn.Sequential(*[Conv1D(16, 16) for _ in range(20)], Conv1D(8, 16))
    assert len(_units.find_units(model)) == 21
    assert len(traced) == 2                     # two shapes, one trace each


def tiny_gpt2():
    cfg = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2,
                                  bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(cfg)


def gpt2_batch(k):
    ids = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(k))
    return {"input_ids": ids}, ids


def next_token_loss(out, ids):
    return F.cross_entropy(out.logits[:, :-1].reshape(-1, 64).float(), ids[:, 1:].reshape(-1))


def test_gpt2_conv1d_layers_are_units_and_the_plan_sets_their_dtype():
    model = tiny_gpt2()
    conv = sorted(n for n, m in model.named_modules() if isinstance(m, Conv1D))
    assert len(conv) == 8
    found = _units.find_units(model)
    assert set(conv) <= set(found)
    assert set(_units.find_units(model, (nn.Linear,))) == {"lm_head"}   # named types only

    plan = ampc.autoprecision.search(model, [gpt2_batch(0), gpt2_batch(1)], next_token_loss,
                                     candidates=("fp32", "bf16", "fp8"), objective="memory",
                                     repeats=1, check=False, loss_unit=False,
                                     max_slowdown=None)   # every candidate measured, any CPU
    for n in conv:
        u = plan.unit(n)
        assert (u.type, u.kind) == ("Conv1D", "gemm")
        assert set(u.options) == {"fp32", "bf16"}      # fp8.convert swaps nn.Linear only
        assert u.options["fp32"]["ms"] is not None                # measured, timed
        assert not any(r.get("not_measured") or r.get("error") for r in u.options.values())
    assert "fp8" in plan.unit("lm_head").options

    # applied, a Conv1D unit's addmm runs at its choice
    for n in conv:
        plan.set_choice(n, "bf16")
    plan.set_choice(conv[0], "fp32")
    seen = {}
    for n in conv:
        model.get_submodule(n).register_forward_hook(
            lambda m, a, out, n=n: seen.__setitem__(n, out.dtype))
    applied = plan.apply(model)
    with plan.autocast():
        model(**gpt2_batch(0)[0])
    assert seen[conv[0]] == torch.float32
    assert {seen[n] for n in conv[1:]} == {torch.bfloat16}
    applied.set(conv[0], "bf16")
    with plan.autocast():
        model(**gpt2_batch(0)[0])
    assert seen[conv[0]] == torch.bfloat16
    with pytest.raises(ValueError, match=r"cannot run in fp8"):
        applied.set(conv[1], "fp8")                    # refused, not run as bf16 silently
    assert plan.choice(conv[1]) == "bf16"


class WithSpare(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(16, 16)
        self.spare = Conv1D(16, 16)                    # a unit no batch reaches

    def forward(self, x):
        return self.a(x)


def test_a_unit_never_called_is_named_in_the_notes_and_kept_fp32():
    torch.manual_seed(0)
    batches = [(torch.randn(8, 16), torch.randint(0, 16, (8,))) for _ in range(2)]
    plan = ampc.autoprecision.search(WithSpare(), batches, candidates=("fp32", "bf16"),
                                     objective="memory", repeats=1, loss_unit=False,
                                     max_slowdown=None)
    assert plan.choice("spare") == "fp32" and plan.unit("a").options["fp32"]["ms"] is not None
    assert any("never called on the batches" in note and "spare" in note
               for note in plan.data["notes"])


class InplaceGemm(nn.Module):
    """Halves its input in place, then multiplies: fine inside the model, refused by autograd
    on the leaf input a unit gets when it runs alone."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(16, 16) / 4)

    def forward(self, x):
        return x.mul_(0.5) @ self.weight


def test_a_unit_that_fails_alone_is_named_in_the_notes_and_kept_fp32():
    torch.manual_seed(0)
    batches = [(torch.randn(8, 16), torch.randint(0, 16, (8,))) for _ in range(2)]
    plan = ampc.autoprecision.search(nn.Sequential(nn.Linear(16, 16), InplaceGemm()), batches,
                                     candidates=("fp32", "bf16"), objective="memory", repeats=1,
                                     loss_unit=False, max_slowdown=None)
    assert plan.unit("1").kind == "gemm" and plan.choice("1") == "fp32"
    assert any("in-place operation" in note and "not measured" in note
               for note in plan.data["notes"])


def test_a_tiny_llamas_units_include_its_rmsnorms():
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=2, num_attention_heads=2,
                                   num_key_value_heads=2, max_position_embeddings=32)
    found = _units.find_units(transformers.LlamaForCausalLM(cfg))
    norms = {n for n, m in found.items() if isinstance(m, LlamaRMSNorm)}
    assert len(norms) == 5 and {_units.kind(found[n]) for n in norms} == {"norm"}
    assert len(found) == 5 + 2 * 7 + 1              # norms, 7 Linears a layer, the head
