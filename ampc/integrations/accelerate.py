"""ampc in an Accelerate ``Accelerator`` (and so under the transformers ``Trainer``).

    accelerator = Accelerator(mixed_precision="bf16")     # or "fp16"
    use_ampc(accelerator)                                   # before prepare()
    model, opt = accelerator.prepare(model, ampc.optim.AdamW(model.parameters()))

    trainer = Trainer(model, args, optimizer_cls_and_kwargs=(ampc.optim.AdamW, {"lr": 1e-3}))
    use_ampc(trainer.accelerator)                           # before train()

Accelerate has no public hook for another autocast or scaler (its kwargs handlers match
classes exactly), so ``use_ampc`` changes the one accelerator it is given: the instance's
class becomes a subclass of its own class that

- wraps each prepared model's forward in ``ampc.autocast`` (with a policy scope and
  ``ampc.fp8.autocast`` if asked) instead of ``torch.autocast``, and returns ampc's region
  from ``accelerator.autocast()``;
- uses an ``ampc.GradScaler`` as ``accelerator.scaler`` for fp16 (on the CPU too, where
  Accelerate itself does no fp16 mixed precision), which ``backward``, the optimizer's step,
  ``save_state`` / ``load_state`` and the Trainer's checkpoints use as they use torch's;
- clips by norm through ``scaler.clip_grad_norm_`` (folded into ampc's optimizers' step);
- reports a step that ampc's optimizer skipped on the device in
  ``optimizer_step_was_skipped`` (Accelerate detects a skip by whether ``optimizer.step``
  ran, which an optimizer that skips on the device always does);
- with ``master_weights=True``, runs ``ampc.prepare`` on each ampc optimizer passed to
  ``prepare()`` and the model that holds its parameters: low-precision weights, fp32
  masters in the optimizer.
"""
import functools
from types import MethodType

import torch
from torch import nn

try:
    from accelerate import Accelerator
    from accelerate.optimizer import AcceleratedOptimizer
    from accelerate.utils import DistributedType, convert_outputs_to_fp32
except ImportError as e:
    raise ImportError("ampc.integrations.accelerate needs Accelerate (pip install accelerate)") \
        from e

import ampc

from ._region import fp8_recipe, region

__all__ = ["use_ampc"]

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
_SUPPORTED = (DistributedType.NO, DistributedType.MULTI_CPU, DistributedType.MULTI_GPU)


class _Settings:
    def __init__(self, device, dtype, policy, fp8, fp8_modules, master_weights, cache_enabled):
        self.device, self.dtype = device, dtype
        self.policy, self.fp8, self.fp8_modules = policy, fp8, fp8_modules
        self.master_weights, self.cache_enabled = master_weights, cache_enabled

    def region(self):
        return region(self.device, self.dtype, self.cache_enabled, self.policy, self.fp8,
                      self.fp8_modules)


def use_ampc(accelerator, *, dtype=None, scaler=None, master_weights=False, policy=None,
             fp8=None, fp8_modules=(nn.Linear,), cache_enabled=None):
    """Makes ``accelerator`` train with ampc's autocast and scaler; call it before
    ``prepare()``. Returns the accelerator.

    Args:
        accelerator (accelerate.Accelerator): made with ``mixed_precision="bf16"`` or
            ``"fp16"`` (or ``"no"`` with ``dtype`` given).
        dtype (torch.dtype): torch.bfloat16 or torch.float16. Default: from the
            accelerator's ``mixed_precision``.
        scaler (ampc.GradScaler): the scaler for fp16. Default: ``ampc.GradScaler(device)``.
        master_weights (bool): ``ampc.prepare`` each ampc optimizer given to ``prepare()``
            with its model: ``dtype`` weights, fp32 masters in the optimizer.
        policy (dict): op -> cast policy in the forward (``ampc.policy.scope(ops=...)``).
        fp8 (bool or recipe): run ``fp8_modules`` in FP8 (True: ``DelayedScaling()``); the
            modules are converted to ``ampc.fp8.Linear`` when the model is prepared.
        cache_enabled (bool): autocast's weight cache. Default: ampc's default.
    """
    name = "ampc.integrations.accelerate.use_ampc"
    if not isinstance(accelerator, Accelerator):
        raise TypeError(f"{name}: accelerator must be an accelerate.Accelerator, "
                        f"got {type(accelerator).__name__}")
    if accelerator._models or accelerator._optimizers:
        raise RuntimeError(f"{name}: call it before accelerator.prepare(); this accelerator "
                           "has prepared models or optimizers already")
    if isinstance(accelerator, _AmpcAccelerator):
        raise RuntimeError(f"{name}: this accelerator uses ampc already")
    if accelerator.distributed_type not in _SUPPORTED:
        raise NotImplementedError(f"{name}: supports single-process, DDP (multi-CPU/GPU) "
                                  f"accelerators; got {accelerator.distributed_type}")
    if dtype is None:
        dtype = _DTYPES.get(accelerator.mixed_precision)
        if dtype is None:
            raise ValueError(f"{name}: the accelerator's mixed_precision is "
                             f"{accelerator.mixed_precision!r}; make it with 'bf16' or 'fp16', "
                             "or pass dtype")
    if dtype not in _DTYPES.values():
        raise ValueError(f"{name}: dtype must be torch.bfloat16 or torch.float16, got {dtype}")
    device = accelerator.device.type
    if scaler is not None and dtype != torch.float16:
        raise ValueError(f"{name}: bf16 needs no loss scaling; got scaler={scaler!r}")
    if scaler is None and dtype == torch.float16:
        scaler = ampc.GradScaler(device)
    if scaler is not None and not isinstance(scaler, ampc.GradScaler):
        raise TypeError(f"{name}: scaler must be an ampc.GradScaler, got {type(scaler).__name__}")
    accelerator._ampc = _Settings(device, dtype, dict(policy or {}), fp8_recipe(name, fp8),
                                  tuple(fp8_modules), bool(master_weights), cache_enabled)
    accelerator.scaler = scaler
    accelerator.native_amp = False      # Accelerate's torch.autocast stays out
    accelerator.__class__ = _subclass(_AmpcAccelerator, type(accelerator))
    return accelerator


