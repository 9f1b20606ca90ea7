"""FP8 recipes: which formats, and how each tensor's scale is chosen.

Named as TransformerEngine names them (``recipe.Format``, ``recipe.DelayedScaling``,
``recipe.Float8CurrentScaling``), so code written for it reads the same here.
"""
import enum
from dataclasses import dataclass

import torch

FMAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
AMAX_COMPUTE_ALGOS = ("max", "most_recent")


class Format(enum.Enum):
    """E4M3: e4m3 for everything. HYBRID: e4m3 forward (weights, activations), e5m2 for the
    gradients of the backward pass, whose range is wider and precision matters less."""
    E4M3 = "E4M3"
    HYBRID = "HYBRID"

    @property
    def fwd_dtype(self):
        return torch.float8_e4m3fn

    @property
    def bwd_dtype(self):
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
    """
    margin: int = 0
    fp8_format: Format = Format.HYBRID
    amax_history_len: int = 1024
    amax_compute_algo: str = "max"

    def __post_init__(self):
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

    current = False

    @property
    def history_len(self):
        return self.amax_history_len


@dataclass(frozen=True)
class Float8CurrentScaling:
    """Each tensor is cast with the scale of its own amax, taken in a read pass just before
    the cast (two passes over the tensor, no history): the most accurate choice, at the cost
    of the extra read."""
    fp8_format: Format = Format.HYBRID

    def __post_init__(self):
        _check_format("Float8CurrentScaling", self.fp8_format)

    current = True
    margin = 0
    history_len = 1
    amax_compute_algo = "most_recent"


RECIPES = (DelayedScaling, Float8CurrentScaling)
