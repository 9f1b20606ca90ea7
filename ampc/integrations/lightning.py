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
import torch
from torch import nn

try:
    from lightning.fabric.plugins.precision import Precision as _FabricPrecision
    from lightning.pytorch.plugins.precision import Precision as _Precision
    from lightning.pytorch.utilities import GradClipAlgorithmType
    from lightning_utilities.core.apply_func import apply_to_collection
except ImportError as e:
    raise ImportError("ampc.integrations.lightning needs Lightning (pip install lightning)") from e

import ampc

from ._region import fp8_recipe, region

__all__ = ["AmpcPrecision", "AmpcFabricPrecision"]

_DTYPES = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}


_FP8_STATE = "AmpcPrecision.fp8_state"     # checkpoint key of the FP8 layers' scaling state


def _unwrapped(optimizer):
    """The optimizer a LightningOptimizer wraps (manual optimization hands the wrapper to
    clip_gradients, the step the optimizer itself): the scaler keys its state by it."""
    return getattr(optimizer, "_optimizer", optimizer)


def _to_floating(t, dtype):
    return t.to(dtype) if torch.is_floating_point(t) else t


class _Config:
    """What both plugins share: the settings, the scaler and the forward context."""

    def _configure(self, name, precision, device, scaler, dynamic, init_scale, policy, fp8,
                   fp8_modules, cache_enabled):
        if precision not in _DTYPES:
            raise ValueError(f"{name}: precision must be '16-mixed' or 'bf16-mixed', "
                             f"got {precision!r}")
        self.precision = precision
        self.dtype = _DTYPES[precision]
        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        if scaler is not None and precision == "bf16-mixed":
            raise ValueError(f"{name}: precision='bf16-mixed' needs no loss scaling; "
                             f"got scaler={scaler!r}")
        if scaler is None and precision == "16-mixed":
            scaler = ampc.GradScaler(self.device, init_scale=init_scale, dynamic=dynamic)
        self.scaler = scaler
        self.policy = dict(policy or {})
        self.fp8 = fp8_recipe(name, fp8)
        self.fp8_modules = tuple(fp8_modules)
        self.cache_enabled = cache_enabled

    def _convert_fp8(self, module):
        # as Lightning's TransformerEngine plugin swaps its layers: before the optimizers
        # exist, so they see the FP8 layers' parameters (the same tensors)
        if self.fp8 is not None:
            ampc.fp8.convert(module, self.fp8_modules)
        return module

    def forward_context(self):
        return region(self.device, self.dtype, self.cache_enabled, self.policy, self.fp8,
                      self.fp8_modules)

    def state_dict(self):
        return self.scaler.state_dict() if self.scaler is not None else {}

    def load_state_dict(self, state_dict):
        if self.scaler is not None:
            self.scaler.load_state_dict(state_dict)


