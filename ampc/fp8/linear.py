"""ampc.fp8.Linear: nn.Linear whose GEMMs run in FP8 inside ampc.fp8.autocast.

Forward: input and weight cast to e4m3 with their scales (amax taken in the same pass),
one FP8 GEMM. Backward: the output gradient cast to the recipe's backward format (e5m2 with
Format.HYBRID), one FP8 GEMM for the input gradient and one for the weight gradient; the
bias gradient is summed from the unquantized output gradient. Outside a region it is
nn.Linear. The scaling state is in its state_dict (see scaling.py). A checkpoint's
recomputation casts as the forward did (_recompute.py); under torch.compile an FP8 call runs
eagerly (see _eager_forward below).
"""
from __future__ import annotations  # "X | None" hints on Python 3.9 too; none evaluated at import

import torch
import torch.nn.functional as F
from torch import nn

from . import _open_regions, _recompute
from ._amax_reduction import backward_pending
from ._gemm import gemm
from .recipe import Recipe
from .scaling import PERSISTENT, init_state, match_recipe, scaled_cast

__all__ = ["Linear", "convert", "linear", "to_fp8"]

MULTIPLE = 16   # cuBLASLt's FP8 kernels: the inner and output dimensions


def _out_dtype(dtype):
    """The GEMM writes bf16 or fp32; fp16 comes from fp32."""
    return dtype if dtype in (torch.bfloat16, torch.float32) else torch.float32


def _pad_rows(t, multiple=MULTIPLE):
    """t [r, c] with zero rows added up to a multiple: the weight gradient's inner
    dimension is the number of input rows, which may be anything; zeros add nothing."""
    extra = -t.shape[0] % multiple
    if not extra:
        return t
    out = torch.zeros(t.shape[0] + extra, t.shape[1], dtype=t.dtype, device=t.device)
    out[:t.shape[0]] = t
    return out


class _Fp8LinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, module, recipe, out_dtype, pending, replay, record):
        tensors, dtype = [x, weight.contiguous()], recipe.fp8_format.fwd_dtype
        if replay is not None:      # a checkpoint's recomputation: the forward's casts again
            (x8, w8), sinv = replay.cast(tensors, dtype)
            group = replay.group
        else:
            keep = None if record is None else []
            (x8, w8), sinv = scaled_cast(module, "fwd", tensors, dtype, recipe, pending, keep)
            group = None if pending is None else pending.group
            if record is not None:
                record.add(module, recipe, keep[0], sinv, group)
        gemm_dtype = _out_dtype(out_dtype)
        epilogue = bias is not None and gemm_dtype == torch.bfloat16
        y = gemm(x8, w8.t(), sinv[0:1], sinv[1:2], out_dtype=gemm_dtype,
                 bias=bias.to(torch.bfloat16) if epilogue else None)
        if bias is not None and not epilogue:
            y = y.add_(bias)
        ctx.save_for_backward(x8, w8, sinv)
        ctx.module, ctx.recipe = module, recipe
        ctx.group = group       # the backward's amaxes are reduced over the forward's group
        ctx.dtypes = (x.dtype, weight.dtype, None if bias is None else bias.dtype)
        return y.to(out_dtype)

    @staticmethod
    def backward(ctx, dy):
        x8, w8, sinv = ctx.saved_tensors
        x_dtype, w_dtype, b_dtype = ctx.dtypes
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        dy = dy.contiguous()
        if dy.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            dy = dy.float()
        pending = None if ctx.group is None else backward_pending(ctx.group)
        (dy8,), ginv = scaled_cast(ctx.module, "bwd", [dy], ctx.recipe.fp8_format.bwd_dtype,
                                   ctx.recipe, pending)
        dx = dw = db = None
        if need_x:      # dx [m, in] = dy [m, out] @ w [out, in]
            dx = gemm(dy8, w8.t().contiguous().t(), ginv, sinv[1:2],
                      out_dtype=_out_dtype(x_dtype)).to(x_dtype)
        if need_w:      # dw [out, in] = dy^T [out, m] @ x [m, in]
            dy8_t = _pad_rows(dy8).t().contiguous()
            x8_t = _pad_rows(x8).t().contiguous()
            dw = gemm(dy8_t, x8_t.t(), ginv, sinv[0:1],
                      out_dtype=_out_dtype(w_dtype)).to(w_dtype)
        if need_b:
            db = dy.sum(0, dtype=torch.float32).to(b_dtype)
        return dx, dw, db, None, None, None, None, None, None


