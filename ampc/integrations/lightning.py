"""ampc as a Lightning precision plugin.

    from ampc.integrations.lightning import AmpcPrecision
    trainer = lightning.pytorch.Trainer(plugins=[AmpcPrecision("16-mixed")], gradient_clip_val=1.0)

``AmpcPrecision`` does what Lightning's ``MixedPrecision`` does, with ampc's parts:
``ampc.autocast`` for the forward (with an edited cast policy if given), ``ampc.GradScaler``
for ``"16-mixed"`` (dynamic or static), gradient clipping by norm folded into the step of
ampc's optimizers (Lightning's own plugin refuses to clip for an optimizer that unscales in
its step), optional master-weight training (``ampc.prepare`` on the optimizers Lightning
made) and optional FP8 (``ampc.fp8``). The scaler's state goes into Lightning's checkpoints.

``AmpcFabricPrecision`` is the same for ``lightning.fabric.Fabric(plugins=[...])`` (Fabric
clips through ``unscale_gradients``; master weights: call ``ampc.prepare`` yourself).

Lightning's FSDP strategy accepts only its own ``FSDPPrecision``; shard with FSDP2 through
``ModelParallelStrategy`` (``fully_shard`` in ``configure_model``) instead, which takes this
plugin.
"""
from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import nn

try:
    from lightning.fabric.plugins.precision import MixedPrecision as _FabricMixedPrecision
    from lightning.pytorch.core.optimizer import LightningOptimizer
    from lightning.pytorch.plugins.precision import MixedPrecision as _MixedPrecision
    from lightning.pytorch.plugins.precision import Precision as _Precision
    from lightning.pytorch.utilities import GradClipAlgorithmType
except ImportError as e:
    raise ImportError("ampc.integrations.lightning needs Lightning (pip install lightning)") from e

import ampc

from ._settings import Recipe, Settings, check

__all__ = ["AmpcPrecision", "AmpcFabricPrecision"]

_DTYPES = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}

_FP8_STATE = "AmpcPrecision.fp8_state"     # checkpoint key of the FP8 layers' scaling state


_CLIP = ("{plugin}: {who} steps each parameter in the backward "
         "(step_in_backward=True) and frees its gradient there")


def _unwrap(optimizer: Any) -> Any:
    return optimizer.optimizer if isinstance(optimizer, LightningOptimizer) else optimizer


def _in_backward(optimizer: Any) -> bool:
    return bool(getattr(optimizer, "step_in_backward", False))


def _setting(field: str) -> property:
    return property(lambda self: getattr(self.settings, field), doc=f"``settings.{field}``")


class _Ampc:
    """What both plugins add to the framework's ``MixedPrecision``: ampc's checked settings
    (the scaler is an ``ampc.GradScaler``) and the FP8 layers."""

    def __init__(self, name: str, precision: str | None, device: str | None,
                 **settings: Any) -> None:
        if precision is None and settings.get("plan") is None:
            precision = "bf16-mixed"
        if precision is not None and precision not in _DTYPES:
            raise ValueError(f"{name}: precision must be '16-mixed' or 'bf16-mixed', "
                             f"got {precision!r}")
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.settings: Settings = check(name, device, _DTYPES.get(precision), **settings)
        precision = next(k for k, v in _DTYPES.items() if v == self.settings.dtype)
        super().__init__(precision, device, self.settings.scaler)

    dtype = _setting("dtype")
    policy = _setting("policy")
    fp8 = _setting("fp8")
    fp8_modules = _setting("fp8_modules")
    cache_enabled = _setting("cache_enabled")

    def convert_module(self, module: nn.Module) -> nn.Module:
        # as Lightning's TransformerEngine plugin swaps its layers: before the optimizers
        # exist, so they see the FP8 layers' parameters (the same tensors). A plan waits for
        # the optimizer (connect): its weights are cast before its modules are placed
        if self.settings.plan is not None:
            return module
        return self.settings.convert(module)


