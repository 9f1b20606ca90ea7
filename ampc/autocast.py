"""ampc.autocast: torch.autocast's semantics, driven by ampc's policy registry and cast kernels.

A region is a TorchFunctionMode: every torch function, Tensor method and torch.nn.functional
call made inside it comes to ``_Mode.__torch_function__``, which looks the call up in
ampc.policy (per device, under the current scope) and casts the eligible tensor arguments
(floating, not float64, on the region's device) before running it. The casts go through
ampc's multi-tensor cast kernel wrapped in an autograd.Function, above autograd as torch's
Autocast dispatch key is, so backward sees them and gradients reach fp32 leaves in fp32.

Weight cache: a leaf fp32 tensor that requires grad (a parameter) is cast once per
outermost region; the first time one of a module's parameters is needed, all of that
module's parameters are cast in one kernel call, and from a thread's second region on, all
the weights the previous region cast, in DDP-sized buckets. An in-place update of a weight
(its version counter moves) invalidates its cached copy.

State is thread-local (enabled and dtype per device, cache flag, nesting), as torch's is.
Reference: torch/amp/autocast_mode.py, aten/src/ATen/autocast_mode.cpp.
"""
import functools
import sys
import threading
import types
import warnings
import weakref

import torch
from torch.overrides import TorchFunctionMode

from . import _lib
from . import policy as _policy
from .policy import CastPolicy as P

_Tensor = torch.Tensor
_FP32, _FP16, _BF16 = torch.float32, torch.float16, torch.bfloat16
_LOW = (_FP16, _BF16)
_KERNEL_DTYPES = (_FP32, _FP16, _BF16)
_ELIGIBLE = frozenset(d for d in vars(torch).values()
                      if isinstance(d, torch.dtype) and d.is_floating_point and d is not torch.float64)
_ON_DEVICE = {"cpu": "is_cpu", "cuda": "is_cuda"}     # the Tensor property that says "on it"
_DEFAULT_DTYPE = {"cpu": _BF16, "cuda": _FP16}
_SUPPORTED = {"cpu": (_FP16, _BF16), "cuda": (_FP16, _BF16, _FP32)}   # as torch (CUDA takes fp32)


class _State(threading.local):
    """Per-thread autocast state; a new thread starts with autocast off, like torch's."""

    def __init__(self):
        self.enabled = {"cpu": False, "cuda": False}
        self.dtype = dict(_DEFAULT_DTYPE)
        self.cache_enabled = True
        self.check_finite = False
        self.nesting = 0          # all devices together, enabled=False regions too (torch's rule)
        self.saved = []           # one entry per open region: the state to restore on exit
        self.cache = {}           # (id(weight), dtype) -> (weight, version, cast)
        self.learned = {}         # the order the last region cast weights in (see _companions)
        self.modules = []         # with check_finite: modules whose forward is running
        self.hooked = 0           # nesting level that installed the module hooks, or 0
        self.lifting = set()      # Python composites running with the mode on (no re-entry)


_st = _State()
_ptls = _policy._tls

# ---- casts that autograd sees ----

_CAST_OP = torch.ops.ampc.cast.default
# the kernels' own dispatch keys: calls go straight to them, below the ADInplaceOrView guard
# of ampc.ops (the outputs are fresh, and _Cast does autograd's part)
_KERNEL_KEYS = {"cpu": torch._C.DispatchKeySet(torch._C.DispatchKey.CPU),
                "cuda": torch._C.DispatchKeySet(torch._C.DispatchKey.CUDA)}


def _dense(t):
    """(t or a permutation of t that is contiguous, the permutation that undoes it)."""
    if t.is_contiguous():
        return t, None
    order = sorted(range(t.dim()), key=lambda d: -t.stride(d))
    p = t.permute(order)
    if p.is_contiguous():
        return p, sorted(range(t.dim()), key=order.__getitem__)
    return t.contiguous(), None


def _kernel_device(t, dtype):
    """'cpu' or 'cuda' when ampc's kernel can cast plain tensor ``t`` to ``dtype``, else None."""
    if t.dtype not in _KERNEL_DTYPES or dtype not in _KERNEL_DTYPES or type(t) not in _PLAIN:
        return None
    if t.is_cpu:
        return "cpu"
    return "cuda" if t.is_cuda and _lib.HAS_CUDA_KERNELS else None


