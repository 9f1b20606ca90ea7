"""The weight cache: each weight cast once per region, many weights per kernel call.

torch's autocast caches the cast of every leaf fp32 tensor that requires grad, one cast (and
one autograd node) per weight. ampc casts in buckets instead: the first time one of a
module's weights is needed, all of that module's weights are cast in one kernel call, and
from a thread's second region on, all the weights the previous region cast, in the order it
cast them, up to 25 MB per call (DDP's bucket size, so that backward still hands gradients
back bucket by bucket). An in-place update of a weight moves its version counter, which
invalidates its cached copy. A weight whose storage is freed (FSDP2 between uses) is never
cached nor taken along: it is left to the op, which casts it when it is used.

Where it is used (``FUSED``): on CUDA, where one multi-tensor launch per bucket replaces one
cast launch per weight, forward and backward. On the CPU a cast call costs about the same per
tensor either way, so the cache's Python autograd node and bookkeeping (about 150 us per step)
only add: there the weights are left to torch's own cache, which casts them to the same bits.
"""
import sys
import weakref

import torch

from ._casts import cast_tensors, has_data

_FP32 = torch.float32
FUSED = {"cpu": False, "cuda": True}    # per device: whether autocast feeds weights from here
_BUCKET_BYTES = 25 << 20    # DDP's default bucket: its all-reduce waits for a whole bucket anyway


def is_weight(t):
    """A tensor the cache takes: a leaf fp32 tensor that requires grad, not a view, with data."""
    return t.dtype is _FP32 and t.requires_grad and t.is_leaf and not t._is_view() and has_data(t)


def _cached(cache, key, t):
    hit = cache.get(key)
    return hit[2] if hit is not None and hit[0] is t and hit[1] == t._version else None


def cast_weights(weights, dtype, st):
    """{id: cast} for the weights in ``weights`` ({id: weight}), from the cache or from one
    kernel call for those it lacks. A missing weight brings its companions along."""
    out, missing = {}, []
    cache = st.cache
    for k, w in weights.items():
        hit = _cached(cache, (k, dtype), w)
        if hit is not None:
            out[k] = hit
        else:
            missing.append(w)
    if not missing:
        return out
    missing += _companions(st, missing, dtype)
    with torch.enable_grad():    # a cast made under no_grad must still carry a grad_fn when reused
        casts = cast_tensors(missing, dtype)
    for w, c in zip(missing, casts):
        cache[(id(w), dtype)] = (w, w._version, c)
        if id(w) in weights:
            out[id(w)] = c
    return out


def _companions(st, weights, dtype):
    """The weights to cast in the same call as ``weights`` (which missed the cache): those
    the previous region cast after the first of them, up to _BUCKET_BYTES in all; in a
    thread's first region, the other weights of the module whose forward is running."""
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
        if (p is None or id(p) in seen or p.is_cpu is not first.is_cpu or not is_weight(p)
                or _cached(st.cache, (id(p), dtype), p) is not None):
            continue
        if budget is not None:
            if budget <= 0:
                break
            budget -= p.numel() * p.element_size()
        out.append(p)
        seen.add(id(p))
    return out


def order_of(cache):
    """{dtype: (weakrefs to the cached weights in the order they were cast, {id: position})}."""
    by_dtype = {}
    for (_, dtype), (w, _, _) in cache.items():
        by_dtype.setdefault(dtype, []).append(w)
    return {dt: ([weakref.ref(w) for w in ws], {id(w): i for i, w in enumerate(ws)})
            for dt, ws in by_dtype.items()}


def _owner(param, depth=14):
    """The module whose forward is running and owns ``param``, found by walking up the
    Python frames (only on a cache miss, so once per module per region); None when there
    is none: then the weight is cast alone."""
    f = sys._getframe(2)
    while f is not None and depth:
        mod = f.f_locals.get("self") if f.f_code.co_name == "forward" else None
        if isinstance(mod, torch.nn.Module) and any(p is param for p in mod._parameters.values()):
            return mod
        f, depth = f.f_back, depth - 1
    return None
