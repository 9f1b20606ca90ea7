"""How far a low-precision result is from its fp32 reference, and whether fp16 can hold it.

Sums are taken in float64 so that the error of the measurement stays far below the error
measured (an fp32 sum of squares of a large tensor loses digits a bf16 error has). The
differences are taken elementwise in the wider of the two dtypes, fp32 at least: exact where
the two values are within a factor of two of each other (Sterbenz), else off by at most 2^-24
of that element's difference; a float64 copy of both tensors cost twice the time of the whole
comparison. A non-finite value shows in the sum, so no pass of its own looks for one.
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import torch

FP16_MAX = 65504.0


def fp16_loss_scale(top: float) -> float:
    """The loss scale a dynamic scaler settles near for a step whose largest gradient is
    ``top``: the largest power of two (1 to 2**24) at which ``top`` times it stays under half
    of fp16's largest value; 65536, GradScaler's first scale, when ``top`` is 0 or not finite."""
    if top == 0.0 or not math.isfinite(top):
        return 65536.0
    return float(2.0 ** min(24, max(0, math.floor(math.log2(FP16_MAX / 2 / top)))))


def silent(named: Iterable[tuple[str, torch.Tensor | None]]) -> str | None:
    """Why these (name, tensor) pairs (a unit's output, the gradient at it) cannot show a
    precision's error: a tensor all zero (every error against it reads 0) or not finite,
    else None."""
    for what, t in named:
        if t is None or not t.numel():
            continue
        if not bool(torch.isfinite(t).all()):
            return f"its {what} is not finite"
        if not bool(t.any()):
            return f"its {what} is all zero"
    return None


def rel_error(a: Sequence[torch.Tensor | None], b: Sequence[torch.Tensor | None]) -> float | None:
    """||a - b|| / ||b|| over paired lists of tensors, as one vector (||a - b|| when b is all
    zero). Pairs with a None are skipped; None when no pair is left or two shapes differ;
    inf when a compared ``a`` holds a non-finite value."""
    num = den = 0.0
    seen = False
    for x, y in zip(a, b):
        if x is None or y is None:
            continue
        if x.shape != y.shape:
            return None
        seen = True
        num += float(torch.linalg.vector_norm(_difference(x, y), dtype=torch.float64)) ** 2
        if not math.isfinite(num):
            return math.inf
        den += float(torch.linalg.vector_norm(y.double())) ** 2
    if not seen:
        return None
    return math.sqrt(num) / math.sqrt(den) if den > 0 else math.sqrt(num)


def _difference(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``x - y`` in the wider of their dtypes, fp32 at least."""
    dtype = torch.promote_types(torch.promote_types(x.dtype, y.dtype), torch.float32)
    return x.to(dtype) - y.to(dtype)


def loss_error(y: torch.Tensor | None, ref: torch.Tensor, grad: torch.Tensor | None,
               loss: float) -> float | None:
    """First-order loss change of an output error: per example |<dL/dy, y - ref>| (dim 0),
    summed, over |loss|. None without an output or its gradient; inf for a non-finite ``y``."""
    if y is None or grad is None:
        return None
    d = _difference(y, ref)
    d = grad.to(d.dtype) * d
    per_example = (d.reshape(d.shape[0], -1).sum(1, dtype=torch.float64) if d.dim()
                   else d.reshape(1).double())
    total = float(per_example.abs().sum())
    return total / max(abs(loss), 1e-12) if math.isfinite(total) else math.inf


def fp16_range(grads: Iterable[torch.Tensor], scale: float,
               activations: Iterable[torch.Tensor] = ()) -> tuple[float | None, float | None]:
    """(underflow, overflow): the fractions of elements that, in fp16, round to zero from
    non-zero (gradients, multiplied by the loss ``scale``) or pass its largest value 65504
    (scaled gradients, and the unscaled ``activations``). (None, None) when there are none."""
    total = under = over = 0
    for g in grads:
        s = (g.double() * scale).to(torch.float16)
        total += g.numel()
        under += int(((s == 0) & (g != 0)).sum())
        over += int((torch.isinf(s) & torch.isfinite(g)).sum())
    for a in activations:
        total += a.numel()
        over += int((a.abs() > FP16_MAX).sum())
    return (under / total, over / total) if total else (None, None)
