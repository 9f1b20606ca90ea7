"""ampc in torchtitan 0.3 (CPU): the FP8 converter on torchtitan's config tree and models, and
ampc's AdamW through torchtitan's optimizer container, against torchtitan's own pure-bf16
training (training.dtype="bfloat16") and fp32 training."""
import copy
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

from integration_helpers import need, param_bytes, regression_data, state_bytes

need("torchtitan")
from torchtitan.components.optimizer import OptimizersContainer  # noqa: E402
from torchtitan.components.optimizer.optimizer import ParamGroupConfig  # noqa: E402
from torchtitan.models.common.linear import Linear  # noqa: E402
from torchtitan.protocols.module import Module  # noqa: E402

import ampc  # noqa: E402
from ampc.integrations.torchtitan import (  # noqa: E402
    AmpcFloat8Converter, AmpcOptimizersContainer, Float8Linear)


class MLP(Module):
    """A model written against torchtitan's protocol: configs that build modules."""

    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        fc1: Linear.Config
        fc2: Linear.Config

    def __init__(self, config):
        super().__init__()
        self.fc1 = config.fc1.build()
        self.fc2 = config.fc2.build()

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


def _config():
    return MLP.Config(fc1=Linear.Config(in_features=16, out_features=64, bias=True),
                      fc2=Linear.Config(in_features=64, out_features=16))


def _build(config, dtype=torch.float32, seed=0):
    """As torchtitan's trainer builds: under the training dtype (on the CPU here)."""
    torch.manual_seed(seed)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        return config.build()
    finally:
        torch.set_default_dtype(default)


def _optimizers(container, model, lr=1e-3):
    groups = [ParamGroupConfig(pattern=".*", optimizer_name="AdamW",
                               optimizer_kwargs={"lr": lr, "weight_decay": 0.0})]
    return container.Config(param_groups=groups, implementation="for-loop").build(
        model_parts=[model])


@pytest.mark.parametrize("recipe", ["current", "delayed"])
def test_converter_trains_as_ampc_fp8_by_hand(recipe):
    config = AmpcFloat8Converter.Config(recipe=recipe).build().convert(_config())
    model = _build(config)
    assert isinstance(model.fc1, Float8Linear) and isinstance(model.fc2, Float8Linear)
    ref = _build(_config())
    ampc.fp8.convert(ref, modules=(Linear,))
    ref_recipe = (ampc.fp8.DelayedScaling() if recipe == "delayed"
                  else ampc.fp8.Float8CurrentScaling())
    x, y = regression_data(n=32, features=16, outputs=16)
    opt = ampc.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = ampc.optim.AdamW(ref.parameters(), lr=1e-2)
    for _ in range(3):
        loss = F.mse_loss(model(x), y)
        with ampc.fp8.autocast(recipe=ref_recipe):
            ref_loss = F.mse_loss(ref(x), y)
        assert torch.equal(loss, ref_loss)
        loss.backward()
        ref_loss.backward()
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    assert torch.equal(model.fc1.weight, ref.fc1.weight)
    assert torch.equal(model.fc1.fp8_fwd_scale, ref.fc1.fp8_fwd_scale)
    assert "fc2.fp8_fwd_amax_history" in model.state_dict()


def test_converter_on_llama3_debugmodel():
    from torchtitan.models.llama3 import model_registry
    spec = model_registry("debugmodel", converters=[
        AmpcFloat8Converter.Config(recipe="delayed", filter_fqns=["lm_head"])])
    # as torchtitan's trainer: built on the meta device under the training dtype, then
    # materialized and initialized
    with torch.device("meta"):
        model = _build(spec.model, torch.bfloat16)
    model.to_empty(device="cpu")
    model.init_states(buffer_device=torch.device("cpu"))
    model.verify_module_protocol()
    fp8 = [n for n, m in model.named_modules() if isinstance(m, Float8Linear)]
    assert len(fp8) == 30 and not any("lm_head" in n for n in fp8)
    layer = dict(model.named_modules())[fp8[0]]
    assert layer.weight.dtype == torch.bfloat16
    assert layer.fp8_fwd_scale.dtype == torch.float32 and torch.equal(
        layer.fp8_fwd_scale, torch.ones(2))


