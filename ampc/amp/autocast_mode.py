"""ampc.autocast (defined here, in ampc.amp.autocast_mode): torch's autocast, with ampc's policy
registry and weight cache on top.

A region switches torch's own autocast state on (enabled, dtype, cache, nesting), exactly as
torch.autocast does, so torch's getters report it, torch's C++ autocast casts activations
(the ops C++ composites call inside included) with torch's own cast nodes, a nested
torch.autocast region takes effect, and code that asks torch (custom_fwd, checkpoint's
recomputation, DataParallel's threads) sees the region. On top of that a TorchFunctionMode
(``_Mode``) sees each Python-level call, when the region has something for it to do (else it
stays off and a region costs what torch.autocast costs), and
  - feeds the fp32 weights of lower-precision ops from ampc's weight cache (one kernel call
    per bucket of weights; on CUDA by default, see _weight_cache.py); torch then finds them
    cast already;
  - runs an op whose ampc policy differs from torch's list (set_policy, register, scope
    ops) with torch's autocast switched off for that call and the casts done by ampc;
  - carries the region into activation checkpointing's recomputation when such an op runs
    inside a checkpointed forward (torch restores its own state there, not a mode's);
  - with check_finite=True, checks every op's output (_overflow.py).
Why this design: torch's C++ cast node costs a few microseconds where a Python one costs tens,
a mode that is on costs a few microseconds per call, and letting torch do what its lists say
makes torch conformance hold by construction (benchmarks/bench_autocast.py measures it).

State is thread-local, as torch's is. Reference: torch/amp/autocast_mode.py.
"""
from __future__ import annotations  # "X | None" hints on Python 3.9 too; none evaluated at import

import functools
import threading
import types
import warnings
from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch.overrides import TorchFunctionMode

from .. import policy as _policy
from .. import _checkpoint
from .._checkpoint import carry_into_checkpoint
from ._composites import call_lifted
from . import _overflow
from ._overflow import checked, install_hooks, remove_hooks
from ._policy_casts import ON_DEVICE as _ON_DEVICE, apply_policy, cast_args
from .._walk import map_tensors
from ._weight_cache import FUSED as _FUSED, cast_weights, is_weight, order_of
from ..policy import CastPolicy as P

__all__ = ["autocast", "is_autocast_available", "is_autocast_enabled", "get_autocast_dtype",
           "set_autocast_dtype", "is_autocast_cache_enabled", "clear_autocast_cache", "custom_fwd",
           "custom_bwd"]

_F = TypeVar("_F", bound=Callable[..., Any])

_Tensor = torch.Tensor
_FP32, _FP16, _BF16 = torch.float32, torch.float16, torch.bfloat16
_DEVICES = tuple(_ON_DEVICE)
_SUPPORTED = {"cpu": (_FP16, _BF16), "cuda": (_FP16, _BF16, _FP32)}   # as torch (CUDA takes fp32)


class _State(threading.local):
    """ampc's per-thread state; torch's autocast state holds enabled, dtype and cache."""

    def __init__(self):
        self.depth = 0            # open ampc regions (the mode is on while > 0)
        self.plain = True         # no weight feeding, scope ops or checks: the mode passes calls on
        self.saved = []           # one entry per open region: torch's state to restore on exit
        self.pushed = []          # one entry per open region: whether it put the mode on
        self.check_finite = False
        self.recorder = None      # the scaler's armed Recorder, in the region it records
        self.cache = {}           # (id(weight), dtype) -> (weight, version, cast)
        self.learned = {}         # the order the last region cast weights in (_weight_cache)
        self.modules = []         # with check_finite: modules whose forward is running
        self.hooked = 0           # depth that installed the module hooks, or 0
        self.lifting = set()      # Python composites running with the mode on (no re-entry)


_st = _State()
_ptls = _policy._tls
_enabled = torch.is_autocast_enabled
_get_dtype = torch.get_autocast_dtype
_cache_on = torch.is_autocast_cache_enabled
_NoSubclassTF = torch._C.DisableTorchFunctionSubclass
_FunctionType = types.FunctionType


# ---- the mode ----

_FUNCS = _policy.FUNCS
_EFFECTIVE = _policy.EFFECTIVE
_TORCH = _policy.DEFAULTS          # torch's own lists: what torch's autocast does by itself
_LOWER, _PASS = P.LOWER_PRECISION_FP, P.PASSTHROUGH   # plain names: cheaper than Enum reads


