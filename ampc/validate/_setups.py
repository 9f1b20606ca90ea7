"""The setups compare() trains, one record each (fp32 and the mixed-precision ones; a
Plan from ampc.autoprecision is a setup of its own, see ``PlanSetup`` in _compare.py):
what a setup does to the model, which optimizer steps it, which loss scaler fp16 takes and
the region each step runs in. A new setup is a record here (and its tests).

  fp32         torch AdamW, no region
  torch.amp    fp32 weights, torch.autocast, torch.amp.GradScaler (fp16), torch AdamW
  ampc         fp32 weights, ampc.autocast, ampc.GradScaler (fp16), ampc.optim.AdamW
  ampc.master  ampc.prepare: 16-bit weights, fp32 master weights in ampc.optim.AdamW,
               ampc.GradScaler (fp16)
  ampc.fp8     (asked for by name, not run by default) fp32 weights, ampc.autocast with the
               nn.Linear GEMMs in FP8 (ampc.fp8.autocast, delayed scaling), ampc.optim.AdamW,
               ampc.GradScaler (fp16)
  torch.amp.noscale  (by name) as torch.amp, without a GradScaler: in fp16, what happens when
               loss scaling is left out (gradients below 2**-24 flush to zero)
  pure         (by name) the model cast to the 16-bit dtype, torch AdamW on its 16-bit
               weights (no fp32 master copy, no autocast, no GradScaler); float inputs are cast
               to the dtype on the way in and the output back to fp32 for the loss
  ampc.lean    (by name) ampc.prepare with ampc.optim.AdamW(state="lean"): 16-bit weights
               written by stochastic rounding (no master copy), 8-bit moments (see
               ampc.lean_state), ampc.GradScaler (fp16)
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch

import ampc      # its fp8 attribute loads ampc.fp8 (and torch._dynamo) on first use only
from .._walk import map_tensors


@dataclass(frozen=True)
class Setup:
    name: str
    # (model, dtype, lr) -> (model, optimizer): what the setup does to the fp32 model
    build: Callable
    # the loss scaler an fp16 run takes: "torch" (torch.amp.GradScaler), "ampc"
    # (ampc.GradScaler) or None (none, whatever the dtype)
    scaler: str | None
    # (device, dtype) -> the context each forward and loss run in
    region: Callable = lambda device, dtype: contextlib.nullcontext()
    default: bool = False       # run when compare() is given no setups


def torch_adamw(params, lr):
    """torch's AdamW as the torch.amp and fp32 setups train with it: fused where the device and
    dtype take it (public as ``ampc.validate.torch_adamw``, for a caller that measures against
    those setups)."""
    params = list(params)
    try:
        return torch.optim.AdamW(params, lr=lr, fused=True)
    except (RuntimeError, ValueError):       # a device or dtype fused AdamW does not take
        return torch.optim.AdamW(params, lr=lr)


def _torch_opt(model, dtype, lr):
    return model, torch_adamw(model.parameters(), lr)


def _ampc_opt(model, dtype, lr):
    return model, ampc.optim.AdamW(model.parameters(), lr=lr)


def _fp8(model, dtype, lr):
    ampc.fp8.convert(model)     # FP8 from the first step, for a bare Linear too
    return _ampc_opt(model, dtype, lr)


def _prepared(**options):
    return lambda model, dtype, lr: ampc.prepare(model, ampc.optim.AdamW, dtype, lr=lr,
                                                 **options)


def _pure(model, dtype, lr):
    """Casts ``model`` to ``dtype`` in place; its float inputs are cast to ``dtype`` on the
    way in and its float outputs back to fp32 (the loss is computed in fp32, as for the
    other setups)."""
    model.to(dtype)

    def cast(value, to):
        return map_tensors(lambda t: t.to(to) if t.is_floating_point() else t, value)
    model.register_forward_pre_hook(lambda m, args, kwargs: (cast(args, dtype), cast(kwargs, dtype)),
                                    with_kwargs=True)
    model.register_forward_hook(lambda m, args, out: cast(out, torch.float32))
    return _torch_opt(model, dtype, lr)


def _torch_region(device, dtype):
    return torch.autocast(device, dtype=dtype)


def _ampc_region(device, dtype):
    return ampc.autocast(device, dtype=dtype)


@contextlib.contextmanager
def _fp8_region(device, dtype):
    with ampc.autocast(device, dtype=dtype), ampc.fp8.autocast(recipe=ampc.fp8.DelayedScaling()):
        yield


REGISTRY = {s.name: s for s in (
    Setup("fp32", _torch_opt, None),
    Setup("torch.amp", _torch_opt, "torch", _torch_region, default=True),
    Setup("ampc", _ampc_opt, "ampc", _ampc_region, default=True),
    Setup("ampc.master", _prepared(), "ampc", default=True),
    Setup("ampc.fp8", _fp8, "ampc", _fp8_region),
    Setup("ampc.lean", _prepared(state="lean"), "ampc"),
    Setup("torch.amp.noscale", _torch_opt, None, _torch_region),
    Setup("pure", _pure, None),
)}


def scaler(name: str | None, device: str):
    """A new loss scaler of kind ``name`` ("torch", "ampc") on ``device``, or None."""
    if name == "torch":
        return torch.amp.GradScaler(device)
    return ampc.GradScaler(device) if name == "ampc" else None
