"""One module run alone on a recorded call, forward and backward, in a given region."""
from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import Any

import torch

from .capture import Call
from .model import detached, first_float, float_tensors


def run_unit(module: torch.nn.Module, call: Call, region: Callable[[], Any] = contextlib.nullcontext,
             device: str = "cpu", scale: float = 1.0
             ) -> tuple[torch.Tensor | None, list[torch.Tensor | None], list[torch.Tensor | None], float]:
    """Runs ``module`` on ``call``'s arguments inside ``region()`` and back-propagates the
    recorded output gradient times ``scale`` (a loss scale). Returns (output, input grads,
    weight grads, seconds), in fp32 and unscaled; the time is the forward (casts at the
    module's boundary included) plus the backward, without entering the region."""
    args, kwargs = detached(call.args), detached(call.kwargs)
    inputs = float_tensors((args, kwargs))
    for t in inputs:
        t.requires_grad_(True)
    params = [p for p in module.parameters() if p.requires_grad]
    for p in params:
        p.grad = None
    if any(isinstance(m, torch.nn.Dropout) or getattr(m, "dropout", 0) for m in module.modules()):
        torch.manual_seed(0)       # the same dropout draws at every precision
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    with region():
        sync()
        t0 = time.perf_counter()
        out = first_float(module(*args, **kwargs))
        seconds = time.perf_counter() - t0
    grad = None if out is None or call.grad is None else call.grad * scale
    if out is not None and out.requires_grad and grad is not None:
        sync()
        t0 = time.perf_counter()
        out.backward(grad)
        sync()
        seconds += time.perf_counter() - t0
    y = None if out is None else out.detach().float()
    dx = [None if t.grad is None else t.grad.float() / scale for t in inputs]
    dw = [None if p.grad is None else p.grad.float() / scale for p in params]
    for p in params:
        p.grad = None
    return y, dx, dw, seconds