_PLAIN = (_Tensor, torch.nn.Parameter)


def _raw_cast(tensors, dtype):
    """Copies of ``tensors`` in ``dtype``, one ampc cast call per (dtype, device) group;
    not recorded by autograd. Others (fp8, other devices, subclasses) go through .to()."""
    first = tensors[0]
    if _kernel_device(first, dtype) == "cpu":     # the usual call (a bucket of weights): one pass
        src = first.dtype
        if all(type(t) in _PLAIN and t.dtype is src and t.is_cpu and t.is_contiguous() for t in tensors):
            dsts = [torch.empty_like(t, dtype=dtype) for t in tensors]
            _CAST_OP.redispatch(_KERNEL_KEYS["cpu"], dsts, tensors, [], False, 0)
            return dsts
    out = [None] * len(tensors)
    groups = {}
    for i, t in enumerate(tensors):
        dev = _kernel_device(t, dtype)
        if dev is None:
            out[i] = t.to(dtype)
        else:
            groups.setdefault((t.dtype, t.device), (dev, []))[1].append(i)
    for dev, idx in groups.values():
        srcs, dsts, undo = [], [], []
        for i in idx:
            src, u = _dense(tensors[i])
            srcs.append(src)
            dsts.append(torch.empty_like(src, dtype=dtype))
            undo.append(u)
        _CAST_OP.redispatch(_KERNEL_KEYS[dev], dsts, srcs, [], False, 0)
        for i, d, u in zip(idx, dsts, undo):
            out[i] = d if u is None else d.permute(u)
    return out


class _Cast(torch.autograd.Function):
    """Casts many tensors to one dtype in one kernel call; backward casts each gradient
    back to its input's dtype (again one call per dtype)."""

    @staticmethod
    def forward(ctx, dtype, *tensors):
        ctx.set_materialize_grads(False)
        ctx.dtypes = [t.dtype for t in tensors]
        out = tuple(_raw_cast(list(tensors), dtype))
        # a cast of a tensor that needs no grad needs none either (else backward would
        # compute the grad of, say, a model's input that joined the weights' call)
        ctx.mark_non_differentiable(*(o for o, t in zip(out, tensors) if not t.requires_grad))
        return out

    @staticmethod
    def backward(ctx, *grads):
        out = [None] * len(grads)
        by_dtype = {}
        for i, g in enumerate(grads):
            if g is not None:
                by_dtype.setdefault(ctx.dtypes[i], []).append(i)
        cast = cast_tensors if torch.is_grad_enabled() else _raw_cast   # on only for create_graph
        for dtype, idx in by_dtype.items():
            for i, g in zip(idx, cast([grads[i] for i in idx], dtype)):
                out[i] = g
        return (None, *out)


def cast_tensors(tensors, dtype):
    """Autograd-visible copies of ``tensors`` in ``dtype``, in as few kernel calls as possible."""
    if torch.compiler.is_compiling():
        return [t.to(dtype) for t in tensors]
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return list(_Cast.apply(dtype, *tensors))
    return _raw_cast(tensors, dtype)


# ---- the weight cache ----

def _is_weight(t):
    return t.dtype is _FP32 and t.requires_grad and t.is_leaf and not t._is_view()


def _cached(st, key, t):
    hit = st.cache.get(key)
    return hit[2] if hit is not None and hit[0] is t and hit[1] == t._version else None


def _cast_many(todo, dtype, st):
    """{id: cast} for the tensors in ``todo`` ({id: tensor}), with one kernel call for the
    ones not in the cache. A missing weight brings its module's other weights along."""
    out, fresh, weights = {}, [], []
    # no cache in inference mode (torch #158232) or while torch.compile traces (as torch)
    cache = st.cache if (dtype in _LOW and st.cache_enabled and not torch.is_inference_mode_enabled()
                         and not torch.compiler.is_compiling()) else None
    for k, t in todo.items():
        if cache is not None and t.requires_grad and t.is_leaf and t.dtype is _FP32 and not t._is_view():
            hit = cache.get((k, dtype))
            if hit is not None and hit[0] is t and hit[1] == t._version:
                out[k] = hit[2]
            else:
                weights.append(t)
        else:
            fresh.append(t)
    if not weights and not fresh:
        return out
    if weights:
        weights += _companions(st, weights, dtype)
    if weights and not torch.is_grad_enabled():
        # a cast made under no_grad must still carry a grad_fn when reused with grad on
        with torch.enable_grad():
            casts = cast_tensors(weights, dtype)
        casts = casts + (cast_tensors(fresh, dtype) if fresh else [])
    else:
        casts = cast_tensors(weights + fresh, dtype)
    for w, c in zip(weights, casts):
        st.cache[(id(w), dtype)] = (w, w._version, c)
        if id(w) in todo:
            out[id(w)] = c
    for t, c in zip(fresh, casts[len(weights):]):
        out[id(t)] = c
    return out


