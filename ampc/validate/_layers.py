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

import copy
import math
import statistics

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

import ampc
from .._numerics.capture import capture
from .._numerics.errors import fp16_range, rel_error
from .._numerics.model import default_loss, expression, to_device
from ._compare import DEFAULT_DTYPE, DTYPE_NAMES
from ._report import LayerReport

if TYPE_CHECKING:
    from ..grad_scaler import GradScaler


UNIT_ROUNDOFF = {torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8}


def _label(name):
    return name or "(model)"


def layers(model: torch.nn.Module, batch: tuple, loss_fn: Callable | None = None, *,
           dtype: torch.dtype | None = None, loss_scale: float | None = None,
           scaler: GradScaler | None = None, threshold: float = 4.0) -> LayerReport:
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
    batch = to_device(tuple(batch), params[0][1].device if params else "cpu")

    names = [n for n, _ in model.named_modules()]
    loss_fn = loss_fn or default_loss
    ref_model, low_model = copy.deepcopy(model), copy.deepcopy(model)
    ref = capture(ref_model, batch, loss_fn, names)
    low = capture(low_model, batch, loss_fn, names,
                  lambda: ampc.autocast(device, dtype=dtype))

    modules = dict(model.named_modules())
    rows = []
    for name, r in ref.calls.items():
        m = low.calls.get(name)
        if r.out is None or m is None or m.out is None:
            continue
        out_err = rel_error([m.out.float()], [r.out.float()])
        r_in, m_in = r.input, m.input
        in_err = (rel_error([m_in.float()], [r_in.float()]) or 0.0
                  if r_in is not None and m_in is not None else 0.0)
        ref_grads = ref.module_grads(ref_model, name)
        grad_err = (rel_error([g.float() for g in low.module_grads(low_model, name)],
                              [g.float() for g in ref_grads]) if ref_grads else None)
        under = over = None
        if dtype == torch.float16:
            under, over = fp16_range(ref_grads + ([r.grad] if r.grad is not None else []),
                                     loss_scale)
        rows.append({"module": _label(name), "type": type(modules[name]).__name__,
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

