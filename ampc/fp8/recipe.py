"""FP8 recipes: which formats, and how each tensor's scale is chosen.

Named as TransformerEngine names them (``recipe.Format``, ``recipe.DelayedScaling``,
``recipe.Float8CurrentScaling``), so code written for it reads the same here.
"""
from __future__ import annotations  # "X | None" hints on Python 3.9 too; none evaluated at import

import enum
from dataclasses import dataclass
from typing import Union

import torch

__all__ = ["Format", "DelayedScaling", "Float8CurrentScaling", "Recipe", "RECIPES", "FMAX",
           "AMAX_COMPUTE_ALGOS", "NAMES", "by_name", "check_recipe"]

FMAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
AMAX_COMPUTE_ALGOS = ("max", "most_recent")


class Format(enum.Enum):
    """E4M3: e4m3 for everything. HYBRID: e4m3 forward (weights, activations), e5m2 for the
    gradients of the backward pass, whose range is wider and precision matters less."""
    E4M3 = "E4M3"
    HYBRID = "HYBRID"

    @property
    def fwd_dtype(self) -> torch.dtype:
        return torch.float8_e4m3fn

    @property
    def bwd_dtype(self) -> torch.dtype:
        return torch.float8_e4m3fn if self is Format.E4M3 else torch.float8_e5m2


def _check_format(name, fmt):
    if not isinstance(fmt, Format):
        raise TypeError(f"ampc.fp8.{name}: fp8_format must be an ampc.fp8.Format, got {fmt!r}")


@dataclass(frozen=True)
class DelayedScaling:
    """Each tensor is cast with a scale computed from the amaxes of earlier steps:
    scale = fmax / amax / 2**margin, amax the max (``amax_compute_algo="max"``) of the last
    ``amax_history_len`` steps' amaxes or the latest one (``"most_recent"``). A step whose
    amax is 0, inf or nan keeps the previous scale. The amax of a step is taken in the same
    pass as its cast, and the scales are updated on the device: no host sync.

    ``reduce_amax`` (default True): where the region has a process group of more than one
    rank (``ampc.fp8.autocast(fp8_group=...)``, the default group when torch.distributed is
    initialized), the amaxes are reduced with MAX across its ranks before the scales are
    updated, so every data-parallel rank casts with the same scales, made from everyone's
    data: one all_reduce for the forward amaxes of all modules at the region's exit, one for
    the backward amaxes when the backward pass ends, the updates after each. Until then a
    module keeps its scales, and a module used twice in one region gets the max of both
    uses. In one process nothing changes: each cast updates its scales right after it.
    """
    margin: int = 0
    fp8_format: Format = Format.HYBRID
    amax_history_len: int = 1024
    amax_compute_algo: str = "max"
    reduce_amax: bool = True

    def __post_init__(self) -> None:
        _check_format("DelayedScaling", self.fp8_format)
        if not isinstance(self.margin, int) or self.margin < 0:
            raise ValueError(f"ampc.fp8.DelayedScaling: margin must be an int >= 0, "
                             f"got {self.margin!r}")
        if not isinstance(self.amax_history_len, int) or self.amax_history_len < 1:
            raise ValueError(f"ampc.fp8.DelayedScaling: amax_history_len must be an int >= 1, "
                             f"got {self.amax_history_len!r}")
        if self.amax_compute_algo not in AMAX_COMPUTE_ALGOS:
            raise ValueError(f"ampc.fp8.DelayedScaling: amax_compute_algo must be one of "
                             f"{AMAX_COMPUTE_ALGOS}, got {self.amax_compute_algo!r}")
        if not isinstance(self.reduce_amax, bool):
            raise TypeError(f"ampc.fp8.DelayedScaling: reduce_amax must be a bool, "
                            f"got {self.reduce_amax!r}")

    current = False

    @property
    def history_len(self) -> int:
        return self.amax_history_len


@dataclass(frozen=True)
class Float8CurrentScaling:
    """Each tensor is cast with the scale of its own amax, taken in a read pass just before
    the cast (two passes over the tensor, no history): the most accurate choice, at the cost
    of the extra read.

    No amax is reduced across ranks. Under data parallelism each rank's tensor is a whole
    tensor of its own (its batch's activations and gradients; the weight, the same on every
    rank, all-gathered whole under FSDP2), so its own amax is the right one, and a max over
    ranks would only coarsen the scales of the ranks with smaller data. TransformerEngine
    reduces current-scaling amaxes only where one tensor is split across ranks (sequence or
    tensor parallel input sharding), which ampc.fp8 does not do. The state left in the
    buffers (the last amax and scale) may differ across ranks; nothing reads it before it is
    recomputed."""
    fp8_format: Format = Format.HYBRID

    def __post_init__(self) -> None:
        _check_format("Float8CurrentScaling", self.fp8_format)

    current = True
    reduce_amax = False
    margin = 0
    history_len = 1
    amax_compute_algo = "most_recent"


RECIPES = (DelayedScaling, Float8CurrentScaling)
Recipe = Union[DelayedScaling, Float8CurrentScaling]

# the recipes by the names torchtitan's and ampc's settings give them
NAMES = {"delayed": DelayedScaling, "current": Float8CurrentScaling}


def by_name(name: str, where: str = "ampc.fp8.recipe.by_name: name") -> Recipe:
    """A new recipe, with its defaults, of the kind ``name`` says: "delayed"
    (DelayedScaling) or "current" (Float8CurrentScaling). ``where`` names the caller and
    its argument in the error (as "ampc.autoprecision.search: fp8_recipe")."""
    kind = NAMES.get(name) if isinstance(name, str) else None
    if kind is None:
        raise ValueError(f"{where} must be 'delayed' or 'current', got {name!r}")
    return kind()


def check_recipe(recipe: object, where: str = "ampc.fp8.recipe.check_recipe: recipe") -> Recipe:
    """``recipe`` itself when it is a DelayedScaling or a Float8CurrentScaling, else a
    TypeError; ``where`` names the caller and its argument in the error."""
    if not isinstance(recipe, RECIPES):
        raise TypeError(f"{where} must be an ampc.fp8.DelayedScaling or "
                        f"ampc.fp8.Float8CurrentScaling, got {type(recipe).__name__}")
    return recipe