@functools.lru_cache(maxsize=None)
def _subclass(mixin, base):
    return type(f"Ampc{base.__name__}", (mixin, base), {})


def _inner(optimizer):
    while isinstance(optimizer, AcceleratedOptimizer):
        optimizer = optimizer.optimizer
    return optimizer


class _AmpcAccelerator:
    """The methods ``use_ampc`` changes; everything else is the accelerator's own."""

    def prepare(self, *args, device_placement=None):
        if self._ampc.master_weights:
            self._make_master_weights(args)
        return super().prepare(*args, device_placement=device_placement)

    def _make_master_weights(self, args):
        models = [a for a in args if isinstance(a, nn.Module)] + list(self._models)
        for opt in args:
            if not isinstance(opt, torch.optim.Optimizer):
                continue
            if not isinstance(opt, ampc.optim.Adam):
                raise TypeError(f"use_ampc(master_weights=True): the optimizer is "
                                f"{type(opt).__name__}; use ampc.optim.Adam or AdamW")
            first = opt.param_groups[0]["params"][0]
            model = next((m for m in models if any(p is first for p in m.parameters())), None)
            if model is None:
                raise ValueError("use_ampc(master_weights=True): pass the optimizer to "
                                 "prepare() together with the model it trains")
            if first.dtype == torch.float32:        # not prepared yet
                ampc.prepare(model, opt, self._ampc.dtype)

    def prepare_model(self, model, device_placement=None, evaluation_mode=False):
        if getattr(model, "_is_accelerate_prepared", False):
            return super().prepare_model(model, device_placement, evaluation_mode)
        settings = self._ampc
        if settings.fp8 is not None:
            ampc.fp8.convert(model, settings.fp8_modules)
        model = super().prepare_model(model, device_placement, evaluation_mode)
        # as Accelerate wraps torch.autocast around the forward: unwrap_model() undoes it
        inner = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
        inner._original_forward = inner.forward
        func = getattr(inner.forward, "__func__", None)

        def in_region(forward):
            @functools.wraps(forward)
            def forward_in_ampc(*a, **kw):
                with settings.region():
                    return forward(*a, **kw)
            return forward_in_ampc

        if func is None:
            inner.forward = convert_outputs_to_fp32(in_region(inner.forward))
        else:
            inner.forward = MethodType(convert_outputs_to_fp32(in_region(func)), inner)
        return model

    def prepare_optimizer(self, optimizer, device_placement=None):
        optimizer = super().prepare_optimizer(optimizer, device_placement)
        if isinstance(optimizer, AcceleratedOptimizer) and \
                not isinstance(optimizer, _AmpcAcceleratedOptimizer):
            optimizer.__class__ = _subclass(_AmpcAcceleratedOptimizer, type(optimizer))
        return optimizer

    def autocast(self, autocast_handler=None):
        return self._ampc.region()

    def unscale_gradients(self, optimizer=None):
        if self.scaler is None:
            return
        optimizers = self._optimizers if optimizer is None else (
            optimizer if isinstance(optimizer, (list, tuple)) else [optimizer])
        for opt in optimizers:
            self.scaler.unscale_(_inner(opt))

    def clip_grad_norm_(self, parameters, max_norm, norm_type=2):
        """With the scaler, clips through ``scaler.clip_grad_norm_`` the optimizer(s) that
        hold exactly ``parameters``: one read of the scaled gradients, the factor applied in
        ampc's optimizers' step."""
        if self.scaler is None:
            return super().clip_grad_norm_(parameters, max_norm, norm_type)
        params = [p for p in parameters]
        wanted = {id(p) for p in params if p.grad is not None}
        inner = [_inner(o) for o in self._optimizers]
        held = [{id(p) for g in o.param_groups for p in g["params"] if p.grad is not None}
                for o in inner]
        if len(inner) == 1 and held[0] == wanted:
            return self.scaler.clip_grad_norm_(inner[0], max_norm, norm_type)
        # other parameter sets: unscale everything, then torch's clip
        self.unscale_gradients()
        return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type)


class _AmpcAcceleratedOptimizer:
    @property
    def step_was_skipped(self):
        """Whether the last step was skipped: read from the scaler (waits for the device)."""
        if isinstance(self.scaler, ampc.GradScaler):
            return bool(self.scaler.last_step_skipped())
        return self._is_overflow