class AmpcPrecision(_Config, _Precision):
    """Mixed precision with ampc for ``lightning.pytorch.Trainer(plugins=[...])``.

    Args:
        precision (str): ``"bf16-mixed"`` (default) or ``"16-mixed"``.
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

    Gradient clipping by norm (``Trainer(gradient_clip_val=...)``) goes through
    ``scaler.clip_grad_norm_``: with ampc's optimizers the norm is measured in one read of
    the still-scaled gradients and the clip factor is applied inside the optimizer's step.
    ``on_before_optimizer_step`` therefore sees scaled gradients with such an optimizer,
    as with any optimizer that unscales in its own step.
    """

    def __init__(self, precision="bf16-mixed", device=None, *, scaler=None, dynamic=True,
                 init_scale=2.0 ** 16, master_weights=False, policy=None, fp8=None,
                 fp8_modules=(nn.Linear,), cache_enabled=False):
        self._configure("AmpcPrecision", precision, device, scaler, dynamic, init_scale, policy,
                        fp8, fp8_modules, cache_enabled)
        self.master_weights = bool(master_weights)
        self._unscaled = set()      # optimizers unscaled before clipping in this step
        self._module = None

    def convert_module(self, module):
        self._module = module
        return self._convert_fp8(module)

    # The FP8 scaling state travels in the checkpoint under a key of its own, out of the
    # model's state_dict: Lightning loads the model's weights before convert_module on a
    # fresh run, and a plain model (load_from_checkpoint too) takes no FP8 buffers.
    def on_save_checkpoint(self, checkpoint):
        if self.fp8 is None or "state_dict" not in checkpoint:
            return
        weights = checkpoint["state_dict"]
        keys = [f"{name}.{b}" if name else b for name, m in self._module.named_modules()
                if isinstance(m, ampc.fp8.Linear) for b in ampc.fp8.scaling.PERSISTENT]
        checkpoint[_FP8_STATE] = {k: weights.pop(k) for k in keys if k in weights}

    def on_load_checkpoint(self, checkpoint):
        state = checkpoint.get(_FP8_STATE)
        if self.fp8 is not None and state:
            self._module.load_state_dict(state, strict=False)

    def connect(self, model, optimizers, lr_schedulers):
        if self.master_weights:
            for i, opt in enumerate(optimizers):
                if not isinstance(opt, ampc.optim.Adam):
                    raise TypeError(f"AmpcPrecision(master_weights=True): optimizer {i} is "
                                    f"{type(opt).__name__}; configure_optimizers must return "
                                    "ampc.optim.Adam or ampc.optim.AdamW")
                # the fp32 weights become the masters, the model's weights low precision
                ampc.prepare(model, opt, self.dtype)
        return model, optimizers, lr_schedulers

    def pre_backward(self, tensor, module):
        if self.scaler is not None:
            tensor = self.scaler.scale(tensor)
        return super().pre_backward(tensor, module)

    def optimizer_step(self, optimizer, model, closure, **kwargs):
        optimizer = _unwrapped(optimizer)
        if self.scaler is None:
            return super().optimizer_step(optimizer, model=model, closure=closure, **kwargs)
        if isinstance(optimizer, torch.optim.LBFGS):
            raise TypeError("AmpcPrecision: loss scaling ('16-mixed') does not work with LBFGS, "
                            "whose step re-evaluates the closure")
        closure_result = closure()
        skip = closure_result is None and model.automatic_optimization
        if not skip and not getattr(optimizer, "_step_supports_amp_scaling", False):
            # an optimizer that cannot unscale in its step gets true gradients before the
            # hooks, as with Lightning's own plugin
            self.scaler.unscale_(optimizer)
            self._unscaled.add(id(optimizer))
        try:
            self._after_closure(model, optimizer)     # hooks, then clip_gradients
            if skip:
                return closure_result
            out = self.scaler.step(optimizer, **kwargs)
            self.scaler.update()
            return out
        finally:
            self._unscaled.discard(id(optimizer))

    def clip_gradients(self, optimizer, clip_val=0.0,
                       gradient_clip_algorithm=GradClipAlgorithmType.NORM):
        if clip_val <= 0 or self.scaler is None:
            return super().clip_gradients(optimizer, clip_val, gradient_clip_algorithm)
        optimizer = _unwrapped(optimizer)
        if gradient_clip_algorithm == GradClipAlgorithmType.NORM:
            self.scaler.clip_grad_norm_(optimizer, clip_val)
            return
        if id(optimizer) not in self._unscaled:
            self.scaler.unscale_(optimizer)
            self._unscaled.add(id(optimizer))
        torch.nn.utils.clip_grad_value_(list(self.main_params(optimizer)), clip_val)


class AmpcFabricPrecision(_Config, _FabricPrecision):
    """Mixed precision with ampc for ``lightning.fabric.Fabric(plugins=[...])``: the
    arguments of :class:`AmpcPrecision` but ``master_weights`` (call ``ampc.prepare`` on the
    model and optimizer before ``fabric.setup``). As Fabric's own ``MixedPrecision`` it casts
    floating inputs to the low dtype, and keeps autocast's weight cache on by default.
    ``fabric.clip_gradients`` unscales through :meth:`unscale_gradients`, which works with
    optimizers that unscale in their step too (Fabric's own plugin refuses them)."""

    def __init__(self, precision="bf16-mixed", device=None, *, scaler=None, dynamic=True,
                 init_scale=2.0 ** 16, policy=None, fp8=None, fp8_modules=(nn.Linear,),
                 cache_enabled=None):
        self._configure("AmpcFabricPrecision", precision, device, scaler, dynamic, init_scale,
                        policy, fp8, fp8_modules, cache_enabled)

    def convert_module(self, module):
        return self._convert_fp8(module)

    # as Fabric's own MixedPrecision: floating inputs in the low dtype, outputs back
    def convert_input(self, data):
        return apply_to_collection(data, torch.Tensor, _to_floating, self.dtype)

    def convert_output(self, data):
        return apply_to_collection(data, torch.Tensor, _to_floating, torch.get_default_dtype())

    def backward(self, tensor, model, *args, **kwargs):
        # Fabric drops what pre_backward returns: the loss is scaled here
        if self.scaler is not None:
            tensor = self.scaler.scale(tensor)
        super().backward(tensor, model, *args, **kwargs)

    def optimizer_step(self, optimizer, **kwargs):
        if self.scaler is None:
            return super().optimizer_step(optimizer, **kwargs)
        out = self.scaler.step(optimizer, **kwargs)
        self.scaler.update()
        return out

    def unscale_gradients(self, optimizer):
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)