class AmpcPrecision(_Ampc, _MixedPrecision):
    """Mixed precision with ampc for ``lightning.pytorch.Trainer(plugins=[...])``: Lightning's
    ``MixedPrecision`` (loss scaling, the closure, the LBFGS refusal, the skipped step, the
    scaler in the checkpoint) with ampc's autocast and scaler.

    Args:
        precision (str): ``"bf16-mixed"`` (default) or ``"16-mixed"``; with a plan, the
            plan's region (default).
        device (str): the autocast device, ``"cuda"`` or ``"cpu"``. Default: ``"cuda"`` when
            CUDA is available, else ``"cpu"``.
        scaler (ampc.GradScaler, optional): the scaler for ``"16-mixed"``. Default: a new
            ``ampc.GradScaler(device, init_scale=init_scale, dynamic=dynamic)``.
        dynamic (bool): dynamic loss scaling (True, default) or a static scale.
        init_scale (float): the first (or, static, the only) scale. Default: 2.0**16.
        master_weights (bool): turn the model into ``dtype`` weights with fp32 master weights
            in the optimizers (``ampc.prepare`` on each optimizer from
            ``configure_optimizers``, which must be ``ampc.optim.Adam``/``AdamW`` made over the
            model's parameters). Default: False.
        policy (dict, optional): op -> cast policy inside the forward, as
            ``ampc.policy.scope(ops=...)`` (``{"softmax": "fp32"}``).
        fp8 (bool or recipe): run ``fp8_modules`` in FP8 with this ``ampc.fp8`` recipe (True:
            ``DelayedScaling()``). Default: None.
        fp8_modules (tuple of types): the module types converted to ``ampc.fp8.Linear``.
            Default: ``(nn.Linear,)``.
        cache_enabled (bool): autocast's weight cache; off by default, as in Lightning's
            own plugin (a manual-optimization step inside the forward changes the weights).
        compress (str or list): modules of the LightningModule (names or patterns, such as
            ``"model.h.*.mlp"``) whose saved activations are kept in 8 bits until the
            backward (``ampc.memory.compress``), set when Lightning hands the plugin the
            module. Default: None.
        recompute (str or list): modules recomputed in the backward instead of saving their
            activations (``ampc.memory.recompute``: activation checkpointing by module name).
            Default: None.
        sliced_head (str or list): Linear heads whose logits ``F.cross_entropy`` makes a slice
            of tokens at a time, never whole (``ampc.memory.sliced_head``). Default: None.
        plan (ampc.autoprecision.Plan or path): a plan from ``ampc.autoprecision.search``
            (or its file) chooses all of the above instead: the region (``precision`` left
            unset), each module's precision and memory moves, and the weights' and the
            optimizer's state. When Lightning hands over the one optimizer
            ``configure_optimizers`` made (an ``ampc.optim`` one unless the plan keeps fp32
            state), the plugin does what ``plan.prepare`` does on the module the plan was
            searched on (the LightningModule or the outermost module inside it with the
            plan's module names). Given with any of the arguments it chooses: refused.

    An ampc optimizer made with ``step_in_backward=True`` steps each parameter in the
    backward: ``accumulate_grad_batches`` works (the accumulated micro-batches' backwards keep
    their gradients, the last one steps on the sum); ``gradient_clip_val`` is refused when the
    Trainer starts (no gradient is left to clip).

    Gradient clipping by norm (``Trainer(gradient_clip_val=...)``) goes through
    ``scaler.clip_grad_norm_``: with ampc's optimizers the norm is measured in one read of
    the still-scaled gradients and the clip factor is applied inside the optimizer's step.
    ``on_before_optimizer_step`` therefore sees scaled gradients with such an optimizer,
    as with any optimizer that unscales in its own step.
    """

    def __init__(self, precision: str | None = None, device: str | None = None, *,
                 scaler: ampc.GradScaler | None = None, dynamic: bool = True,
                 init_scale: float = 2.0 ** 16, master_weights: bool = False,
                 policy: dict[str, str] | None = None, fp8: bool | Recipe | None = None,
                 fp8_modules: tuple[type[nn.Module], ...] = (nn.Linear,),
                 cache_enabled: bool = False, compress: str | list[str] | None = None,
                 recompute: str | list[str] | None = None,
                 sliced_head: str | list[str] | None = None,
                 plan: ampc.autoprecision.Plan | str | None = None) -> None:
        super().__init__("AmpcPrecision", precision, device, scaler=scaler, dynamic=dynamic,
                         init_scale=init_scale, policy=policy, fp8=fp8, fp8_modules=fp8_modules,
                         cache_enabled=cache_enabled, master_weights=master_weights,
                         compress=compress, recompute=recompute, sliced_head=sliced_head,
                         plan=plan)
        self._module: nn.Module | None = None
        self._stepping = False          # inside optimizer_step (not a micro-batch accumulated)

    master_weights = _setting("master_weights")

    def convert_module(self, module: nn.Module) -> nn.Module:
        self._module = module
        return super().convert_module(module)

    def autocast_context_manager(self) -> AbstractContextManager[None]:
        # Lightning's forward_context enters this
        return self.settings.region()

    # The FP8 scaling state travels in the checkpoint under a key of its own, out of the
    # model's state_dict: Lightning loads the model's weights before convert_module on a
    # fresh run, and a plain model (load_from_checkpoint too) takes no FP8 buffers.
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if self.fp8 is None or "state_dict" not in checkpoint:
            return
        weights = checkpoint["state_dict"]
        keys = [f"{name}.{b}" if name else b for name, m in self._module.named_modules()
                if isinstance(m, ampc.fp8.Linear) for b in ampc.fp8.scaling.PERSISTENT]
        checkpoint[_FP8_STATE] = {k: weights.pop(k) for k in keys if k in weights}

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        state = checkpoint.get(_FP8_STATE)
        if self.fp8 is not None and state:
            self._module.load_state_dict(state, strict=False)

    def connect(self, model: nn.Module, optimizers: list[torch.optim.Optimizer],
                lr_schedulers: list[Any]) -> tuple[nn.Module, list[torch.optim.Optimizer],
                                                   list[Any]]:
        if self.settings.plan is not None:
            if len(optimizers) != 1:
                raise ValueError(f"AmpcPrecision(plan=...): the plan sets up one optimizer; "
                                 f"configure_optimizers made {len(optimizers)}")
            self.settings.set_up_plan("AmpcPrecision(plan=...)", model, _unwrap(optimizers[0]))
        trainer = getattr(self._module, "_trainer", None)
        if trainer is not None and trainer.gradient_clip_val and \
                self._module.automatic_optimization:
            for i, opt in enumerate(optimizers):
                if _in_backward(opt):
                    raise ValueError(_CLIP.format(plugin="AmpcPrecision", who=f"optimizer {i}")
                                     + ": Trainer("
                                     f"gradient_clip_val={trainer.gradient_clip_val}) would "
                                     "find none. Drop gradient_clip_val or pass "
                                     "step_in_backward=False")
        if self.master_weights:
            for i, opt in enumerate(optimizers):
                # the fp32 weights become the masters, the model's weights low precision
                self.settings.make_master_weights("AmpcPrecision", f"optimizer {i}", model, opt)
        return model, optimizers, lr_schedulers

    def backward(self, tensor: torch.Tensor, model: Any, optimizer: Any, *args: Any,
                 **kwargs: Any) -> None:
        # Lightning runs the closure of a micro-batch it accumulates outside optimizer_step:
        # an optimizer that steps in the backward keeps that micro-batch's gradients instead
        inner = _unwrap(optimizer)
        if _in_backward(inner) and model.automatic_optimization and not self._stepping:
            with inner.accumulating():
                return super().backward(tensor, model, optimizer, *args, **kwargs)
        return super().backward(tensor, model, optimizer, *args, **kwargs)

    def optimizer_step(self, optimizer: Any, model: Any, closure: Any, **kwargs: Any) -> Any:
        self._stepping = True
        try:
            return super().optimizer_step(optimizer, model=model, closure=closure, **kwargs)
        finally:
            self._stepping = False

    def clip_gradients(self, optimizer: torch.optim.Optimizer, clip_val: float = 0.0,
                       gradient_clip_algorithm: GradClipAlgorithmType =
                       GradClipAlgorithmType.NORM) -> None:
        # Lightning's MixedPrecision refuses an optimizer that unscales in its step; ampc
        # folds the clip into that step. Manual optimization hands over Lightning's wrapper:
        # the scaler keys its state by the optimizer itself.
        optimizer = _unwrap(optimizer)
        if clip_val and _in_backward(optimizer):
            raise RuntimeError(_CLIP.format(plugin="AmpcPrecision", who="the optimizer")
                               + ": there is nothing left to clip. Pass step_in_backward=False "
                               "to clip")
        _Precision.clip_gradients(self, optimizer, clip_val, gradient_clip_algorithm)

    def clip_grad_by_norm(self, optimizer: torch.optim.Optimizer, clip_val: float) -> None:
        if self.scaler is None:
            return super().clip_grad_by_norm(optimizer, clip_val)
        self.scaler.clip_grad_norm_(optimizer, clip_val)

    def clip_grad_by_value(self, optimizer: torch.optim.Optimizer, clip_val: float) -> None:
        # MixedPrecision's step unscaled an optimizer that cannot unscale in its own step
        # before the hooks; the gradients are still scaled for the others, and for every
        # optimizer when manual optimization clips before its step
        scaled = (getattr(optimizer, "_step_supports_amp_scaling", False)
                  or not self._module.automatic_optimization)
        if self.scaler is not None and scaled:
            self.scaler.unscale_(optimizer)
        super().clip_grad_by_value(optimizer, clip_val)


