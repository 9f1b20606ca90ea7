"""Master-weight training in one call, and the fp32 export of its weights.

``prepare`` turns an fp32 model and an optimizer recipe into master-weight training:
the model's weights become fp16 or bf16 (one fused cast for all of them), normalization
layers stay fp32 (torch's classes, and any module that normalises its input, such as a
model's own RMSNorm: ``ampc._module_kinds``), and the optimizer keeps fp32 master weights
that start from the original fp32 values, not from their rounded copies.
``fp32_state_dict`` writes those master weights back out as a plain fp32 ``state_dict``
for the original model.
"""
from __future__ import annotations  # "X | None" hints on Python 3.9 too; none evaluated at import

from collections import OrderedDict, defaultdict
from typing import Any, Callable

import torch
from torch import nn

from . import _distributed, _module_kinds, ops
from ._walk import map_tensors
from .optim import Adam

__all__ = ["prepare", "fp32_state_dict", "NORM_LAYERS"]

NORM_LAYERS = tuple(t for t in (
    nn.modules.batchnorm._NormBase, nn.GroupNorm, nn.LayerNorm, nn.LocalResponseNorm,
    getattr(nn, "RMSNorm", None)) if t is not None)

_LOW = (torch.float16, torch.bfloat16)


def _cast_floating(value, dtype):
    """Casts the floating tensors in a (nested) argument to dtype; float64 is left alone."""
    return map_tensors(lambda t: t.to(dtype) if t.is_floating_point() and t.dtype != torch.float64
                       and t.dtype != dtype else t, value)


def _cast_inputs(dtype):
    def hook(module, args, kwargs):
        return _cast_floating(args, dtype), _cast_floating(kwargs, dtype)
    return hook


def _cast_outputs(dtype):
    def hook(module, args, output):
        return _cast_floating(output, dtype)
    return hook


def prepare(model: nn.Module, optimizer: Adam | Callable[..., Adam], dtype: torch.dtype = torch.bfloat16,
            *, keep_fp32: tuple[type[nn.Module], ...] = NORM_LAYERS, detect_norms: bool = True,
            cast_inputs: bool = True, **optimizer_kwargs: Any) -> tuple[nn.Module, Adam]:
    """Turns an fp32 ``model`` into a ``dtype`` model trained with fp32 master weights.

    Every floating parameter and buffer of the model is cast to ``dtype`` in one fused
    call, except those of the modules kept in fp32, which stay fp32 and run in fp32: their
    inputs are cast up and their outputs back down. Kept are the instances of
    ``keep_fp32`` (torch's normalization layers by default) and, with ``detect_norms``,
    every module found to normalise its input (transformers' ``LlamaRMSNorm`` and
    ``T5LayerNorm``, timm's ``RmsNorm``, a model's own norm class): a module whose tensors
    are all vectors (at most one dim larger than 1) and whose forward, run once on a tiny meta-tensor
    input, calls a fused norm or reduces the input and scales by the result (rsqrt, sqrt,
    div), with no matmul, and returns the input's shape. ``model.ampc_kept_fp32`` then
    says which were kept and why: ``{module name: "keep_fp32" or "detected"}``. With
    ``cast_inputs`` the model's floating inputs are cast to ``dtype`` as well, so an fp32
    data pipeline needs no change.

    The fp32 tensors the weights were cast from become the optimizer's master weights
    (no copy, no rounding): training starts exactly where the fp32 model was.

    Args:
        model (nn.Module): an fp32 model; changed in place and returned.
        optimizer: an ``ampc.optim.Adam``/``AdamW`` class, or any callable that takes the
            params and ``**optimizer_kwargs`` and returns an ampc optimizer, or an ampc
            optimizer already made over ``model.parameters()`` that has taken no step.
        dtype (torch.dtype): torch.bfloat16 (default) or torch.float16.
        keep_fp32 (tuple of module types): modules left in fp32. Default: NORM_LAYERS;
            add a norm class the detection misses: ``NORM_LAYERS + (MyNorm,)``.
        detect_norms (bool): also keep the modules that normalise their input, whatever
            their class. Default: True.
        cast_inputs (bool): cast the model's floating inputs to ``dtype``. Default: True.

    Returns:
        (model, optimizer)

    Example::

        >>> model, opt = ampc.prepare(model, ampc.optim.AdamW, torch.bfloat16, lr=1e-3)
        >>> for x, y in data:
        ...     opt.zero_grad(); loss_fn(model(x).float(), y).backward(); opt.step()
    """
    types = _check_arguments(model, dtype, keep_fp32, detect_norms)
    _check_model(model)
    why, kept = _kept_fp32(model, types, detect_norms)
    params, buffers = _to_cast(model, kept)
    opt = _take_optimizer(model, optimizer, dtype, optimizer_kwargs)
    _cast_weights(params, buffers, dtype, opt)
    _add_cast_hooks(model, kept, why, dtype, cast_inputs)
    _distributed.watch_params(model, opt)
    return model, opt