_BUCKET_BYTES = 25 << 20    # DDP's default bucket: its all-reduce waits for a whole bucket anyway


def _companions(st, weights, dtype):
    """The weights to cast in the same call as ``weights`` (which missed the cache): those
    the previous region cast after the first of them, up to _BUCKET_BYTES in all, so that a
    small model's weights go in one call and a large one's grads still come back bucket by
    bucket in backward; in a thread's first region, the other weights of the module whose
    forward is running."""
    first, seen = weights[0], {id(w) for w in weights}
    order, index = st.learned.get(dtype, ((), {}))
    i = index.get(id(first))
    if i is not None and order[i]() is first:
        candidates = (r() for r in order[i + 1:])
        budget = _BUCKET_BYTES - sum(w.numel() * w.element_size() for w in weights)
    else:
        owner = _owner(first)
        candidates = owner._parameters.values() if owner is not None else ()
        budget = None
    out = []
    for p in candidates:
        if (p is None or id(p) in seen or p.is_cpu != first.is_cpu or not _is_weight(p)
                or _cached(st, (id(p), dtype), p) is not None):
            continue
        if budget is not None:
            if budget <= 0:
                break
            budget -= p.numel() * p.element_size()
        out.append(p)
        seen.add(id(p))
    return out


def _order_of(cache):
    """{dtype: (weakrefs to the cached weights in the order they were cast, {id: position})}."""
    by_dtype = {}
    for (_, dtype), (w, _, _) in cache.items():
        by_dtype.setdefault(dtype, []).append(w)
    return {dt: ([weakref.ref(w) for w in ws], {id(w): i for i, w in enumerate(ws)})
            for dt, ws in by_dtype.items()}


def _owner(param, depth=12):
    """The module whose forward is running and owns ``param``, found by walking up the
    Python frames from here (only on a cache miss, so once per module per region);
    None when there is none: then the weight is cast alone."""
    f = sys._getframe(2)
    while f is not None and depth:
        mod = f.f_locals.get("self") if f.f_code.co_name == "forward" else None
        if isinstance(mod, torch.nn.Module) and any(p is param for p in mod._parameters.values()):
            return mod
        f, depth = f.f_back, depth - 1
    return None


# ---- argument walking ----

def _first_tensor(args, kwargs):
    for a in (*args, *kwargs.values()) if kwargs else args:
        if isinstance(a, _Tensor):
            return a
        if type(a) is list or type(a) is tuple:
            for x in a:
                if isinstance(x, _Tensor):
                    return x
    return None


def _eligible(args, kwargs, on, skip=None):
    """Every eligible tensor argument (top level and inside lists) not already in dtype
    ``skip``, by id."""
    found = {}
    for a in (*args, *kwargs.values()) if kwargs else args:
        if isinstance(a, _Tensor):
            if a.dtype is not skip and a.dtype in _ELIGIBLE and getattr(a, on):
                found[id(a)] = a
        elif type(a) is list or type(a) is tuple:
            for x in a:
                if isinstance(x, _Tensor) and x.dtype is not skip and x.dtype in _ELIGIBLE and getattr(x, on):
                    found[id(x)] = x
    return found


def _sub(a, casts):
    if isinstance(a, _Tensor):
        return casts.get(id(a), a)
    if type(a) is list or type(a) is tuple:
        return type(a)(casts.get(id(x), x) if isinstance(x, _Tensor) else x for x in a)
    return a


_NoSubclassTF = torch._C.DisableTorchFunctionSubclass


def _to(a, dtype, on):
    if isinstance(a, _Tensor):
        return a.to(dtype) if a.dtype is not dtype and a.dtype in _ELIGIBLE and getattr(a, on) else a
    if type(a) is list or type(a) is tuple:
        return type(a)(_to(x, dtype, on) for x in a)
    return a


