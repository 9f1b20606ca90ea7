"""The modules a plan decides, and what each choice means for one of them.

A unit is a module whose type is in UNIT_TYPES (or that the caller names). Its choice is
one of CANDIDATES:

  fp32  the module's ops run in float32 (module_scope dtype=float32)
  bf16  its lower-precision ops (GEMMs, convolutions, attention) run in bfloat16, and for
  fp16  a norm or softmax module its reduction too (the op policy set to lower precision
        inside it, where autocast would otherwise keep it in fp32)
  fp8   an nn.Linear whose GEMMs run in FP8 (ampc.fp8.Linear), the rest in bf16

Ops outside every unit (residual adds, a functional attention call, activations) run at
the plan's region dtype under autocast's default policy.
"""
import torch
from torch import nn

CANDIDATES = ("fp32", "bf16", "fp16", "fp8")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16,
          "fp8": torch.bfloat16}
BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1}

GEMM_TYPES = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d,
              nn.ConvTranspose2d, nn.ConvTranspose3d, nn.MultiheadAttention)
NORM_TYPES = (nn.LayerNorm, nn.GroupNorm, nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d,
              nn.RMSNorm, nn.Softmax, nn.LogSoftmax)
UNIT_TYPES = GEMM_TYPES + NORM_TYPES

# the reductions a norm or softmax unit computes; lowered with it, kept fp32 otherwise
REDUCTION_OPS = ("layer_norm", "group_norm", "batch_norm", "rms_norm", "softmax",
                 "log_softmax")


def kind(module):
    """'gemm', 'norm' or 'other' (a unit the caller named by type)."""
    if isinstance(module, GEMM_TYPES):
        return "gemm"
    if isinstance(module, NORM_TYPES):
        return "norm"
    return "other"


def fp8_capable(module):
    """ampc.fp8.Linear takes an nn.Linear whose in and out features are multiples of 16."""
    return (type(module) is nn.Linear and module.in_features % 16 == 0
            and module.out_features % 16 == 0)


def candidates_for(module, candidates):
    """The candidates that mean something for ``module`` (fp8: Linear layers only)."""
    return [c for c in candidates if c != "fp8" or fp8_capable(module)]


def find_units(model, types=UNIT_TYPES):
    """{qualified name: module} of the units of ``model``, in module order. A unit inside
    another unit (a Linear inside a MultiheadAttention) is left to its parent."""
    units, inside = {}, []
    for name, module in model.named_modules():
        if any(name.startswith(p + ".") for p in inside):
            continue
        if isinstance(module, types) and name:
            units[name] = module
            inside.append(name)
    return units


def scope_args(module, choice):
    """(dtype, ops) of the module_scope that makes ``module`` run at ``choice``."""
    ops = None
    if kind(module) == "norm" and choice != "fp32":
        # fp32 needs no op policy: the scope casts the module's inputs to fp32 and its
        # reductions follow them
        ops = {op: "lower_precision_fp" for op in REDUCTION_OPS}
    return DTYPES[choice], ops


def param_bytes(module):
    return sum(p.numel() for p in module.parameters())