# ---- prepare's phases, in order ----

def _check_arguments(model, dtype, keep_fp32, detect_norms):
    """Refuses a wrong argument before anything changes; the tuple of classes kept fp32."""
    if dtype not in _LOW:
        raise ValueError(f"ampc.prepare: dtype must be torch.float16 or torch.bfloat16, "
                         f"got {dtype}")
    if not isinstance(model, nn.Module):
        raise TypeError(f"ampc.prepare: model must be an nn.Module, got {type(model).__name__}")
    types = keep_fp32 if isinstance(keep_fp32, tuple) else (keep_fp32,)
    if not all(isinstance(t, type) and issubclass(t, nn.Module) for t in types):
        raise TypeError(f"ampc.prepare: keep_fp32 must be a tuple of nn.Module classes, "
                        f"got {keep_fp32!r}")
    if not isinstance(detect_norms, bool):
        raise TypeError(f"ampc.prepare: detect_norms must be True or False, got {detect_norms!r}")
    return types


def _check_model(model):
    """An fp32 model, not sharded yet."""
    _distributed.refuse_sharded_model(model)
    for name, p in model.named_parameters():
        if p.is_floating_point() and p.dtype != torch.float32:
            raise ValueError(f"ampc.prepare: parameter {name} is {p.dtype}; prepare takes "
                             "an fp32 model")


def _kept_fp32(model, types, detect_norms):
    """The modules that stay fp32: {name: "keep_fp32" or "detected"}, and the modules."""
    modules = dict(model.named_modules())
    why = {n: "keep_fp32" if isinstance(m, types) else "detected" for n, m in modules.items()
           if isinstance(m, types) or (detect_norms and _module_kinds.kind(m) == _module_kinds.NORM)}
    return why, [modules[n] for n in why]


def _to_cast(model, kept):
    """The floating parameters and the fp32 buffers (module, name, buffer) to cast: all
    but the kept modules' own."""
    kept_ids = {id(t) for m in kept for t in _own_tensors(m)}
    params = [p for p in model.parameters() if p.is_floating_point() and id(p) not in kept_ids]
    buffers = [(m, name, b) for m in model.modules() for name, b in m.named_buffers(recurse=False)
               if b is not None and b.dtype == torch.float32 and id(b) not in kept_ids]
    return params, buffers


def _take_optimizer(model, optimizer, dtype, optimizer_kwargs):
    """The ampc optimizer, made over the model's parameters or taken before its first step."""
    if isinstance(optimizer, torch.optim.Optimizer):
        opt = optimizer
        if any(opt.state[p] for g in opt.param_groups for p in g["params"]):
            raise ValueError("ampc.prepare: the optimizer has state already; pass it before "
                             "its first step")
    else:
        opt = optimizer(model.parameters(), **optimizer_kwargs)
    if not isinstance(opt, Adam):
        raise TypeError(f"ampc.prepare: optimizer must be an ampc.optim optimizer, got "
                        f"{type(opt).__name__}")
    if dtype != torch.bfloat16 and any(g.get("kahan_summation") for g in opt.param_groups):
        raise ValueError(f"ampc.prepare: kahan_summation=True keeps bf16 compensations of "
                         f"bf16 weights; dtype is {dtype}")
    return opt