def test_bf16_training_gets_fp32_masters():
    """training.dtype='bfloat16': torchtitan's own AdamW keeps bf16 moments and no fp32
    weights, so small updates round away; ampc's AdamW through the same container keeps fp32
    masters and tracks fp32 training."""
    x, y = regression_data(n=64, features=16, outputs=16)
    start = _build(_config(), torch.bfloat16)
    runs = {}
    for name, container, dtype in (("fp32", OptimizersContainer, torch.float32),
                                   ("bf16", OptimizersContainer, torch.bfloat16),
                                   ("ampc", AmpcOptimizersContainer, torch.bfloat16)):
        model = copy.deepcopy(start).to(dtype)       # the same start: bf16 values
        opts = _optimizers(container, model, lr=1e-4)
        for _ in range(20):
            F.mse_loss(model(x.to(dtype)).float(), y).backward()
            opts.step()
            opts.zero_grad()
        runs[name] = (model, opts)
    assert isinstance(runs["ampc"][1].optimizers[0], ampc.optim.AdamW)
    ref = runs["fp32"][0].fc1.weight
    ours = runs["ampc"][1].optimizers[0].state[runs["ampc"][0].fc1.weight]["master"]
    start = start.fc1.weight.float()
    moved = ref - start                     # what fp32 training did to the weights
    err_ours = ((ours - start) - moved).norm() / moved.norm()
    err_bf16 = ((runs["bf16"][0].fc1.weight.float() - start) - moved).norm() / moved.norm()
    print(f"\nafter 20 steps at lr 1e-4, the weights' movement against fp32 training's "
          f"(relative error): ampc fp32 masters {err_ours:.3f}, torchtitan pure bf16 "
          f"{err_bf16:.3f}")
    assert err_ours < 0.1 and err_bf16 > 0.5
    # memory per parameter: bf16 weights + bf16 grads + ampc's state, against torchtitan's
    # fp32-master path (fp32 weights, grads and moments under FSDP2's bf16 compute copies)
    model, opts = runs["ampc"]
    n = sum(p.numel() for p in model.parameters())
    ours_b = (2 * param_bytes(model.parameters()) + state_bytes(opts.optimizers[0])) / n
    fp32_model, fp32_opts = runs["fp32"]
    fp32_b = (2 * param_bytes(fp32_model.parameters()) + state_bytes(fp32_opts.optimizers[0])) / n
    bf16_model, bf16_opts = runs["bf16"]
    bf16_b = (2 * param_bytes(bf16_model.parameters()) + state_bytes(bf16_opts.optimizers[0])) / n
    print(f"bytes per parameter (weights + grads + optimizer state): ampc bf16 + fp32 masters "
          f"{ours_b:.1f}, torchtitan fp32 {fp32_b:.1f} (+2 for bf16 compute copies), "
          f"torchtitan pure bf16 {bf16_b:.1f}")
    assert ours_b <= fp32_b


def test_container_state_dict_resumes(tmp_path):
    x, y = regression_data(n=64, features=16, outputs=16)

    def steps(model, opts, k):
        for _ in range(k):
            F.mse_loss(model(x.bfloat16()).float(), y).backward()
            opts.step()
            opts.zero_grad()

    whole = _build(_config(), torch.bfloat16)
    whole_opts = _optimizers(AmpcOptimizersContainer, whole)
    steps(whole, whole_opts, 6)
    first = _build(_config(), torch.bfloat16)
    first_opts = _optimizers(AmpcOptimizersContainer, first)
    steps(first, first_opts, 3)
    torch.save({"model": first.state_dict(), "optim": first_opts.state_dict()}, tmp_path / "ck.pt")
    saved = torch.load(tmp_path / "ck.pt", weights_only=True)
    assert saved["optim"]["state.fc1.weight.master"].dtype == torch.float32
    rest = _build(_config(), torch.bfloat16, seed=1)
    rest.load_state_dict(saved["model"])
    rest_opts = _optimizers(AmpcOptimizersContainer, rest)
    rest_opts.load_state_dict(saved["optim"])
    steps(rest, rest_opts, 3)
    for p, q in zip(rest.parameters(), whole.parameters()):
        assert torch.equal(p, q)


def test_bad_configs():
    with pytest.raises(ValueError, match="recipe must be 'delayed' or 'current'"):
        AmpcFloat8Converter.Config(recipe="mx").build()
    model = _build(_config())
    config = AmpcOptimizersContainer.Config(
        param_groups=[ParamGroupConfig(pattern=".*", optimizer_name="AdamW",
                                       optimizer_kwargs={"lr": 1e-3})],
        implementation="fused_opt_states_bf16")
    with pytest.raises(ValueError, match="fused_opt_states_bf16"):
        config.build(model_parts=[model])
