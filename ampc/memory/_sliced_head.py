"""A head whose logits are made only inside the loss, a slice of tokens at a time.

``sliced_head(model, "lm_head")`` makes a Linear head return its logits deferred: a tensor of
the logits' shape and dtype that holds only the head's input. Reshaping it over its leading
dimensions (flatten, view, reshape), slicing those, or casting it (``float()``, ``to(dtype)``)
is done on that input, and ``F.cross_entropy`` of it is :func:`linear_cross_entropy`: the
whole logits, their fp32 copy and the log-softmax never exist, and the model's code and the
loss function stay as they are (a transformers model's own loss included). Anything else
done with them (a softmax, an argmax for an accuracy, indexing into the vocabulary) makes the
logits whole, as the plain head would have, and warns once per head: correct, not smaller.
Without gradients (evaluation) the head is plain.
"""
from __future__ import annotations

import warnings
import weakref
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch.utils._pytree import tree_map

from ._head_loss import linear_cross_entropy
from ._recompute import ModuleHandle, _find_modules, marked

_WARNED = weakref.WeakSet()   # heads whose logits were made whole once (warned then)
_ATTR = "_ampc_sliced_head"   # on a head: (its handle, the forward it had before, chunk_tokens)
_WHO = "ampc.memory.sliced_head"

# what reads only the tensor's metadata: answered without making the logits
_META = {getattr(torch.Tensor, a) for a in (
    "dim", "size", "numel", "is_floating_point", "is_complex", "element_size", "__len__",
    "stride", "is_contiguous")} | {getattr(torch.Tensor, a).__get__ for a in (
        "shape", "dtype", "device", "ndim", "requires_grad", "is_leaf", "layout", "is_cuda",
        "is_cpu", "is_meta", "is_mps", "is_sparse", "is_quantized", "is_nested", "itemsize")}


class SlicedHead(ModuleHandle):
    """What :func:`sliced_head` returns: ``remove()`` (or the end of a ``with`` block) makes
    the heads return their logits whole again."""
    _attr = _ATTR


def sliced_heads(model: torch.nn.Module) -> list[str]:
    """Names of the modules of ``model`` whose logits are deferred to the loss."""
    return list(marked(model, _ATTR))


