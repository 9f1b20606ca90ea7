"""ampc in torchtitan (its config-tree API, release 0.3): FP8 layers from ``ampc.fp8`` through a
model converter, and ampc's master-weight AdamW as the optimizer.

    from ampc.integrations.torchtitan import AmpcFloat8Converter, AmpcOptimizersContainer
    spec = model_registry("8B", converters=[AmpcFloat8Converter.Config(recipe="delayed")])
    config.optimizer = ampc_optimizers(config.optimizer)     # "AdamW" is ampc's now

torchtitan's ``training.dtype="bfloat16"`` trains pure bf16: weights, gradients and
Adam's moments in bf16, no fp32 copy. With ``AmpcOptimizersContainer`` the optimizers named
"Adam" / "AdamW" are ampc's, which keep fp32 master weights and fp32 moments for bf16
parameters and write the bf16 weights from the masters in the same fused step: the model
stays bf16, the updates no longer round away.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields

import torch

try:
    from torchtitan.components.optimizer import OptimizersContainer
    from torchtitan.components.quantization import QuantizationConverter
    from torchtitan.config.configurable import Configurable
    from torchtitan.models.common.linear import Linear
except ImportError as e:
    raise ImportError("ampc.integrations.torchtitan needs torchtitan 0.3 "
                      "(pip install torchtitan==0.3.0)") from e

import ampc

from ._settings import Recipe, recipe_named

__all__ = ["AmpcFloat8Converter", "AmpcOptimizersContainer", "Float8Linear", "ampc_optimizers"]

_MULTIPLE = 16      # ampc.fp8's GEMMs take dimensions that are multiples of 16


def _recipe(name: str) -> Recipe:
    return recipe_named("ampc.integrations.torchtitan", name)


class Float8Linear(ampc.fp8.Linear, Linear):
    """torchtitan's ``Linear`` (same config, parameters, init) whose GEMMs run in FP8 with
    ``ampc.fp8``: each call opens an ``ampc.fp8.autocast`` region with the layer's recipe
    (torchtitan's loop has no place for one region around the model)."""

    @dataclass(kw_only=True, slots=True)
    class Config(Linear.Config):
        recipe: str = "delayed"

    def __init__(self, config: Float8Linear.Config) -> None:
        Linear.__init__(self, config)
        self.recipe = _recipe(config.recipe)
        self._init_fp8_state(self.weight.device)

    def _init_fp8_state(self, device):
        # the scaling state of a fresh ampc.fp8.Linear, as this layer's buffers (its weight's
        # init must not move the random stream the model's init draws from)
        with torch.random.fork_rng(devices=[]):
            fresh = ampc.fp8.Linear(_MULTIPLE, _MULTIPLE, bias=False, device=device)
        for name, buf in fresh.named_buffers():
            persistent = name in fresh.state_dict()
            self.register_buffer(name, buf, persistent=persistent)

    def _init_self_buffers(self, buffer_device=None):
        # torchtitan builds on the meta device, then re-creates the buffers here
        self._init_fp8_state(buffer_device or self.weight.device)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        with ampc.fp8.autocast(recipe=self.recipe):
            return ampc.fp8.Linear.forward(self, input)


class AmpcFloat8Converter(QuantizationConverter):
    """A model converter (``converters=[AmpcFloat8Converter.Config(...)]``) that turns the
    ``Linear.Config`` entries of a model config into :class:`Float8Linear` ones.

    Config:
        recipe: ``"delayed"`` (``ampc.fp8.DelayedScaling()``, default) or ``"current"``.
        filter_fqns: names of layers to keep in high precision (a layer whose name contains
            one of them is skipped). Layers whose dimensions are not multiples of 16 are
            always skipped.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(QuantizationConverter.Config):
        recipe: str = "delayed"
        filter_fqns: list[str] = field(default_factory=list)

    def __init__(self, config: AmpcFloat8Converter.Config) -> None:
        _recipe(config.recipe)      # a bad name fails here, before the model is built
        self.config = config

    def _keep(self, fqn, cfg):
        return (any(f in fqn for f in self.config.filter_fqns)
                or cfg.in_features % _MULTIPLE or cfg.out_features % _MULTIPLE)

    def convert(self, model_config: Configurable.Config) -> Configurable.Config:
        for fqn, cfg, parent, attr in list(model_config.traverse(Linear.Config)):
            if type(cfg) is not Linear.Config or self._keep(fqn, cfg):
                continue
            new = Float8Linear.Config(in_features=cfg.in_features, out_features=cfg.out_features,
                                      bias=cfg.bias, param_init=cfg.param_init,
                                      sharding_config=cfg.sharding_config,
                                      recipe=self.config.recipe)
            if parent is None:
                model_config = new
            elif isinstance(parent, list):
                parent[attr] = new
            else:
                setattr(parent, attr, new)
        return model_config


class AmpcOptimizersContainer(OptimizersContainer):
    """torchtitan's ``OptimizersContainer`` whose "Adam" and "AdamW" are ``ampc.optim.Adam``
    / ``AdamW`` (fp32 master weights for bf16 and fp16 parameters, one fused step); other
    names are torchtitan's. Use its ``Config`` where ``OptimizersContainer.Config`` was."""

    @dataclass(kw_only=True, slots=True)
    class Config(OptimizersContainer.Config):
        pass

    def __init__(self, config: AmpcOptimizersContainer.Config, *,
                 model_parts: list[torch.nn.Module]) -> None:
        if config.implementation == "fused_opt_states_bf16":
            raise ValueError("AmpcOptimizersContainer: implementation='fused_opt_states_bf16' "
                             "keeps bf16 moments; ampc's optimizers keep fp32 ones (use 'fused')")
        super().__init__(config, model_parts=model_parts)

    @staticmethod
    def _resolve_optimizer_factory(name):
        ours = {"Adam": ampc.optim.Adam, "AdamW": ampc.optim.AdamW}
        if name in ours:
            return ours[name]
        return OptimizersContainer._resolve_optimizer_factory(name)


def ampc_optimizers(config: OptimizersContainer.Config) -> AmpcOptimizersContainer.Config:
    """``config`` (an ``OptimizersContainer.Config``, e.g. ``default_adamw(...)``) as an
    :class:`AmpcOptimizersContainer` config with the same param groups and settings."""
    if not isinstance(config, OptimizersContainer.Config):
        raise TypeError(f"ampc_optimizers: config must be an OptimizersContainer.Config, "
                        f"got {type(config).__name__}")
    return AmpcOptimizersContainer.Config(**{f.name: getattr(config, f.name)
                                             for f in fields(config) if f.init})