def _cast_args(args, kwargs, dtype, on, st):
    if torch.compiler.is_compiling():     # plain .to() that Dynamo can trace; no cache (as torch)
        return tuple(_to(a, dtype, on) for a in args), {k: _to(v, dtype, on) for k, v in kwargs.items()}
    todo = _eligible(args, kwargs, on, dtype)
    if not todo:
        return args, kwargs
    # a method call on a Parameter (is_contiguous, _is_view, empty_like, Function.apply)
    # would go through its Python __torch_function__ (several us each); not needed here
    with _NoSubclassTF():
        casts = _cast_many(todo, dtype, st)
    return (tuple(_sub(a, casts) for a in args),
            {k: _sub(v, casts) for k, v in kwargs.items()} if kwargs else kwargs)


def _promote_type(args, kwargs, on, start):
    """torch's at::autocast::prioritize: the widest eligible dtype, fp32 over fp16/bf16."""
    cur = start
    for t in _eligible(args, kwargs, on).values():
        if cur is _FP32 or t.dtype is _FP32:
            cur = _FP32
        elif t.dtype is not cur:
            raise RuntimeError("Unexpected floating ScalarType in at::autocast::prioritize")
    return cur


# ---- Python composites: let the mode see the ops they call ----

def _no_dispatch(*args, **kwargs):
    return False


_PATCHED_GLOBALS = {}
_LIFTED = {}
_DISPATCH_CHECKS = ("has_torch_function", "has_torch_function_unary", "has_torch_function_variadic")


def _names(code):
    """Every name ``code`` and the code nested in it load (globals among them)."""
    names = set(code.co_names)
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            names |= _names(c)
    return names


def _lift(func):
    """(copy of Python function ``func`` whose own torch-function check says no, so the
    torch calls inside it come to the mode one by one, as torch autocasts the ops a
    composite calls; its module's globals; the copy's globals; the global names it uses),
    or None when ``func`` does not check that way."""
    entry = _LIFTED.get(func, False)
    if entry is not False:
        return entry
    entry = None
    g = getattr(func, "__globals__", None)
    if isinstance(func, types.FunctionType) and g is not None and any(n in g for n in _DISPATCH_CHECKS):
        patched = _PATCHED_GLOBALS.get(id(g))
        if patched is None:
            patched = _PATCHED_GLOBALS[id(g)] = {**g, **{n: _no_dispatch for n in _DISPATCH_CHECKS}}
        lifted = types.FunctionType(func.__code__, patched, func.__name__, func.__defaults__,
                                    func.__closure__)
        lifted.__kwdefaults__ = func.__kwdefaults__
        used = tuple(n for n in _names(func.__code__) if n in g and n not in _DISPATCH_CHECKS)
        entry = (lifted, g, patched, used)
    _LIFTED[func] = entry
    return entry


def _call_composite(func, args, kwargs, st):
    if torch.compiler.is_compiling():     # Dynamo inlines the function and shows us its calls
        return func(*args, **kwargs)
    entry = _lift(func) if st.enabled["cpu"] or st.enabled["cuda"] else None
    if entry is None or func in st.lifting:
        return func(*args, **kwargs)
    lifted, g, patched, used = entry
    if any(patched.get(n) is not g.get(n) for n in used):   # the module was patched since
        patched.update(g)
        patched.update({n: _no_dispatch for n in _DISPATCH_CHECKS})
    st.lifting.add(func)
    torch._C._push_on_torch_function_stack(_MODE)
    try:
        return lifted(*args, **kwargs)
    finally:
        torch._C._pop_torch_function_stack()
        st.lifting.discard(func)


# ---- the mode ----

_FUNCS = _policy.FUNCS
_FunctionType = types.FunctionType
_TORCH_LISTED = frozenset(_policy.DEFAULTS["cpu"]) | frozenset(_policy.DEFAULTS["cuda"])
# the policies as plain names: an Enum attribute read costs more than the comparison
(_LOWER, _TO_FP32, _SET_DTYPE, _APPEND_DTYPE, _PROMOTE, _BANNED, _KEEP_DTYPE, _PASS) = (
    P.LOWER_PRECISION_FP, P.FP32, P.FP32_SET_OPT_DTYPE, P.FP32_APPEND_DTYPE, P.PROMOTE, P.BANNED,
    P.FP32_KEEP_DTYPE, P.PASSTHROUGH)