def linear(module: nn.Linear, x: torch.Tensor, recipe: Recipe, pending: object = None,
           replay: object = None) -> torch.Tensor:
    """F.linear(x, module.weight, module.bias) with FP8 GEMMs and the module's state;
    `pending`: the region's amax reduction, if any; with ``replay`` (a checkpoint's
    recomputation) with its recipe and scales, the state untouched."""
    out_f, in_f = module.weight.shape
    if in_f % MULTIPLE or out_f % MULTIPLE:
        raise ValueError(f"ampc.fp8.Linear: FP8 GEMMs need in_features and out_features that "
                         f"are multiples of {MULTIPLE}, got {in_f} and {out_f}; leave this "
                         f"layer out of the FP8 region")
    if x.shape[-1] != in_f:
        raise ValueError(f"ampc.fp8.Linear: input has {x.shape[-1]} features, the layer "
                         f"takes {in_f}")
    record = None
    if replay is None:
        match_recipe(module, recipe)
        record = _recompute.recording()
    out_dtype = (torch.get_autocast_dtype(x.device.type)
                 if torch.is_autocast_enabled(x.device.type) else x.dtype)
    x2 = x.reshape(-1, in_f)
    if x2.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        x2 = x2.float()
    y = _Fp8LinearFn.apply(x2.contiguous(), module.weight, module.bias, module, recipe,
                           out_dtype, pending, replay, record)
    return y.reshape(*x.shape[:-1], out_f)


class Linear(nn.Linear):
    """A drop-in for nn.Linear (same constructor, parameters and state_dict keys, plus the
    FP8 scaling state), whose GEMMs run in FP8 inside ``ampc.fp8.autocast``.

    A state_dict without the FP8 state (one saved from nn.Linear) loads: the state starts
    afresh. One saved with another amax history length loads with that length.

    Under activation checkpointing (torch.utils.checkpoint, reentrant or not) the
    recomputation of a forward casts with the recipe and scales that forward used and leaves
    the state alone. Under torch.compile each FP8 call runs eagerly, a graph break on each
    side; outside a region the layer compiles as nn.Linear.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__(in_features, out_features, bias, device, dtype)
        init_state(self, device=self.weight.device)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            if not _open_regions.stack():     # no FP8 region open: nn.Linear, traced
                return F.linear(input, self.weight, self.bias)
            return _eager_forward(self, input)
        replay = _recompute.replayed(self)
        if replay is None:              # not a checkpoint's recomputation
            region = _open_regions.current()
            if region is None:
                if _open_regions.stack():     # a disabled region inside an enabled one
                    _recompute.record_not_fp8(self)
                return F.linear(input, self.weight, self.bias)
            return linear(self, input, region[0], region[2])
        if replay is _recompute.NOT_FP8:
            return F.linear(input, self.weight, self.bias)
        return linear(self, input, replay.recipe, replay=replay)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        mine = self.fp8_fwd_amax_history
        history = state_dict.get(prefix + "fp8_fwd_amax_history")
        if history is None or history.shape != mine.shape:
            # none saved: start afresh; another history length: take that one
            init_state(self, mine.shape[0] if history is None else history.shape[0], mine.device)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)
        ours = {prefix + name for name in PERSISTENT}
        missing_keys[:] = [k for k in missing_keys if k not in ours]


# torch.compile: an FP8 call runs eagerly, a graph break on each side. Traced (torch 2.14),
# AOTAutograd's partitioner saved the scale_inv buffer itself for the backward and redid the
# copy taken before its in-place update there, after the update: the weight gradient came out
# scaled by the new inverse scale instead of the one the input was cast with.
_eager_forward = torch.compiler.disable(Linear.forward, recursive=True)


def convert(model: nn.Module, modules: tuple[type[nn.Module], ...] = (nn.Linear,)) -> nn.Module:
    """Turns every module of `model` (itself included) whose type is exactly one of `modules`
    into an ampc.fp8.Linear in place, its parameters kept, with a fresh FP8 state. Done by
    ampc.fp8.autocast as modules are reached; call it yourself before loading a checkpoint
    saved from an FP8-trained model into a fresh one. Returns `model`."""
    for m in model.modules():
        if type(m) in modules:
            to_fp8(m)
    return model


def to_fp8(module: nn.Linear) -> "Linear":
    if not isinstance(module, Linear):
        module.__class__ = Linear
        init_state(module, device=module.weight.device)
    return module
