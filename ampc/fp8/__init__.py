"""ampc.fp8: FP8 training. Scaled casts with amax in one pass (ampc.ops.cast_fp8),
delayed or current scaling on the device, FP8 GEMMs through cuBLASLt on GPUs that have
FP8 and an exact reference path on the CPU. Under torch.distributed, delayed scaling's
amaxes are reduced across the ranks (DelayedScaling's reduce_amax, autocast's fp8_group).

    model = ampc.fp8.convert(model)           # optional: nn.Linear -> ampc.fp8.Linear now
    with ampc.fp8.autocast(recipe=ampc.fp8.DelayedScaling()):
        loss = loss_fn(model(x), y)
    loss.backward()

Activation checkpointing recomputes with the forward's scales (bit for bit the training
without it); under torch.compile the FP8 calls run eagerly between compiled graphs.
"""
from .autocast_mode import autocast
from ._gemm import gemm
from .linear import Linear, convert
from .recipe import DelayedScaling, Float8CurrentScaling, Format

__all__ = ["autocast", "gemm", "Linear", "convert", "DelayedScaling", "Float8CurrentScaling",
           "Format"]