class AmpcFabricPrecision(_Ampc, _FabricMixedPrecision):
    """Mixed precision with ampc for ``lightning.fabric.Fabric(plugins=[...])``: Fabric's
    ``MixedPrecision`` (floating inputs cast to the low dtype, loss scaling in ``backward``,
    the LBFGS refusal, the scaler in the checkpoint) with ampc's autocast and scaler; the
    arguments of :class:`AmpcPrecision` but ``master_weights`` (call ``ampc.prepare`` on the
    model and optimizer before ``fabric.setup``). Autocast's weight cache stays on by default.
    ``fabric.clip_gradients`` unscales through :meth:`unscale_gradients`, which works with
    optimizers that unscale in their step too (Fabric's own plugin refuses them). With an
    ampc optimizer made with ``step_in_backward=True``, accumulate micro-batches inside
    ``optimizer.accumulating()``; ``fabric.clip_gradients`` is refused (no gradient is left).
    ``plan=`` (a plan or its file) chooses the region and every module's part, placed when
    ``fabric.setup`` converts the model; Fabric does not hand its plugin the optimizer, so a
    plan whose state or freed gradients take one needs ``plan.prepare_state(model, opt)``
    first (refused, naming that call, when it was not made)."""

    def __init__(self, precision: str | None = None, device: str | None = None, *,
                 scaler: ampc.GradScaler | None = None, dynamic: bool = True,
                 init_scale: float = 2.0 ** 16, policy: dict[str, str] | None = None,
                 fp8: bool | Recipe | None = None,
                 fp8_modules: tuple[type[nn.Module], ...] = (nn.Linear,),
                 cache_enabled: bool | None = None, compress: str | list[str] | None = None,
                 recompute: str | list[str] | None = None,
                 sliced_head: str | list[str] | None = None,
                 plan: ampc.autoprecision.Plan | str | None = None) -> None:
        super().__init__("AmpcFabricPrecision", precision, device, scaler=scaler,
                         dynamic=dynamic, init_scale=init_scale, policy=policy, fp8=fp8,
                         fp8_modules=fp8_modules, cache_enabled=cache_enabled,
                         compress=compress, recompute=recompute, sliced_head=sliced_head,
                         plan=plan)

    def convert_module(self, module: nn.Module) -> nn.Module:
        # Fabric hands over the model alone: the plan's state was made on the optimizer
        # before fabric.setup (plan.prepare_state), its modules' part is placed here
        if self.settings.plan is not None:
            self.settings.set_up_plan("AmpcFabricPrecision(plan=...)", module)
            return module
        return super().convert_module(module)

    def forward_context(self) -> AbstractContextManager[None]:
        return self.settings.region()

    def unscale_gradients(self, optimizer: torch.optim.Optimizer) -> None:
        # fabric.clip_gradients comes here first, with or without a scaler
        if _in_backward(optimizer):
            raise RuntimeError(_CLIP.format(plugin="AmpcFabricPrecision", who="the optimizer")
                               + ": there is nothing left to clip. Pass step_in_backward=False "
                               "to clip")
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)