def sliced_head(model: torch.nn.Module, modules: str | torch.nn.Module | Iterable, *,
                chunk_tokens: int | None = None) -> SlicedHead:
    """Makes the Linear ``modules`` of ``model`` defer their logits to the loss (see the
    module's docstring): ``F.cross_entropy`` of them is computed a slice of
    ``chunk_tokens`` tokens at a time (None: a slice's fp32 logits about 4 MiB, or
    min(hidden size, 512, a quarter of the tokens) where that is more), in the dtype the
    head would have computed in (its autocast or scope).

    Returns:
        :class:`SlicedHead`: ``.remove()`` undoes it; usable as a context manager.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"{_WHO}: model is {type(model).__name__}, expected a torch.nn.Module")
    if chunk_tokens is not None and (isinstance(chunk_tokens, bool) or
                                     not isinstance(chunk_tokens, int) or chunk_tokens < 1):
        raise ValueError(f"{_WHO}: chunk_tokens must be None or an int >= 1, got {chunk_tokens!r}")
    chosen, names = _find_modules(_WHO, model, modules, _ATTR, "defers its logits already")
    for m, n in zip(chosen, names):
        if type(m) is not torch.nn.Linear:    # an fp8.Linear computes another way
            cls = type(m)
            raise TypeError(f"{_WHO}: {n!r} is {cls.__module__}.{cls.__qualname__}, not "
                            "torch.nn.Linear; only a torch.nn.Linear head can defer its logits "
                            "(an fp8 Linear computes another way)")
    handle = SlicedHead(names, chosen)
    handle.wrap(_sliced_forward, chunk_tokens)
    return handle


def _sliced_forward(module, hidden):
    if not torch.is_grad_enabled() or not isinstance(hidden, torch.Tensor):
        return F.linear(hidden, module.weight, module.bias)
    # the dtype the plain head computes in here (autocast, a policy scope): one row tells
    probe = F.linear(hidden.reshape(-1, hidden.shape[-1])[:1].detach(), module.weight.detach(),
                     None if module.bias is None else module.bias.detach())
    return DeferredLogits(hidden, module, probe.dtype, probe.dtype, module.__dict__[_ATTR][2])


class DeferredLogits(torch.Tensor):
    """The logits of ``head`` on ``hidden``, not computed: see the module's docstring.
    ``compute`` is the dtype the head's matmul runs in, the tensor's own dtype what it was
    cast to since."""
    _ampc_deferred = True       # ampc.autocast leaves its ops to __torch_function__ below

    @staticmethod
    def __new__(cls, hidden, head, compute, dtype, chunk=None):
        shape = (*hidden.shape[:-1], head.out_features)
        return torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device=hidden.device,
                                                   requires_grad=False)

    def __init__(self, hidden, head, compute, dtype, chunk=None):
        self.hidden, self.head, self.compute, self.chunk = hidden, head, compute, chunk

    def __repr__(self):
        return (f"DeferredLogits(shape={tuple(self.shape)}, dtype={self.dtype}, made in "
                f"F.cross_entropy by ampc.memory.sliced_head)")

    def _like(self, hidden, dtype=None):
        return DeferredLogits(hidden, self.head, self.compute, dtype or self.dtype, self.chunk)

    def whole(self):
        """The logits made whole, as the plain head would have made them."""
        h, w, b = self.hidden, self.head.weight, self.head.bias
        with torch.autocast(h.device.type, enabled=False):
            out = F.linear(h.to(self.compute), w.to(self.compute),
                           None if b is None else b.to(self.compute))
        return out.to(self.dtype)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _META:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        me = args[0] if args and isinstance(args[0], DeferredLogits) else None
        done = _on_hidden(me, func, args[1:], kwargs) if me is not None else None
        if done is None and func is F.cross_entropy:
            done = _cross_entropy(*args, **kwargs)
        if done is not None:
            return done
        for head in {a.head for a in _deferred((args, kwargs))}:
            if head not in _WARNED:
                _WARNED.add(head)
                warnings.warn(f"{_WHO}: {getattr(func, '__name__', func)} needs the whole logits "
                              "of a sliced head: they were made whole (as without it), no "
                              "memory saved there; F.cross_entropy over a view of the tokens "
                              "keeps them sliced", stacklevel=3)
        args, kwargs = tree_map(lambda a: a.whole() if isinstance(a, DeferredLogits) else a,
                                (args, kwargs))
        return func(*args, **kwargs)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise RuntimeError(f"{_WHO}: {func} reached deferred logits below autograd; make them "
                           "whole first (.whole())")


def _deferred(value):
    out = []
    tree_map(lambda a: out.append(a) if isinstance(a, DeferredLogits) else None, value)
    return out


def _on_hidden(me, func, rest, kwargs):
    """``func`` applied to the head's input instead, where it only touches the leading
    dimensions or casts; None where it does not."""
    nd, vocab = me.dim(), me.shape[-1]
    if func in (torch.Tensor.contiguous, torch.Tensor.detach) and not rest and not kwargs:
        return me if func is torch.Tensor.contiguous else None
    if func in (torch.Tensor.float, torch.Tensor.half, torch.Tensor.bfloat16) and not rest:
        to = {torch.Tensor.float: torch.float32, torch.Tensor.half: torch.float16,
              torch.Tensor.bfloat16: torch.bfloat16}[func]
        return me._like(me.hidden, to)
    if func is torch.Tensor.to:
        dtypes = [a for a in (*rest, *kwargs.values()) if isinstance(a, torch.dtype)]
        others = [a for a in rest if not isinstance(a, torch.dtype)]
        if len(dtypes) == 1 and not others and set(kwargs) <= {"dtype"}:
            return me._like(me.hidden, dtypes[0])
        return None
    if func in (torch.Tensor.flatten, torch.flatten):
        start = kwargs.get("start_dim", rest[0] if rest else 0)
        end = kwargs.get("end_dim", rest[1] if len(rest) > 1 else -1)
        if end % nd == nd - 1:
            return None                             # it would merge the vocabulary in
        return me._like(me.hidden.flatten(start % nd, end % nd))
    if func in (torch.Tensor.reshape, torch.Tensor.view, torch.reshape):
        shape = rest[0] if len(rest) == 1 and isinstance(rest[0], (tuple, list)) else rest
        shape = kwargs.get("shape", shape)
        if not shape or shape[-1] != vocab or any(isinstance(s, torch.dtype) for s in shape):
            return None
        return me._like(me.hidden.reshape(*shape[:-1], me.hidden.shape[-1]))
    if func is torch.Tensor.__getitem__ and len(rest) == 1:
        idx = rest[0] if isinstance(rest[0], tuple) else (rest[0],)
        if any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in idx):
            return None
        if any(i is None for i in idx):
            return None
        whole_last = idx[-1] == slice(None) if idx and not isinstance(idx[-1], torch.Tensor) \
            else False
        # the vocabulary (last) dimension untouched: the index reaches it only as ":"
        leading = whole_last if Ellipsis in idx else (len(idx) < nd or
                                                       (len(idx) == nd and whole_last))
        return me._like(me.hidden[idx]) if leading else None
    return None


def _cross_entropy(input, target, weight=None, size_average=None, ignore_index=-100,
                   reduce=None, reduction="mean", label_smoothing=0.0):
    """F.cross_entropy of deferred logits (N, vocab) against classes (N,), sliced; None where
    its arguments need the whole logits."""
    if not isinstance(input, DeferredLogits) or input.dim() != 2 or weight is not None or \
            size_average is not None or reduce is not None or label_smoothing != 0.0 or \
            reduction not in ("mean", "sum") or not isinstance(target, torch.Tensor) or \
            target.dim() != 1 or target.is_floating_point():
        return None
    head, c = input.head, input.compute
    with torch.autocast(input.hidden.device.type, enabled=False):
        loss = linear_cross_entropy(input.hidden.to(c), head.weight.to(c), target,
                                    None if head.bias is None else head.bias.to(c),
                                    ignore_index=ignore_index, reduction=reduction,
                                    chunk_tokens=input.chunk)
    return loss.to(_loss_dtype(input))


def _loss_dtype(input):
    """The dtype F.cross_entropy returns here for logits of ``input``'s dtype: fp32 under an
    autocast (torch's and ampc's run the loss in fp32), the logits' own dtype outside one.
    Asked of the loss itself on two logits, so that any policy in force answers."""
    two = torch.zeros(1, 2, dtype=input.dtype, device=input.device)
    return F.cross_entropy(two, torch.zeros(1, dtype=torch.long, device=input.device)).dtype
