"""The modules a plan decides, and what each choice means for one of them.

A unit is a module whose type is in UNIT_TYPES, or that computes a matmul, a convolution
or a normalisation whatever its class (``ampc._module_kinds``: transformers' GPT-2 Conv1D,
Llama's and T5's RMSNorm), or, when the caller names types, one of those. Its choice is
one of CANDIDATES:

  fp32  the module's ops run in float32 (module_scope dtype=float32)
  bf16  its lower-precision ops (GEMMs, convolutions, attention) run in bfloat16, and for
  fp16  a norm or softmax module its reduction too (the op policy set to lower precision
        inside it, where autocast would otherwise keep it in fp32)
  fp8   an nn.Linear whose GEMMs run in FP8 (ampc.fp8.Linear), the rest in bf16; not
        offered to other GEMMs (a Conv1D): ampc.fp8.convert swaps nn.Linear only

Ops outside every unit (residual adds, a functional attention call, activations) run at
the plan's region dtype under autocast's default policy.
"""
from __future__ import annotations

import enum

from torch import nn

import ampc      # its fp8 attribute loads ampc.fp8 (and torch._dynamo) on first use only
from . import _candidates
from .. import _module_kinds

CANDIDATES = tuple(_candidates.REGISTRY)     # their records: _candidates.py
FP8_RECIPES = ("delayed", "current")

GEMM_TYPES = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d,
              nn.ConvTranspose2d, nn.ConvTranspose3d, nn.MultiheadAttention)
NORM_TYPES = (nn.LayerNorm, nn.GroupNorm, nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d,
              nn.RMSNorm, nn.Softmax, nn.LogSoftmax)
UNIT_TYPES = GEMM_TYPES + NORM_TYPES

# the reductions a norm or softmax unit computes; lowered with it, kept fp32 otherwise
REDUCTION_OPS = ("layer_norm", "group_norm", "batch_norm", "rms_norm", "softmax",
                 "log_softmax")


class Reason(str, enum.Enum):
    """Why a unit holds its choice."""
    SOLVED = "solved"                     # the cheapest within the budget, unit by unit
    BACKED_OFF = "backed off"             # raised: the whole plan was over the budget
    WHOLE_MODEL = "whole model"           # the whole model measured faster this way
    ALL_FP32 = "all fp32"                 # the whole plan kept in fp32 (over budget or slower)
    PEAK = "peak budget"                  # lowered: the step's peak was over the byte budget
    MONITOR = "monitor"                   # raised by the Monitor during training
    SET = "set"                           # set by hand (Applied.set)


def kind(module):
    """'gemm', 'norm' (by class, else by what it computes) or 'other' (a unit the caller
    named by type)."""
    if isinstance(module, GEMM_TYPES):
        return "gemm"
    if isinstance(module, NORM_TYPES):
        return "norm"
    return _module_kinds.kind(module) or "other"


def candidates_for(module, candidates):
    """The candidates that mean something for ``module`` (fp8: Linear layers only)."""
    return [c for c in candidates if _candidates.get(c).fits(module)]


def find_units(model: nn.Module, types: tuple | None = None) -> dict[str, nn.Module]:
    """{qualified name: module} of the units of ``model``, in module order: the instances
    of ``types``, or by default those of UNIT_TYPES and the modules found to compute a
    GEMM or a norm. A unit inside another unit (a Linear inside a MultiheadAttention) is
    left to its parent.

    named_modules walks depth first, so a unit's descendants come right after it: the one
    unit last entered is all that needs remembering (linear in the number of modules)."""
    units, inside = {}, None
    for name, module in model.named_modules():
        if inside is not None and name.startswith(inside):
            continue
        inside = None
        if name and (isinstance(module, types) if types else kind(module) != "other"):
            units[name] = module
            inside = name + "."
    return units


def fp8_recipe(name: str | None):
    """The ampc.fp8 recipe a plan names: "current" (Float8CurrentScaling), else "delayed"."""
    return ampc.fp8.Float8CurrentScaling() if name == "current" else ampc.fp8.DelayedScaling()


def scope_args(module, choice):
    """(dtype, ops) of the module_scope that makes ``module`` run at ``choice``."""
    ops = None
    if kind(module) == "norm" and not _candidates.full_precision(choice):
        # fp32 needs no op policy: the scope casts the module's inputs to fp32 and its
        # reductions follow them
        ops = {op: "lower_precision_fp" for op in REDUCTION_OPS}
    return _candidates.get(choice).dtype, ops


def param_bytes(module):
    return sum(p.numel() for p in module.parameters())


