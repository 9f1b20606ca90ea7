"""layers(): one forward and backward in fp32 and under ampc.autocast from the same weights,
compared module by module.

For each module: the relative error of its output (||mixed - fp32|| / ||fp32||), the error
it adds (output error less the error of its input), and the relative error of its own
weights' gradients. For float16, the fraction of the fp32 run's gradient elements (the
module's weight gradients and the gradient at its output) that, multiplied by the loss
scale, round to zero in float16 (underflow) or past its largest value 65504 (overflow).
Modules whose added error or weight-gradient error stands out from the others get a line
to paste that keeps them in fp32.
"""
from __future__ import annotations  # "X | None" hints on Python 3.9 too; none evaluated at import

import contextlib
import copy
import math
import statistics

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from ._compare import DEFAULT_DTYPE, DTYPE_NAMES, _call, _to, default_loss

if TYPE_CHECKING:
    from ..grad_scaler import GradScaler
    from ._report import LayerReport

UNIT_ROUNDOFF = {torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8}


def _first_float(value):
    """The first floating tensor in an argument or output (tuples, lists, dicts)."""
    if isinstance(value, torch.Tensor):
        return value if value.is_floating_point() else None
    items = value.values() if isinstance(value, dict) else value
    if isinstance(items, (tuple, list)) or isinstance(value, dict):
        for v in items:
            t = _first_float(v)
            if t is not None:
                return t
    return None


def _capture(model, batch, loss_fn, region):
    """Runs one step; returns per-module inputs, outputs, output grads and weight grads."""
    inputs, outputs, out_grads = {}, {}, {}
    handles = []
    for name, module in model.named_modules():
        name = name or "(model)"

        def pre(mod, args, kwargs, name=name):
            t = _first_float((args, kwargs))
            if t is not None:
                inputs[name] = t.detach().float().clone()

        def post(mod, args, out, name=name):
            t = _first_float(out)
            if t is None:
                return
            outputs[name] = t.detach().float().clone()
            if t.requires_grad:
                t.register_hook(lambda g: out_grads.__setitem__(name, g.detach().float()))

        handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(module.register_forward_hook(post))
    try:
        x, target = batch
        torch.manual_seed(0)                    # the same dropout draws in both runs
        with region():
            out = _call(model, x)
        (loss_fn or default_loss)(out, target).backward()
    finally:
        for h in handles:
            h.remove()
    grads = {}
    for name, module in model.named_modules():
        own = [p.grad.float() for p in module.parameters(recurse=False) if p.grad is not None]
        if own:
            grads[name or "(model)"] = own
    return inputs, outputs, out_grads, grads


def _rel(a, b):
    """||a - b|| / ||b|| over lists of tensors; None when shapes differ."""
    num = den = 0.0
    for x, y in zip(a, b):
        if x.shape != y.shape:
            return None
        num += torch.linalg.vector_norm(x - y).item() ** 2
        den += torch.linalg.vector_norm(y).item() ** 2
    return math.sqrt(num) / math.sqrt(den) if den > 0 else math.sqrt(num)


def _fp16_range(tensors, scale):
    """Fractions of elements that underflow to zero / overflow in fp16 once scaled."""
    total = under = over = 0
    for g in tensors:
        s = (g.double() * scale).to(torch.float16)
        total += g.numel()
        under += int(((s == 0) & (g != 0)).sum())
        over += int((torch.isinf(s) & torch.isfinite(g)).sum())
    return (under / total, over / total) if total else (None, None)


def expression(path):
    """'blocks.0.attn' -> 'model.blocks[0].attn' (pasteable Python)."""
    if path == "(model)":
        return "model"
    return "model" + "".join(f"[{p}]" if p.isdigit() else f".{p}" for p in path.split("."))


