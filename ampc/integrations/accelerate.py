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
- with an ampc optimizer made with ``step_in_backward=True`` (each parameter stepped in
  the backward), keeps the gradients of the micro-batches ``accumulate()`` does not sync
  (the syncing backward steps on their sum) and refuses ``clip_grad_norm_`` /
  ``clip_grad_value_`` (no gradient is left to clip; a norm asked for with ``max_norm=inf``,
  only to be logged, is nan);
- with ``master_weights=True``, runs ``ampc.prepare`` on each ampc optimizer passed to
  ``prepare()`` and the model that holds its parameters: low-precision weights, fp32
  masters in the optimizer.
"""
from __future__ import annotations

import contextlib
import functools
import weakref
from types import MethodType
from typing import Any

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

from ._settings import Recipe, check

__all__ = ["use_ampc"]

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
_SUPPORTED = (DistributedType.NO, DistributedType.MULTI_CPU, DistributedType.MULTI_GPU)
_NAME = "ampc.integrations.accelerate.use_ampc"


def use_ampc(accelerator: Accelerator, *, dtype: torch.dtype | None = None,
             scaler: ampc.GradScaler | None = None, master_weights: bool = False,
             policy: dict[str, str] | None = None, fp8: bool | Recipe | None = None,
             fp8_modules: tuple[type[nn.Module], ...] = (nn.Linear,),
             cache_enabled: bool | None = None, compress: str | list[str] | None = None,
             recompute: str | list[str] | None = None,
             sliced_head: str | list[str] | None = None,
             plan: ampc.autoprecision.Plan | str | None = None) -> Accelerator:
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
        compress (str or list): modules of each prepared model (names or patterns) whose saved
            activations are kept in 8 bits until the backward (``ampc.memory.compress``).
        recompute (str or list): modules of each prepared model recomputed in the backward
            (``ampc.memory.recompute``).
        sliced_head (str or list): Linear heads of each prepared model whose logits
            ``F.cross_entropy`` makes a slice of tokens at a time (``ampc.memory.sliced_head``).
            All three are set when the model is prepared.
        plan (ampc.autoprecision.Plan or path): a plan from ``ampc.autoprecision.search``
            (or its file) chooses the region (the accelerator's ``mixed_precision`` its dtype
            or ``"no"``), each module's precision and memory moves, and the weights' and the
            optimizer's state: ``prepare(model, optimizer)`` does what ``plan.prepare`` does
            on the module the plan was searched on (the model or the outermost module inside
            it with the plan's module names), the optimizer one made over the model's
            parameters (an ``ampc.optim`` one unless the plan keeps fp32 state). Given with
            any of the arguments it chooses: refused.
    """
    if not isinstance(accelerator, Accelerator):
        raise TypeError(f"{_NAME}: accelerator must be an accelerate.Accelerator, "
                        f"got {type(accelerator).__name__}")
    # Accelerate lists what it prepared only in these two private lists
    if accelerator._models or accelerator._optimizers:
        raise RuntimeError(f"{_NAME}: call it before accelerator.prepare(); this accelerator "
                           "has prepared models or optimizers already")
    if isinstance(accelerator, _AmpcAccelerator):
        raise RuntimeError(f"{_NAME}: this accelerator uses ampc already")
    if accelerator.distributed_type not in _SUPPORTED:
        raise NotImplementedError(f"{_NAME}: supports single-process, DDP (multi-CPU/GPU) "
                                  f"accelerators; got {accelerator.distributed_type}")
    if dtype is None:
        dtype = _DTYPES.get(accelerator.mixed_precision)
        if dtype is None and plan is None:
            raise ValueError(f"{_NAME}: the accelerator's mixed_precision is "
                             f"{accelerator.mixed_precision!r}; make it with 'bf16' or 'fp16', "
                             "or pass dtype")
    accelerator._ampc = check(_NAME, accelerator.device.type, dtype, scaler=scaler,
                              policy=policy, fp8=fp8, fp8_modules=fp8_modules,
                              cache_enabled=cache_enabled, master_weights=master_weights,
                              compress=compress, recompute=recompute,
                              sliced_head=sliced_head, plan=plan)
    accelerator._ampc_models = weakref.WeakSet()     # the models whose forward is in ampc's region
    accelerator._ampc_planned = weakref.WeakSet()    # the models a plan was set up on
    # Accelerate's public attributes: backward, the optimizers' step, save_state/load_state
    # and the Trainer's checkpoints use this scaler; no torch.autocast around the forward
    accelerator.scaler = accelerator._ampc.scaler
    accelerator.native_amp = False
    # Accelerate has no hook for another autocast or scaler (its kwargs handlers match classes
    # exactly) and the Trainer makes its own accelerator: this instance becomes a subclass of
    # its own class
    accelerator.__class__ = _subclass(_AmpcAccelerator, type(accelerator))
    return accelerator


@functools.lru_cache(maxsize=None)
def _subclass(mixin: type, base: type) -> type:
    return type(f"Ampc{base.__name__}", (mixin, base), {})


