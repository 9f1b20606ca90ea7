"""The precisions a unit can take, one record each: what autoprecision needs to know of a
candidate lives here, so that adding one is a record (and its tests), not an edit in each
module that measures, solves, applies or prints a plan.

``REFERENCE`` (fp32) is what every other candidate is measured against.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class Candidate:
    name: str
    dtype: torch.dtype          # what the unit's ops run in (fp8: its ops other than the GEMMs)
    bytes: int                  # bytes a value of its outputs and saved tensors
    raise_to: str               # one step up: where a unit goes when a plan backs off
    loss_scaled: bool = False   # its gradients need a loss scale (their range is checked)
    fp8_linear: bool = False    # the unit is swapped for ampc.fp8.Linear (GEMMs in FP8)
    for_loss: bool = True       # the loss may be computed at it
    saved: str | None = None    # how the unit keeps what it saves for the backward
                                # (ampc.memory.compress); None: as it is

    @property
    def saved_bytes(self) -> int:
        """Bytes a value of what the unit saves for the backward."""
        return 1 if self.saved == "8bit" else self.bytes

    def fits(self, module: nn.Module) -> bool:
        """Whether the candidate means something for ``module``."""
        return not self.fp8_linear or fp8_capable(module)


def fp8_capable(module):
    """ampc.fp8.Linear takes an nn.Linear whose in and out features are multiples of 16."""
    return (type(module) is nn.Linear and module.in_features % 16 == 0
            and module.out_features % 16 == 0)


REFERENCE = "fp32"
REGISTRY = {c.name: c for c in (
    Candidate("fp32", torch.float32, 4, "fp32"),
    Candidate("bf16", torch.bfloat16, 2, "fp32"),
    Candidate("fp16", torch.float16, 2, "fp32", loss_scaled=True),
    Candidate("fp8", torch.bfloat16, 1, "bf16", fp8_linear=True, for_loss=False),
    # the same precisions, with the unit's saved activations kept in 8 bits until the backward
    Candidate("fp32+8b", torch.float32, 4, "fp32", for_loss=False, saved="8bit"),
    Candidate("bf16+8b", torch.bfloat16, 2, "bf16", for_loss=False, saved="8bit"),
)}


def get(name: str) -> Candidate:
    return REGISTRY[name]


def loss_names() -> tuple[str, ...]:
    """The candidates the loss may be computed at."""
    return tuple(n for n, c in REGISTRY.items() if c.for_loss)


def loss_scaled(name: str) -> bool:
    return REGISTRY[name].loss_scaled


def fp8_linear(name: str) -> bool:
    return REGISTRY[name].fp8_linear


def saved(name: str) -> str | None:
    return REGISTRY[name].saved


def full_precision(name: str) -> bool:
    """Whether the unit's ops run in fp32 (fp32, and fp32 with its saved tensors coded)."""
    return REGISTRY[name].dtype == torch.float32


def in_fp32(name: str) -> str:
    """The candidate computing in fp32 that keeps the unit's saved tensors as ``name`` does."""
    keep = REGISTRY[name].saved
    return next(n for n, c in REGISTRY.items()
                if c.dtype == torch.float32 and c.saved == keep and not c.fp8_linear)


def region_dtype(choices) -> str:
    """The autocast region a plan of these choices runs in: the lower dtype its choices
    use, bf16 where any runs in bf16 (bf16 and fp16 regions do not nest), else fp16,
    else fp32."""
    dtypes = {REGISTRY[c].dtype for c in choices if c != REFERENCE}
    for name in ("bf16", "fp16"):
        if REGISTRY[name].dtype in dtypes:
            return name
    return REFERENCE