def _cast_weights(params, buffers, dtype, opt):
    """One fused cast per device for all weights and buffers; the fp32 tensors the weights
    were cast from become the optimizer's master weights."""
    groups = {id(p): g for g in opt.param_groups for p in g["params"]}
    originals = [p.data for p in params] + [b for _, _, b in buffers]
    by_device = defaultdict(list)
    for i, t in enumerate(originals):
        by_device[t.device].append(i)
    low = [None] * len(originals)
    for idx in by_device.values():
        for i, out in zip(idx, ops.cast([originals[i].contiguous() for i in idx], dtype)):
            low[i] = out
    for i, p in enumerate(params):
        p.data = low[i]
        p.grad = None
        if id(p) in groups:
            opt._init_state(groups[id(p)], p, master=originals[i])
    for (module, name, _), out in zip(buffers, low[len(params):]):
        module._buffers[name] = out


def _add_cast_hooks(model, kept, why, dtype, cast_inputs):
    """The kept modules run in fp32 (inputs cast up, outputs back down); with
    ``cast_inputs`` the model's inputs are cast to ``dtype``."""
    for m in kept:
        m.register_forward_pre_hook(_cast_inputs(torch.float32), with_kwargs=True)
        m.register_forward_hook(_cast_outputs(dtype))
    if cast_inputs:
        model.register_forward_pre_hook(_cast_inputs(dtype), with_kwargs=True)
    model.ampc_kept_fp32 = why


def _own_tensors(module):
    """The parameters and buffers a module holds itself (not its children's)."""
    return list(module.parameters(recurse=False)) + [
        b for b in module.buffers(recurse=False) if b is not None]


def fp32_state_dict(model: nn.Module, optimizer: Adam, *,
                    full_state_dict: bool = False) -> dict[str, torch.Tensor]:
    """The model's ``state_dict`` in fp32, with the master weights as its parameters.

    Every parameter that has a master weight in ``optimizer`` is replaced by a copy of
    it, one with a Kahan compensation (``kahan_summation=True``) by param + compensation
    in fp32; other fp16/bf16 tensors are widened to fp32. The result loads into the original
    fp32 model with ``load_state_dict`` (for inference, export, or fine-tuning without
    ampc).

    Under FSDP2 (``fully_shard``, DTensor params) the entries are DTensors laid out as in
    ``model.state_dict()``, which is also what torch.distributed.checkpoint's
    ``get_model_state_dict`` gives by default: each rank holds its shards, ready for
    ``dcp.save``. With ``full_state_dict=True`` every DTensor is gathered into a plain
    tensor on every rank (a collective: call it on all ranks), which loads into the
    unsharded fp32 model.
    """
    masters = {id(p): optimizer.state[p]["master"]
               for g in optimizer.param_groups for p in g["params"]
               if "master" in optimizer.state.get(p, {})}
    # Kahan-compensated bf16 weights: the weight is param + compensation
    masters.update({id(p): p.detach().float() + optimizer.state[p]["compensation"].float()
                    for g in optimizer.param_groups for p in g["params"]
                    if "compensation" in optimizer.state.get(p, {})})
    out = OrderedDict()
    for key, value in model.state_dict(keep_vars=True).items():
        if id(value) in masters:
            value = masters[id(value)].detach().clone()
        elif isinstance(value, torch.Tensor) and value.dtype in _LOW:
            value = value.detach().to(torch.float32)
        elif isinstance(value, torch.Tensor):
            value = value.detach().clone()
        if full_state_dict and _distributed.is_dtensor(value):
            value = value.full_tensor()
        out[key] = value
    return out