def _inner(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    while isinstance(optimizer, AcceleratedOptimizer):
        optimizer = optimizer.optimizer
    return optimizer


def _in_region(forward, settings):
    @functools.wraps(forward)
    def forward_in_ampc(*a, **kw):
        with settings.region():
            return forward(*a, **kw)
    return forward_in_ampc


class _AmpcAccelerator:
    """The methods ``use_ampc`` changes; everything else is the accelerator's own."""

    def prepare(self, *args: Any, device_placement: list[bool] | None = None) -> Any:
        if self._ampc.master_weights:
            self._make_master_weights(args)
        if self._ampc.plan is not None:
            self._set_up_plan(args)
        return super().prepare(*args, device_placement=device_placement)

    def _set_up_plan(self, args):
        models = [a for a in args if isinstance(a, nn.Module) and a not in self._ampc_planned]
        optimizers = [a for a in args if isinstance(a, torch.optim.Optimizer)]
        for model in models:
            ids = {id(p) for p in model.parameters()}
            owned = [o for o in optimizers
                     if any(id(p) in ids for g in o.param_groups for p in g["params"])]
            if len(owned) > 1:
                raise ValueError(f"{_NAME}(plan=...): the plan sets up one optimizer per model; "
                                 f"prepare() was given {len(owned)} for one model")
            self._ampc.set_up_plan(f"{_NAME}(plan=...)", model, owned[0] if owned else None)
            self._ampc_planned.add(model)

    def _make_master_weights(self, args):
        # a model prepared by an earlier prepare() is only in Accelerate's private list
        models = [a for a in args if isinstance(a, nn.Module)] + list(self._models)
        for opt in args:
            if not isinstance(opt, torch.optim.Optimizer):
                continue
            first = opt.param_groups[0]["params"][0]
            model = next((m for m in models if any(p is first for p in m.parameters())), None)
            if isinstance(opt, ampc.optim.Adam):
                if model is None:
                    raise ValueError(f"{_NAME}(master_weights=True): pass the optimizer to "
                                     "prepare() together with the model it trains")
                if first.dtype != torch.float32:        # prepared already
                    continue
            self._ampc.make_master_weights(_NAME, "the optimizer", model, opt)

    def prepare_model(self, model: nn.Module, device_placement: bool | None = None,
                      evaluation_mode: bool = False) -> nn.Module:
        if model in self._ampc_models:
            return super().prepare_model(model, device_placement, evaluation_mode)
        settings = self._ampc
        if settings.plan is None:
            settings.convert(model)
        elif model not in self._ampc_planned:      # prepared alone: the modules' part only
            settings.set_up_plan(f"{_NAME}(plan=...)", model)
            self._ampc_planned.add(model)
        model = super().prepare_model(model, device_placement, evaluation_mode)
        # as Accelerate wraps torch.autocast around the forward: unwrap_model() undoes it
        # through _original_forward, Accelerate's name for the forward before its wrapper
        inner = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
        inner._original_forward = inner.forward
        func = getattr(inner.forward, "__func__", None)
        if func is None:
            inner.forward = convert_outputs_to_fp32(_in_region(inner.forward, settings))
        else:
            inner.forward = MethodType(convert_outputs_to_fp32(_in_region(func, settings)), inner)
        self._ampc_models.update((model, inner))
        return model

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer,
                          device_placement: bool | None = None) -> AcceleratedOptimizer:
        optimizer = super().prepare_optimizer(optimizer, device_placement)
        if isinstance(optimizer, AcceleratedOptimizer) and \
                not isinstance(optimizer, _AmpcAcceleratedOptimizer):
            optimizer.__class__ = _subclass(_AmpcAcceleratedOptimizer, type(optimizer))
        return optimizer

    def autocast(self, autocast_handler: Any = None) -> Any:
        return self._ampc.region()

    def unscale_gradients(self, optimizer: torch.optim.Optimizer |
                          list[torch.optim.Optimizer] | None = None) -> None:
        # Accelerate's own unscales only with its torch.autocast on (native_amp)
        if self.scaler is None:
            return
        optimizers = self._optimizers if optimizer is None else (
            optimizer if isinstance(optimizer, (list, tuple)) else [optimizer])
        for opt in optimizers:
            self.scaler.unscale_(_inner(opt))

    def _in_backward(self) -> list[torch.optim.Optimizer]:
        """The prepared optimizers that step each parameter in the backward."""
        return [o for o in map(_inner, self._optimizers)
                if getattr(o, "step_in_backward", False)]

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        # inside accumulate(), a micro-batch that does not sync is one whose gradients are
        # kept: an optimizer stepping in the backward must keep them too, and step on the sum
        if self.sync_gradients:
            return super().backward(loss, **kwargs)
        with contextlib.ExitStack() as stack:
            for opt in self._in_backward():
                stack.enter_context(opt.accumulating())
            return super().backward(loss, **kwargs)

    def _refuse_clip(self, how: str) -> None:
        if self._in_backward():
            raise RuntimeError(f"{_NAME}: accelerator.{how}: the optimizer steps each parameter "
                               "in the backward (step_in_backward=True) and has freed its "
                               "gradients there; nothing is left to clip. Pass "
                               "step_in_backward=False to clip")

    def clip_grad_value_(self, parameters: Any, clip_value: float) -> None:
        self._refuse_clip("clip_grad_value_")
        return super().clip_grad_value_(parameters, clip_value)

    def clip_grad_norm_(self, parameters: Any, max_norm: float,
                        norm_type: float = 2) -> torch.Tensor:
        """With the scaler, clips through ``scaler.clip_grad_norm_`` the optimizer(s) that
        hold exactly ``parameters``: one read of the scaled gradients, the factor applied in
        ampc's optimizers' step."""
        if max_norm == float("inf") and self._in_backward():
            # a norm asked for only to be logged (the transformers Trainer asks every step):
            # the gradients are gone, so it is unknown, not zero
            return torch.tensor(float("nan"), device=self.device)
        self._refuse_clip("clip_grad_norm_")
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
    def step_was_skipped(self) -> bool:
        """Whether the last step was skipped: read from the scaler (waits for the device).
        Accelerate's own reading (whether ``optimizer.step`` ran) misses a step that ampc's
        optimizers skip on the device."""
        if self.scaler is not None:
            return bool(self.scaler.last_step_skipped())
        return super().step_was_skipped