_EFFECTIVE = _policy.EFFECTIVE
_UNSEEN = object()


def _learn(func):
    """The op name of a callable met for the first time (None: not in the registry)."""
    try:
        _FUNCS[func] = None
    except TypeError:   # unhashable: not an op
        pass
    return None


class _Mode(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = _FUNCS.get(func, _UNSEEN)
        if name is _UNSEEN:
            name = _learn(func)
        if kwargs is None:
            kwargs = {}
        st = _st
        if st.check_finite:
            return _checked(func, name, args, kwargs, st)
        if name is None and type(func) is not _FunctionType:   # most calls: not an op, not Python
            return func(*args, **kwargs)
        return _dispatch(func, name, args, kwargs, st)


_MODE = _Mode()


def _dispatch(func, name, args, kwargs, st):
    if name is None:                          # not in the registry: most calls end here
        if type(func) is types.FunctionType:
            return _call_composite(func, args, kwargs, st)
        return func(*args, **kwargs)
    t = _first_tensor(args, kwargs)
    dev = None if t is None else "cuda" if t.is_cuda else "cpu" if t.is_cpu else None
    if dev is None or not st.enabled[dev]:
        return func(*args, **kwargs)
    sc = _ptls.scope
    if sc is not None:
        if not sc.enabled:
            return func(*args, **kwargs)
        pol = sc.ops.get(name) or _EFFECTIVE[dev].get(name)
    else:
        pol = _EFFECTIVE[dev].get(name)
    if pol is None or pol is _PASS:
        # a Python function named like one of torch's listed ops (F.layer_norm) wraps that
        # op: unlisted here, it has nothing inside to autocast, so it is not followed
        if type(func) is types.FunctionType and name not in _TORCH_LISTED:
            return _call_composite(func, args, kwargs, st)
        return func(*args, **kwargs)
    if kwargs.get("out") is not None:         # out= calls are not autocast (Python wrappers pass out=None)
        return func(*args, **kwargs)
    dtype = (sc.dtype if sc is not None else None) or st.dtype[dev]
    on = _ON_DEVICE[dev]
    if pol is _LOWER:
        args, kwargs = _cast_args(args, kwargs, dtype, on, st)
    elif pol is _TO_FP32:
        args, kwargs = _cast_args(args, kwargs, _FP32, on, st)
    elif pol is _SET_DTYPE or pol is _APPEND_DTYPE:
        first = args[0] if args else kwargs.get("input")
        if (isinstance(first, _Tensor) and first.dtype in _ELIGIBLE and getattr(first, on)
                and kwargs.get("dtype") is None and not any(isinstance(a, torch.dtype) for a in args)):
            kwargs = {**kwargs, "dtype": _FP32}
    elif pol is _PROMOTE:
        args, kwargs = _cast_args(args, kwargs, _promote_type(args, kwargs, on, dtype), on, st)
    elif pol is _KEEP_DTYPE:
        first = next(iter(_eligible(args, kwargs, on).values()), None)
        args, kwargs = _cast_args(args, kwargs, _FP32, on, st)
        out = func(*args, **kwargs)
        return out if first is None or first.dtype is _FP32 else _outputs_to(out, first.dtype)
    elif pol is _BANNED:
        if name == "binary_cross_entropy":
            raise RuntimeError(_policy.BCE_MESSAGE)
        raise RuntimeError(f"ampc.autocast: {name} is banned under autocast by the policy "
                           f"registry (ampc.policy.get_policy({name!r}, {dev!r}))")
    return func(*args, **kwargs)


def _outputs_to(out, dtype):
    if isinstance(out, _Tensor):
        return cast_tensors([out], dtype)[0] if out.dtype is _FP32 else out
    if isinstance(out, tuple):
        return type(out)(_outputs_to(o, dtype) for o in out) if not hasattr(out, "_fields") \
            else type(out)(*(_outputs_to(o, dtype) for o in out))
    return out


# ---- the overflow locator ----

def _float_tensors(x):
    if isinstance(x, _Tensor):
        return [x] if x.is_floating_point() else []
    if isinstance(x, (list, tuple)):
        return [t for a in x for t in _float_tensors(a)]
    if isinstance(x, dict):
        return _float_tensors(list(x.values()))
    return []


def _finite(ts):
    return all(bool(torch.isfinite(t).all()) for t in ts if t.numel())


def module_path(mods):
    """'Net.blocks.2.attn' for a stack of nested modules, outermost first."""
    if not mods:
        return "<no module>"
    parts = [type(mods[0]).__name__]
    for parent, child in zip(mods, mods[1:]):
        parts.append(next((n for n, m in parent._modules.items() if m is child), type(child).__name__))
    return ".".join(parts)


def _checked(func, name, args, kwargs, st):
    out = _dispatch(func, name, args, kwargs, st)
    outs = _float_tensors(out)
    if outs and not _finite(outs) and _finite(_float_tensors((args, kwargs))):
        label = name or getattr(func, "__qualname__", None) or repr(func)
        bad = next(t for t in outs if not _finite([t]))
        raise FloatingPointError(
            f"ampc.autocast(check_finite=True): {label} returned a non-finite {bad.dtype} value "
            f"from finite inputs, in module {module_path(st.modules)}. In float16 this is "
            "usually an overflow past 65504: keep this op or module in float32 "
            "(ampc.policy.set_policy / module_scope) or switch to bfloat16.")
    return out


# ---- module tracking for the overflow locator: where an op ran ----

_hooks_lock = threading.Lock()
_hooks = []
_hook_users = 0


def _module_enter(module, args):
    if _st.nesting:
        _st.modules.append(module)


def _module_exit(module, args, out):
    mods = _st.modules
    if mods and mods[-1] is module:
        mods.pop()


def _install_hooks():
    global _hook_users
    with _hooks_lock:
        _hook_users += 1
        if _hook_users == 1:
            nn = torch.nn.modules.module
            _hooks.append(nn.register_module_forward_pre_hook(_module_enter))
            _hooks.append(nn.register_module_forward_hook(_module_exit, always_call=True))


def _remove_hooks():
    global _hook_users
    with _hooks_lock:
        _hook_users -= 1
        if _hook_users == 0:
            while _hooks:
                _hooks.pop().remove()


def _cast_module_inputs(args, kwargs, dtype):
    """Forward pre-hook body of a module scope with a dtype: its inputs, cast."""
    t = _first_tensor(args, kwargs)
    if not _st.nesting or t is None:
        return None
    dev = "cuda" if t.is_cuda else "cpu" if t.is_cpu else None
    if dev is None or not _st.enabled[dev]:
        return None
    return _cast_args(args, kwargs, dtype, _ON_DEVICE[dev], _st)


_policy._cast_inputs_hook = _cast_module_inputs

# ---- the public API ----

_UNSET = object()


def _check_device_type(fn, device_type):
    if not isinstance(device_type, str):
        raise ValueError(f"ampc.{fn}: Expected `device_type` of type `str`, got: `{type(device_type)}`")
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
    """A region where ops run in mixed precision, with torch.autocast's semantics.

    ``ampc.autocast(device_type, dtype=None, enabled=True, cache_enabled=None)`` works as a
    context manager and as a decorator (a decorated function may call itself). The legacy
    ``torch.cuda.amp.autocast(enabled=True, dtype=torch.float16, cache_enabled=True)`` form
    is accepted too: leave out ``device_type`` (or pass ``enabled`` in its place).

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

    def __init__(self, device_type=None, dtype=None, enabled=_UNSET, cache_enabled=None, *,
                 check_finite=None):
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
        self.fast_dtype = _st.dtype[device_type] if dtype is None else dtype
        self._cache_enabled = _st.cache_enabled if cache_enabled is None else bool(cache_enabled)
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

    def __enter__(self):
        st, dev = _st, self.device
        st.saved.append((dev, st.enabled[dev], st.dtype[dev], st.cache_enabled, st.check_finite))
        st.enabled[dev] = self._enabled
        st.dtype[dev] = self.fast_dtype
        st.cache_enabled = self._cache_enabled
        if self._check_finite is not None:
            st.check_finite = bool(self._check_finite)
        st.nesting += 1
        if st.nesting == 1:
            torch._C._push_on_torch_function_stack(_MODE)
        if st.check_finite and not st.hooked:       # module paths for the overflow locator
            st.hooked = st.nesting
            _install_hooks()
        return self

    def __exit__(self, *exc):
        st = _st
        if st.hooked == st.nesting:
            st.hooked = 0
            _remove_hooks()
        st.nesting -= 1
        if st.nesting == 0:
            if st.cache:
                st.learned = _order_of(st.cache)
            st.cache.clear()
            st.modules.clear()
            torch._C._pop_torch_function_stack()
        dev, st.enabled[dev], st.dtype[dev], st.cache_enabled, st.check_finite = st.saved.pop()
        return False

    def __call__(self, func):
        @functools.wraps(func)
        def decorate_autocast(*args, **kwargs):
            with self:      # the saved state lives on a per-thread stack, so this re-enters
                return func(*args, **kwargs)
        return decorate_autocast


def is_autocast_enabled(device_type="cuda"):
    """Whether an ampc.autocast region for ``device_type`` is on in this thread."""
    _check_device_type("is_autocast_enabled", device_type)
    return _st.enabled[device_type]


def get_autocast_dtype(device_type):
    """The lower-precision dtype of ``device_type``'s autocast in this thread."""
    _check_device_type("get_autocast_dtype", device_type)
    return _st.dtype[device_type]


def set_autocast_dtype(device_type, dtype):
    """Sets the dtype that later ``ampc.autocast(device_type)`` regions default to."""
    _check_device_type("set_autocast_dtype", device_type)
    if dtype not in _SUPPORTED[device_type]:
        raise ValueError(f"ampc.set_autocast_dtype: dtype must be one of "
                         f"{', '.join(map(str, _SUPPORTED[device_type]))} on {device_type}, got {dtype}")
    _st.dtype[device_type] = dtype


def is_autocast_cache_enabled():
    return _st.cache_enabled


def clear_autocast_cache():
    """Drops this thread's cached weight casts."""
    _st.cache.clear()


def _cast(value, device_type, dtype):
    """custom_fwd's input cast: floating tensors on ``device_type`` (not float64) to ``dtype``,
    through lists, tuples and dicts (keys too)."""
    if isinstance(value, _Tensor):
        ok = value.is_floating_point() and value.dtype is not torch.float64 \
            and value.device.type == device_type and value.dtype is not dtype
        return cast_tensors([value], dtype)[0] if ok else value
    if isinstance(value, (str, bytes)) or type(value).__module__ == "numpy":
        return value
    if isinstance(value, dict):
        return {_cast(k, device_type, dtype): _cast(v, device_type, dtype) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_cast(v, device_type, dtype) for v in value)
    return value


def custom_fwd(fwd=None, *, device_type, cast_inputs=None):
    """torch.amp.custom_fwd for ampc regions: decorate an autograd.Function's forward.
    With ``cast_inputs`` set, inside an enabled region the forward runs with autocast off
    and its floating inputs cast to ``cast_inputs``; otherwise it runs as the region says."""
    if not isinstance(device_type, str):
        raise ValueError(f"ampc.custom_fwd: Expected `device_type` of type `str`, got: `{type(device_type)}`")
    if fwd is None:
        return functools.partial(custom_fwd, device_type=device_type, cast_inputs=cast_inputs)

    @functools.wraps(fwd)
    def decorate_fwd(*args, **kwargs):
        ctx = args[0]
        ctx._dtype = get_autocast_dtype(device_type)
        if cast_inputs is None:
            ctx._fwd_used_autocast = is_autocast_enabled(device_type)
            return fwd(*args, **kwargs)
        ctx._fwd_used_autocast = False
        if is_autocast_enabled(device_type):
            with autocast(device_type=device_type, enabled=False):
                return fwd(*_cast(args, device_type, cast_inputs),
                           **_cast(kwargs, device_type, cast_inputs))
        return fwd(*args, **kwargs)
    return decorate_fwd


def custom_bwd(bwd=None, *, device_type):
    """torch.amp.custom_bwd for ampc regions: backward runs with the autocast state its
    forward saw."""
    if not isinstance(device_type, str):
        raise ValueError(f"ampc.custom_bwd: Expected `device_type` of type `str`, got: `{type(device_type)}`")
    if bwd is None:
        return functools.partial(custom_bwd, device_type=device_type)

    @functools.wraps(bwd)
    def decorate_bwd(*args, **kwargs):
        ctx = args[0]
        with autocast(device_type=device_type, enabled=ctx._fwd_used_autocast, dtype=ctx._dtype):
            return bwd(*args, **kwargs)
    return decorate_bwd
