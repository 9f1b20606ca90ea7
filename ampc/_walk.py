"""One walk over nested arguments: tensors inside lists, tuples, namedtuples and dicts.

Autocast's casts and overflow checks (ampc/amp/) and ``prepare``'s casts of a model's inputs
and outputs (master.py) need the same thing: apply a function to every tensor of a nested
value and get the same structure back. Strings,
numbers and other objects pass through untouched; a namedtuple is rebuilt with its fields by
position (its constructor takes no iterable); a dict keeps its keys. Structures are rebuilt
only when a tensor inside them changed, so the common case (nothing to do) allocates nothing.
"""
import torch

_Tensor = torch.Tensor


def map_tensors(fn, value):
    """``value`` with every tensor ``t`` inside it replaced by ``fn(t)``."""
    if isinstance(value, _Tensor):
        return fn(value)
    if isinstance(value, (list, tuple)):
        items = [map_tensors(fn, v) for v in value]
        if all(a is b for a, b in zip(items, value)):
            return value
        if isinstance(value, tuple):
            return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
        return type(value)(items)
    if isinstance(value, dict):
        items = {k: map_tensors(fn, v) for k, v in value.items()}
        if all(items[k] is v for k, v in value.items()):
            return value
        out = value.copy()      # keeps a dict subclass (OrderedDict, defaultdict) and its extras
        for k, v in items.items():
            out[k] = v          # item by item: a transformers ModelOutput refuses update()
        return out
    return value


def tensors(value):
    """Every tensor inside ``value``, depth first."""
    if isinstance(value, _Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in tensors(v)]
    return []
