"""ampc's own casting of one op, for ops whose ampc policy differs from torch's lists.

Such an op runs with torch's autocast off for the call (the mode does that), so everything
torch's autocast would have done is done here, as ``aten/src/ATen/autocast_mode.cpp`` does it:
eligible tensors (floating, not float64, on the region's device, at the top level, in lists or
in dicts) are cast per the policy, weights through the weight cache, the rest in one kernel
call; under torch.compile the casts are plain ``.to()`` calls Dynamo can trace.
"""
import functools

import torch

from .. import policy as _policy
from ._casts import cast_tensors
from .._walk import map_tensors, tensors
from ._weight_cache import cast_weights, is_weight
from ..policy import CastPolicy as P

_FP32 = torch.float32
_LOW = (torch.float16, torch.bfloat16)
ELIGIBLE = frozenset(d for d in vars(torch).values()
                     if isinstance(d, torch.dtype) and d.is_floating_point and d is not torch.float64)
_NoSubclassTF = torch._C.DisableTorchFunctionSubclass
ON_DEVICE = {"cpu": "is_cpu", "cuda": "is_cuda"}     # the Tensor property that says "on it"
_Tensor = torch.Tensor


def _eligible(args, kwargs, on, skip=None):
    """Every eligible tensor argument not already in dtype ``skip``, by id."""
    return {id(t): t for t in tensors((args, kwargs))
            if t.dtype is not skip and t.dtype in ELIGIBLE and getattr(t, on)}


def _to(t, dtype, on):
    return t.to(dtype) if t.dtype is not dtype and t.dtype in ELIGIBLE and getattr(t, on) else t


def cast_args(args, kwargs, dtype, on, st):
    """(args, kwargs) with their eligible tensors cast to ``dtype``: weights through the
    cache, the others in one kernel call."""
    if torch.compiler.is_compiling():     # plain .to() that Dynamo can trace; no cache (as torch)
        to = functools.partial(_to, dtype=dtype, on=on)
        return map_tensors(to, args), map_tensors(to, kwargs)
    todo = _eligible(args, kwargs, on, dtype)
    if not todo:
        return args, kwargs
    with _NoSubclassTF():
        cache = dtype in _LOW and torch.is_autocast_cache_enabled() and not torch.is_inference_mode_enabled()
        weights = {k: t for k, t in todo.items() if cache and is_weight(t)}
        casts = cast_weights(weights, dtype, st) if weights else {}
        rest = [t for k, t in todo.items() if k not in weights]
        if rest:
            casts.update(zip(map(id, rest), cast_tensors(rest, dtype)))
    sub = casts.get
    return map_tensors(lambda t: sub(id(t), t), args), map_tensors(lambda t: sub(id(t), t), kwargs)


def _promote_type(args, kwargs, on, start):
    """torch's at::autocast::prioritize: the widest eligible dtype, fp32 over fp16/bf16."""
    cur = start
    for t in _eligible(args, kwargs, on).values():
        if cur is _FP32 or t.dtype is _FP32:
            cur = _FP32
        elif t.dtype is not cur:
            raise RuntimeError("Unexpected floating ScalarType in at::autocast::prioritize")
    return cur


def apply_policy(func, name, pol, args, kwargs, dev, dtype, st):
    """Runs ``func`` as policy ``pol`` says, ampc doing the casts (torch's autocast is off)."""
    on = ON_DEVICE[dev]
    if pol is P.LOWER_PRECISION_FP:
        args, kwargs = cast_args(args, kwargs, dtype, on, st)
    elif pol is P.FP32:
        args, kwargs = cast_args(args, kwargs, _FP32, on, st)
    elif pol in (P.FP32_SET_OPT_DTYPE, P.FP32_APPEND_DTYPE):
        first = args[0] if args else kwargs.get("input")
        if (isinstance(first, _Tensor) and first.dtype in ELIGIBLE and getattr(first, on)
                and kwargs.get("dtype") is None and not any(isinstance(a, torch.dtype) for a in args)):
            kwargs = {**kwargs, "dtype": _FP32}
    elif pol is P.PROMOTE:
        args, kwargs = cast_args(args, kwargs, _promote_type(args, kwargs, on, dtype), on, st)
    elif pol is P.FP32_KEEP_DTYPE:
        first = next(iter(_eligible(args, kwargs, on).values()), None)
        args, kwargs = cast_args(args, kwargs, _FP32, on, st)
        out = func(*args, **kwargs)
        return out if first is None or first.dtype is _FP32 else _outputs_to(out, first.dtype)
    elif pol is P.BANNED:
        if name == "binary_cross_entropy":
            raise RuntimeError(_policy.BCE_MESSAGE)
        raise RuntimeError(f"ampc.autocast: {name} is banned under autocast by the policy "
                           f"registry (ampc.policy.get_policy({name!r}, {dev!r}))")
    return func(*args, **kwargs)


def _outputs_to(out, dtype):
    fp32 = [t for t in tensors(out) if t.dtype is _FP32]
    casts = dict(zip(map(id, fp32), cast_tensors(fp32, dtype))) if fp32 else {}
    return map_tensors(lambda t: casts.get(id(t), t), out)