def layers(model: torch.nn.Module, batch: tuple, loss_fn: Callable | None = None, *,
           dtype: torch.dtype | None = None, loss_scale: float | None = None,
           scaler: "GradScaler | None" = None, threshold: float = 4.0) -> "LayerReport":
    """Per-module numerics of one mixed-precision training step against fp32.

    The model is not changed: two copies of it run one forward and backward on ``batch``,
    one in fp32 and one under ``ampc.autocast(device, dtype)`` (modules already given a
    scope with ``ampc.policy.module_scope`` keep it).

    Args:
        model (nn.Module): an fp32 model.
        batch: ``(inputs, target)``; ``inputs`` is a tensor or a tuple of positional args.
        loss_fn: ``loss_fn(output, target)``; default: cross-entropy in fp32.
        dtype: torch.float16 or torch.bfloat16; default: bf16 on the CPU, fp16 on CUDA.
        loss_scale (float): for float16, the scale the underflow and overflow fractions are
            taken at; default: ``scaler.get_scale()`` when a GradScaler is given, else 65536
            (GradScaler's initial scale).
        threshold (float): a module stands out when its added error or weight-gradient error
            is this many times the median of all modules' and above the dtype's unit
            roundoff.

    Returns:
        :class:`ampc.validate.LayerReport`: rows worst first (``.rows``), pasteable
        ``.suggestions``, ``.table()``, ``.as_dict()``, ``.save(dir)``.
    """
    import ampc
    from ._report import LayerReport
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"ampc.validate.layers: model must be an nn.Module, "
                        f"got {type(model).__name__}")
    params = list(model.named_parameters())
    for name, p in params:
        if p.is_floating_point() and p.dtype != torch.float32:
            raise ValueError(f"ampc.validate.layers: parameter {name} is {p.dtype}; layers "
                             "takes an fp32 model")
    if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
        raise TypeError("ampc.validate.layers: batch must be a pair (inputs, target)")
    device = params[0][1].device.type if params else "cpu"
    dtype = dtype or DEFAULT_DTYPE.get(device, torch.bfloat16)
    if dtype not in UNIT_ROUNDOFF:
        raise ValueError(f"ampc.validate.layers: dtype must be torch.float16 or torch.bfloat16, "
                         f"got {dtype}")
    if loss_scale is None:
        loss_scale = scaler.get_scale() if scaler is not None else 65536.0
    batch = _to(tuple(batch), params[0][1].device if params else "cpu")

    ref = _capture(copy.deepcopy(model), batch, loss_fn, contextlib.nullcontext)
    low = _capture(copy.deepcopy(model), batch, loss_fn,
                   lambda: ampc.autocast(device, dtype=dtype))
    ref_in, ref_out, ref_gout, ref_grads = ref
    low_in, low_out, _, low_grads = low

    modules = {(n or "(model)"): m for n, m in model.named_modules()}
    rows = []
    for name in ref_out:
        if name not in low_out:
            continue
        out_err = _rel([low_out[name]], [ref_out[name]])
        in_err = (_rel([low_in[name]], [ref_in[name]]) or 0.0
                  if name in ref_in and name in low_in else 0.0)
        grad_err = _rel(low_grads[name], ref_grads[name]) if name in ref_grads else None
        under = over = None
        if dtype == torch.float16:
            under, over = _fp16_range(ref_grads.get(name, []) + (
                [ref_gout[name]] if name in ref_gout else []), loss_scale)
        rows.append({"module": name, "type": type(modules[name]).__name__,
                     "leaf": next(modules[name].children(), None) is None, "output_err": out_err,
                     "added_err": None if out_err is None else max(0.0, out_err - in_err),
                     "grad_err": grad_err, "underflow": under, "overflow": over})
    rows.sort(key=lambda r: -max(r["output_err"] or 0.0, r["grad_err"] or 0.0))
    config = {"dtype": DTYPE_NAMES[dtype], "device": device, "loss_scale": loss_scale,
              "threshold": threshold}
    names = _suggest(rows, dtype, threshold)
    return LayerReport(rows, [f"ampc.policy.module_scope({expression(n)}, dtype=torch.float32)"
                              for n in names], config, names)


def _suggest(rows, dtype, threshold):
    """The leaf modules whose added error or weight-gradient error stands out from the
    other leaves'."""
    floor = UNIT_ROUNDOFF[dtype]
    leaves = [r for r in rows if r["leaf"]]      # a container's error is its children's
    out = []
    for key in ("added_err", "grad_err"):
        values = [r[key] for r in leaves if r[key] is not None and math.isfinite(r[key])]
        if not values:
            continue
        bar = max(threshold * statistics.median(values), floor)
        out += [r["module"] for r in leaves
                if r[key] is not None and (not math.isfinite(r[key]) or r[key] > bar)]
    return list(dict.fromkeys(out))

