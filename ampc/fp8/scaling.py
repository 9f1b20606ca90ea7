"""The scaling state of one FP8 module and the scaled cast that uses and updates it.

A module keeps, as buffers in its state_dict (so a checkpoint resumes bit for bit):
    fp8_fwd_amax_history [H, 2]  amaxes of the input and the weight, newest in row 0
    fp8_fwd_scale [2], fp8_fwd_scale_inv [2]
    fp8_bwd_amax_history [H, 1]  amaxes of the output gradient
    fp8_bwd_scale [1], fp8_bwd_scale_inv [1]
and, outside the state_dict, the amax scratch of the step being cast. H is the recipe's
amax_history_len (1 for current scaling). Every update runs on the device. Where delayed
scaling's amaxes are reduced across ranks, a cast hands its amax to `pending` and the
update waits for the reduction (_amax_reduction.py).
"""
from __future__ import annotations  # "X | None" hints on Python 3.9 too; none evaluated at import

import torch

from .. import ops
from .recipe import FMAX, Recipe

__all__ = ["PERSISTENT", "DEFAULT_HISTORY_LEN", "init_state", "match_recipe", "scaled_cast"]

PERSISTENT = ("fp8_fwd_amax_history", "fp8_fwd_scale", "fp8_fwd_scale_inv",
              "fp8_bwd_amax_history", "fp8_bwd_scale", "fp8_bwd_scale_inv")
TENSORS = {"fwd": 2, "bwd": 1}      # input and weight; output gradient
DEFAULT_HISTORY_LEN = 1024


def init_state(module: torch.nn.Module, history_len: int = DEFAULT_HISTORY_LEN,
               device: torch.device | str | None = None) -> None:
    """(Re)creates the state: zero histories, unit scales (TransformerEngine's start)."""
    for kind, n in TENSORS.items():
        f32 = dict(dtype=torch.float32, device=device)
        module.register_buffer(f"fp8_{kind}_amax_history", torch.zeros(history_len, n, **f32))
        module.register_buffer(f"fp8_{kind}_scale", torch.ones(n, **f32))
        module.register_buffer(f"fp8_{kind}_scale_inv", torch.ones(n, **f32))
        module.register_buffer(f"fp8_{kind}_amax", torch.zeros(n, **f32), persistent=False)


def match_recipe(module: torch.nn.Module, recipe: Recipe) -> None:
    """A recipe with another history length starts the state afresh."""
    if module.fp8_fwd_amax_history.shape[0] != recipe.history_len:
        init_state(module, recipe.history_len, module.fp8_fwd_amax_history.device)


def scaled_cast(module: torch.nn.Module, kind: str, tensors: list[torch.Tensor], dtype: torch.dtype,
                recipe: Recipe, pending: object = None,
                keep: list | None = None) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Casts `tensors` (contiguous fp32/bf16/fp16) to `dtype` with the module's `kind` scales.
    Returns the fp8 tensors and a copy of the inverse scales they were cast with (the GEMMs
    that use them may run after the scales moved on: the backward pass does). With
    `pending` (delayed scaling reduced across ranks) the update is left to it. A list `keep`
    receives a copy of the scales themselves (a checkpoint's recomputation casts with them)."""
    history = getattr(module, f"fp8_{kind}_amax_history")
    amax = getattr(module, f"fp8_{kind}_amax")
    scale = getattr(module, f"fp8_{kind}_scale")
    scale_inv = getattr(module, f"fp8_{kind}_scale_inv")
    update = dict(fmax=FMAX[dtype], margin=recipe.margin, algo=recipe.amax_compute_algo)
    if recipe.current:
        ops.fp8_amax(tensors, amax)
        ops.fp8_update_scales(history, amax, scale, scale_inv, **update)
    out = [torch.empty(t.shape, dtype=dtype, device=t.device) for t in tensors]
    ops.cast_fp8(out, tensors, scale, amax)
    used = scale_inv.clone()
    if keep is not None:
        keep.append(scale.clone())
    if not recipe.current:
        if pending is None:
            ops.fp8_update_scales(history, amax, scale, scale_inv, **update)
        else:
            pending.add((history, scale, scale_inv), amax, update)
    return out, used