class _Mode(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        st = _st
        if st.plain and not _policy.CHANGED:     # nothing for ampc to add: torch does it all
            return func(*args, **kwargs) if kwargs else func(*args)
        try:
            name = _FUNCS.get(func)
        except TypeError:      # unhashable: not an op
            name = None
        if kwargs is None:
            kwargs = {}
        if st.check_finite:
            return checked(_run, func, name, args, kwargs, st)
        return _run(func, name, args, kwargs, st)


_MODE = _Mode()


def _edited():
    """Whether an op inside a Python composite could need the mode: the policy has changes."""
    sc = _ptls.scope
    return _policy.EDITED or (sc is not None and bool(sc.ops))


def _push():
    torch._C._push_on_torch_function_stack(_MODE)


def _pop():
    torch._C._pop_torch_function_stack()


def _call_composite(func, args, kwargs, st):
    if torch.compiler.is_compiling():     # Dynamo inlines the function and shows us its calls
        return func(*args, **kwargs)
    return call_lifted(func, args, kwargs, st, _push, _pop)


def _run(func, name, args, kwargs, st):
    if name is None:       # most calls: torch's autocast (if on) does what its lists say
        if type(func) is _FunctionType and _edited():
            return _call_composite(func, args, kwargs, st)
        return func(*args, **kwargs)
    return _dispatch(func, name, args, kwargs, st)


def _first_tensor(args, kwargs):
    for a in (*args, *kwargs.values()) if kwargs else args:
        if isinstance(a, _Tensor):
            return a
        if type(a) is list or type(a) is tuple:
            for x in a:
                if isinstance(x, _Tensor):
                    return x
    return None


def _region_device(args, kwargs):
    """'cpu' or 'cuda': the device of the first tensor argument, when autocast is on there;
    else None."""
    t = _first_tensor(args, kwargs)
    if t is None or (type(t) is not _Tensor and getattr(t, "_ampc_deferred", False)):
        return None           # logits a sliced head defers: its own __torch_function__ decides
    dev = "cuda" if t.is_cuda else "cpu" if t.is_cpu else None
    return dev if dev is not None and _enabled(dev) else None


def _dispatch(func, name, args, kwargs, st):
    dev = _region_device(args, kwargs)
    if dev is None:
        return func(*args, **kwargs)
    sc = _ptls.scope
    pol = (sc.ops.get(name) if sc is not None else None) or _EFFECTIVE[dev].get(name)
    if pol is _PASS:
        pol = None
    if pol is _TORCH[dev].get(name):          # torch's autocast does the same: let it
        if pol is _LOWER and _FUSED[dev] and _cache_on() and not torch.compiler.is_compiling() \
                and not torch.is_inference_mode_enabled():
            return func(*_feed_weights(args, _get_dtype(dev), _ON_DEVICE[dev], st), **kwargs)
        return func(*args, **kwargs)
    if kwargs.get("out") is not None:         # out= calls are not autocast (as torch)
        return func(*args, **kwargs)
    dtype = _get_dtype(dev)
    if torch.compiler.is_compiling():
        with torch.autocast(dev, enabled=False):
            return apply_policy(func, name, pol, args, kwargs, dev, dtype, st)
    carry_into_checkpoint(_under_region)
    with torch._C._DisableAutocast():
        return apply_policy(func, name, pol, args, kwargs, dev, dtype, st)


def _feed_weights(args, dtype, on, st):
    """``args`` with the fp32 weights among them (top level and in lists) taken from the
    weight cache; kwargs are left to torch. Flat loops, not the shared walk: this runs on
    every lower-precision call, and torch's ops take tensors at the top level or in a list."""
    cache, out, missing = st.cache, None, None
    for i, a in enumerate(args):
        if isinstance(a, _Tensor):
            if a.dtype is _FP32 and a.requires_grad and a.is_leaf and getattr(a, on):
                hit = cache.get((id(a), dtype))
                if hit is not None and hit[0] is a and hit[1] == a._version:
                    out = out or list(args)
                    out[i] = hit[2]
                else:
                    missing = missing or []
                    missing.append(a)
        elif (type(a) is list or type(a) is tuple) and any(isinstance(x, _Tensor) for x in a):
            missing = missing or []
            missing.extend(x for x in a if isinstance(x, _Tensor) and x.dtype is _FP32
                           and x.requires_grad and x.is_leaf and getattr(x, on))
    if not missing:
        return args if out is None else tuple(out)
    # a method call on a Parameter would go through its Python __torch_function__: not needed
    with _NoSubclassTF():
        casts = cast_weights({id(w): w for w in missing if is_weight(w)}, dtype, st)
    if not casts:
        return args if out is None else tuple(out)
    sub = casts.get
    return map_tensors(lambda t: sub(id(t), t), args if out is None else tuple(out))


# ---- activation checkpointing: the recomputation runs under the region too ----

def _under_region(fn):
    """``fn`` run under this region: the mode on and the current ``with scope(...)``."""
    sc = _ptls.scope
    outer = sc.outer if sc is not None else None

    @functools.wraps(fn)
    def recompute(*args, **kwargs):
        with _Recompute(outer):
            return fn(*args, **kwargs)
    recompute._ampc = True
    return recompute


class _Recompute:
    """Scope ``scope`` restored and the mode on, for a checkpoint's recomputation; with
    ``torch_state`` torch's autocast state too ((enabled, dtype) per device), and with
    ``open`` False no ampc region (the forward ran outside one)."""

    def __init__(self, scope, torch_state=None, open=True):
        self.scope, self.torch_state, self.open = scope, torch_state, open

    def __enter__(self):
        self.prev = _ptls.scope
        _ptls.scope = self.scope
        self.prev_torch = None if self.torch_state is None else _torch_state()
        if self.torch_state is not None:
            _set_torch_state(self.torch_state)
        # backward called inside a region runs with the mode off, the region still open
        self.pushed = self.open and not _mode_on()
        if self.pushed:
            _push()
        _st.depth += self.open
        _refresh(_st)

    def __exit__(self, *exc):
        _st.depth -= self.open
        if self.pushed:
            _pop()
        if self.open:
            _region_closed(_st)
        if self.prev_torch is not None:
            _set_torch_state(self.prev_torch)
        _ptls.scope = self.prev
        _refresh(_st)
        return False


def _region_now():
    """This thread's region as it is now (scope, torch's autocast state, open or not), to be
    entered again by a recomputation: a recomputed module's forward ran inside its own
    module scope and its parents', whose hooks do not run again in the backward."""
    return _Recompute(_ptls.scope, _torch_state(), _st.depth > 0)


def _torch_state():
    return tuple((_enabled(d), _get_dtype(d)) for d in _DEVICES)


def _set_torch_state(state):
    for d, (on, dtype) in zip(_DEVICES, state):
        torch.set_autocast_enabled(d, on)
        torch.set_autocast_dtype(d, dtype)


def _mode_on():
    stack = torch._C._get_function_stack_at
    return any(stack(i) is _MODE for i in range(torch._C._len_torch_function_stack()))


def _refresh(st):
    """Whether the mode has anything to do in this thread beyond policy changes."""
    sc = _ptls.scope
    st.plain = not (st.check_finite or (sc is not None and sc.ops)
                    or any(_FUSED[d] and _enabled(d) for d in _DEVICES))


def _push_if_needed(st):
    """Puts the mode on when this thread's region needs it and it is not on: for policy
    changes, scope ops, weight feeding or check_finite. Returns whether it did."""
    if (_policy.CHANGED or not st.plain) and not _mode_on():
        _push()
        return True
    return False


def _region_closed(st):
    if st.depth == 0:
        if st.cache:
            st.learned = order_of(st.cache)
        st.cache.clear()
        st.modules.clear()


# ---- scopes and module scopes: torch's state follows their dtype and enabled ----

def _scope_entered(merged, parent):
    saved = _torch_state()
    merged.base = base = parent.base if parent is not None and parent.base is not None else saved
    for d, (on, dtype) in zip(_DEVICES, base):
        if on:
            torch.set_autocast_enabled(d, bool(merged.enabled))
            torch.set_autocast_dtype(d, merged.dtype or dtype)
    _refresh(_st)
    return saved, _st.depth > 0 and _push_if_needed(_st)


def _scope_left(token):
    saved, pushed = token
    if pushed:
        _pop()
    _set_torch_state(saved)
    _refresh(_st)


def _cast_module_inputs(args, kwargs, dtype):
    """Forward pre-hook body of a module scope with a dtype: its inputs, cast (and its
    outputs, where the scope casts them)."""
    dev = _region_device(args, kwargs)
    if dev is None:
        return _cast_deferred(args, kwargs, dtype)
    return cast_args(args, kwargs, dtype, _ON_DEVICE[dev], _st)


def _is_deferred(t):
    return isinstance(t, _Tensor) and type(t) is not _Tensor and getattr(t, "_ampc_deferred", False)


def _cast_deferred(args, kwargs, dtype):
    """Logits a sliced head defers, cast as the plain logits would be in a region (a cast
    computes nothing: it is noted on them); None where there are none."""
    t = _first_tensor(args, kwargs)
    if not _is_deferred(t):
        return None
    dev = "cuda" if t.is_cuda else "cpu" if t.is_cpu else None
    if dev is None or not _enabled(dev):
        return None
    to = lambda x: x.to(dtype) if _is_deferred(x) and x.dtype is not dtype else x  # noqa: E731
    return map_tensors(to, args), map_tensors(to, kwargs)


_policy._cast_inputs_hook = _cast_module_inputs
_policy._scope_entered = _scope_entered
_policy._scope_left = _scope_left
_checkpoint.region_now = _region_now

# ---- the public API ----

_UNSET = object()


def _check_str(fn, device_type):
    if not isinstance(device_type, str):
        raise ValueError(f"ampc.{fn}: Expected `device_type` of type `str`, got: `{type(device_type)}`")


def _check_device_type(fn, device_type):
    _check_str(fn, device_type)
    if device_type not in _ON_DEVICE:
        try:
            known = torch.amp.is_autocast_available(device_type)
        except RuntimeError:      # not a device string at all
            known = False
        if known:
            raise RuntimeError(f"ampc.{fn}: device_type '{device_type}' is not supported by ampc "
                               "(it supports 'cpu' and 'cuda')")
        raise RuntimeError(f"ampc.{fn}: User specified an unsupported autocast device_type "
                           f"'{device_type}'")


class autocast:
    """A region where ops run in mixed precision: torch.autocast, plus ampc's policy
    registry, weight cache and overflow locator.

    ``ampc.autocast(device_type, dtype=None, enabled=True, cache_enabled=None)`` works as a
    context manager and as a decorator (a decorated function may call itself). The legacy
    ``torch.cuda.amp.autocast(enabled=True, dtype=torch.float16, cache_enabled=True)`` form
    is accepted too: leave out ``device_type`` (or pass ``enabled`` in its place). Inside,
    torch's own autocast state is on: ``torch.is_autocast_enabled`` reports the region, and a
    nested ``torch.autocast`` region takes effect.

    Args:
        device_type (str): 'cuda' or 'cpu'.
        dtype (torch.dtype): the lower precision: torch.float16 or torch.bfloat16 (or
            torch.float32 on CUDA, as torch allows). Default: :func:`get_autocast_dtype`
            (float16 on CUDA, bfloat16 on the CPU, or what an enclosing region set).
        enabled (bool): whether autocast is on in the region. Default: True.
        cache_enabled (bool): whether weights are cast once per region and cached.
            Default: :func:`is_autocast_cache_enabled` (True).
        check_finite (bool): the overflow locator: check each op's output and raise at
            the first one that turns finite inputs into inf or nan, naming the op and the
            module path. Slow; off by default (None: as the enclosing region).
    """

    def __init__(self, device_type: str | bool | None = None, dtype: torch.dtype | None = None,
                 enabled: bool = _UNSET, cache_enabled: bool | None = None, *,
                 check_finite: bool | None = None) -> None:
        if device_type is None or isinstance(device_type, bool):
            # torch.cuda.amp.autocast(enabled=True, dtype=torch.float16, cache_enabled=True)
            if isinstance(device_type, bool):
                if enabled is not _UNSET:
                    cache_enabled = enabled     # its third positional argument
                enabled = device_type
            device_type = "cuda"
            dtype = _FP16 if dtype is None else dtype
            cache_enabled = True if cache_enabled is None else cache_enabled
        enabled = True if enabled is _UNSET else bool(enabled)
        _check_device_type("autocast", device_type)
        if dtype is not None and not isinstance(dtype, torch.dtype):
            raise TypeError(f"ampc.autocast: dtype must be a torch.dtype, got {type(dtype).__name__}")
        self.device = device_type
        self.fast_dtype = _get_dtype(device_type) if dtype is None else dtype
        self._cache_enabled = _cache_on() if cache_enabled is None else bool(cache_enabled)
        self._check_finite = check_finite
        if enabled:
            supported = _SUPPORTED[device_type]
            if self.fast_dtype not in supported:
                dev = device_type.upper()
                raise RuntimeError(
                    f"ampc.autocast: In {dev} autocast, but the target dtype {self.fast_dtype} is "
                    f"not supported.\n{dev} Autocast only supports dtypes of "
                    + ", ".join(map(str, supported)) + " currently.")
            if device_type == "cuda":
                if not torch.cuda.is_available():
                    warnings.warn("CUDA is not available or torch_xla is imported. Disabling autocast.",
                                  stacklevel=2)
                    enabled = False
                elif self.fast_dtype is _BF16 and not torch.cuda.is_bf16_supported():
                    raise RuntimeError("Current CUDA Device does not support bfloat16. "
                                       "Please switch dtype to float16.")
        self._enabled = enabled

    def __enter__(self) -> "autocast":
        st, dev = _st, self.device
        st.saved.append((_enabled(dev), _get_dtype(dev), _cache_on(), st.check_finite))
        torch.set_autocast_enabled(dev, self._enabled)
        torch.set_autocast_dtype(dev, self.fast_dtype)
        torch.autocast_increment_nesting()
        torch.set_autocast_cache_enabled(self._cache_enabled)
        if self._check_finite is not None:
            st.check_finite = bool(self._check_finite)
        if st.depth == 0 and _overflow.armed is not None:    # the scaler asked: record
            st.recorder = _overflow.armed
            st.recorder.regions += 1
            st.check_finite = True
        st.depth += 1
        _refresh(st)
        st.pushed.append(_push_if_needed(st))
        if st.check_finite and not st.hooked:       # module paths for the overflow locator
            st.hooked = st.depth
            install_hooks(st)
        return self

    def __exit__(self, *exc: Any) -> bool:
        st, dev = _st, self.device
        if st.hooked == st.depth:
            st.hooked = 0
            remove_hooks()
        st.depth -= 1
        if st.depth == 0:
            st.recorder = None
        if st.pushed.pop():
            _pop()
        _region_closed(st)
        if torch.autocast_decrement_nesting() == 0:
            torch.clear_autocast_cache()
        on, dtype, cache, st.check_finite = st.saved.pop()
        torch.set_autocast_enabled(dev, on)
        torch.set_autocast_dtype(dev, dtype)
        torch.set_autocast_cache_enabled(cache)
        _refresh(st)
        return False

    def __call__(self, func: _F) -> _F:
        @functools.wraps(func)
        def decorate_autocast(*args, **kwargs):
            with self:      # the saved state lives on a per-thread stack, so this re-enters
                return func(*args, **kwargs)
        return decorate_autocast


def is_autocast_available(device_type: str) -> bool:
    """Whether ampc.autocast runs regions on ``device_type`` (torch.amp's function): torch's
    autocast has the device and ampc supports it ('cpu', 'cuda'). A string that is no device
    raises as torch's does."""
    return torch.amp.is_autocast_available(device_type) and device_type in _ON_DEVICE


def is_autocast_enabled(device_type: str = "cuda") -> bool:
    """Whether autocast (an ampc or a torch region) is on for ``device_type`` in this thread."""
    _check_device_type("is_autocast_enabled", device_type)
    return _enabled(device_type)


def get_autocast_dtype(device_type: str) -> torch.dtype:
    """The lower-precision dtype of ``device_type``'s autocast in this thread."""
    _check_device_type("get_autocast_dtype", device_type)
    return _get_dtype(device_type)


def set_autocast_dtype(device_type: str, dtype: torch.dtype) -> None:
    """Sets the dtype that later ``ampc.autocast(device_type)`` regions default to."""
    _check_device_type("set_autocast_dtype", device_type)
    if dtype not in _SUPPORTED[device_type]:
        raise ValueError(f"ampc.set_autocast_dtype: dtype must be one of "
                         f"{', '.join(map(str, _SUPPORTED[device_type]))} on {device_type}, got {dtype}")
    torch.set_autocast_dtype(device_type, dtype)


def is_autocast_cache_enabled() -> bool:
    return _cache_on()


def clear_autocast_cache() -> None:
    """Drops this thread's cached weight casts (ampc's and torch's)."""
    _st.cache.clear()
    torch.clear_autocast_cache()


def custom_fwd(fwd: Callable | None = None, *, device_type: str,
               cast_inputs: torch.dtype | None = None) -> Callable:
    """torch.amp.custom_fwd (ampc regions are torch regions): decorate an autograd.Function's
    forward. With ``cast_inputs`` set, inside an enabled region the forward runs with
    autocast off and its floating inputs cast to ``cast_inputs``."""
    _check_str("custom_fwd", device_type)
    return torch.amp.custom_fwd(fwd, device_type=device_type, cast_inputs=cast_inputs)


def custom_bwd(bwd: Callable | None = None, *, device_type: str) -> Callable:
    """torch.amp.custom_bwd: backward runs with the autocast state its forward saw."""
    _check_str("custom_bwd", device_type)
    return torch.amp.custom_bwd(bwd, device_type=device_type)
