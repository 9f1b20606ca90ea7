"""Modules whose saved activations are kept in fewer bits until the backward needs them.

Inside each chosen module's forward, autograd's saved-tensor hooks take every tensor the
module saves for its backward and keep, instead of it:
  "8bit"  one byte an element and one fp32 scale a block of 256 (``ampc.ops.encode_q8``:
          a sign and 4 exponent and 3 mantissa bits under the block's largest value,
          about 3% relative error), decoded back to the tensor's dtype in the backward;
  "bf16"  a bfloat16 copy of an fp32 tensor (16-bit ones are kept as they are).
Left as they are: tensors the code cannot hold exactly (any value not finite, such as an
attention mask's -inf, or, for "bf16", past bf16's range, such as a mask's finfo.min), the
module's parameters and buffers, tensors of a parameter's shape in
any order of its dimensions that are views of a parameter or of another dtype (the 16-bit
copies autocast makes of the weights, saved transposed: an error there is an error in every
input gradient), tensors under ``min_numel`` elements, and non-float ones. A storage saved twice
in one forward (several views of one tensor) is coded once.

The gradients are those of the module run on the decoded values: the error is what the
codes lose, measured by ``ampc.autoprecision`` like any other choice. An in-place change to
a saved tensor after the forward raises torch's error while the tensor is alive (a tensor
freed since cannot be checked: autograd does not check the version of what a hook packed).
A double backward (``create_graph=True``) through such a module is refused: the decoded
values carry no graph.
"""
from __future__ import annotations

import weakref
from collections.abc import Iterable

import torch

from .. import ops
from ._recompute import ModuleHandle, _find_modules, marked
from ._saved import note_held

_ATTR = "_ampc_saved_as"    # on a wrapped module: (its handle, the forward it had before, how)
HOWS = ("8bit", "bf16")
MIN_NUMEL = 4096


class Compress(ModuleHandle):
    """What :func:`compress` returns: ``remove()`` (or the end of a ``with`` block) makes
    the modules save as they did."""
    _attr = _ATTR

    def __init__(self, names: list[str], modules: list[torch.nn.Module], how: str):
        super().__init__(names, modules)
        self.how = how

    def __repr__(self):
        return f"ampc.memory.Compress({self.names}, how={self.how!r})"


def compressed(model: torch.nn.Module) -> dict[str, str]:
    """{module name: how} of the modules of ``model`` whose saved activations are kept in
    fewer bits."""
    return {n: mark[2] for n, mark in marked(model, _ATTR).items()}


def compress(model: torch.nn.Module, modules: str | torch.nn.Module | Iterable,
             how: str = "8bit", *, min_numel: int = MIN_NUMEL) -> Compress:
    """Makes ``modules`` of ``model`` keep what they save for the backward in fewer bits
    (see the module's docstring): ``how`` "8bit" (a byte an element) or "bf16" (fp32
    tensors as bfloat16).

    Args:
        model (nn.Module): the model.
        modules: a qualified module name (shell-style patterns match several, ``*`` within
            one dotted part: ``"transformer.h.*.mlp"``), a module of ``model``, or a list.
        how (str): "8bit" or "bf16".
        min_numel (int): tensors with fewer elements are kept as they are.

    Returns:
        :class:`Compress`: ``.remove()`` undoes it; usable as a context manager.
    """
    where = "ampc.memory.compress"
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"{where}: model is {type(model).__name__}, expected a torch.nn.Module")
    if how not in HOWS:
        raise ValueError(f"{where}: how must be one of {', '.join(HOWS)}, got {how!r}")
    if isinstance(min_numel, bool) or not isinstance(min_numel, int) or min_numel < 1:
        raise ValueError(f"{where}: min_numel must be an int >= 1, got {min_numel!r}")
    chosen, names = _find_modules(where, model, modules, _ATTR, "keeps its saved tensors "
                                  "in fewer bits already")
    handle = Compress(names, chosen, how)
    handle.wrap(_compressed_forward, how, min_numel)
    return handle


def _compressed_forward(module, *args, **kwargs):
    # a module-level function bound by functools.partial (a deepcopy of the model then
    # calls its own module, and pickle can save it)
    _, before, how, min_numel = module.__dict__[_ATTR]
    inner = before if before is not None else type(module).forward.__get__(module)
    if not torch.is_grad_enabled():
        return inner(*args, **kwargs)
    packer = _Packer(module, how, min_numel)
    with torch.autograd.graph.saved_tensors_hooks(packer.pack, packer.unpack):
        return inner(*args, **kwargs)


class _Packer:
    """The hooks of one forward of one module."""

    def __init__(self, module, how, min_numel):
        self.module = module
        self.buffers = {id(t) for t in module.buffers()}     # parameters: by their type
        # a parameter's shape in any order of its dims, in another dtype (autocast's copy
        # of a weight, saved transposed by a Linear) or on the parameter's storage (a view):
        # an activation of a weight's shape by chance (1024 tokens of 256 before a
        # Linear(256, 1024)) is coded
        self.shapes = {}
        self.params = set()
        for p in module.parameters():
            self.shapes.setdefault(tuple(sorted(p.shape)), set()).add(p.dtype)
            self.params.add(id(p))
        self.name = type(module).__name__
        self.how = how
        self.min_numel = min_numel
        self.seen = {}      # storage, offset, shape, strides, dtype -> (what was kept, the tensor)
        self.spans = {}     # storage -> _Span of its views with gaps

    def keep_as_is(self, t):
        return (type(t) is not torch.Tensor or id(t) in self.buffers
                or not t.is_floating_point() or t.numel() < self.min_numel
                or t.layout != torch.strided or self.weight_like(t)
                or (self.how == "bf16" and t.dtype != torch.float32))

    def weight_like(self, t):
        dtypes = self.shapes.get(tuple(sorted(t.shape)))
        return dtypes is not None and (t.dtype not in dtypes or id(t._base) in self.params)

    # run as Python, not traced: whether a tensor can be coded is decided on its values
    @torch.compiler.disable
    def pack(self, t):
        if self.keep_as_is(t):
            return t
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(),
               t.dtype)
        ref = weakref.ref(t)
        kept, first = self.seen.get(key, (None, None))
        # the same storage only while the tensor first seen there lives: once it is freed,
        # a later tensor of the forward may take its address
        if kept is None or first() is None:
            data = _code(t.contiguous(), self.how)
            kept = _AS_IS if data is None else _Kept(data, t.dtype, self.how,
                                                     self.layout(t, key, ref))
            self.seen[key] = (kept, ref)
            if data is not None:
                note_held(self.module, data)  # what it keeps, counted as its saved activations
        if kept is _AS_IS:
            return t
        # the tensor, weakly, and its version: a change in place while it lives is caught
        return (kept, ref, t._version)

    def layout(self, t, key, ref):
        """How ``t`` comes back: None (contiguous), or (strides, span, its offset in the
        span). A compiled backward checks the strides of what it saved; views with gaps of
        one storage (attention's q, k and v of one qkv output) share one decoded span, so
        that together they take the bytes they took in the forward."""
        if t.is_contiguous() or not _apart(t):
            return None
        if _apart(t, gaps=False):
            return t.stride(), None, 0
        span = self.spans.get(key[0])
        if span is None or span.first() is None:
            span = self.spans[key[0]] = _Span(ref)
        start = t.storage_offset()
        span.cover(start, start + 1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride())))
        return t.stride(), span, start

    def unpack(self, packed):
        if isinstance(packed, torch.Tensor):
            return packed
        kept, ref, version = packed
        if torch.is_grad_enabled():
            raise RuntimeError(
                f"ampc.memory: a double backward (create_graph=True) through a {self.name} "
                f"whose saved tensors are kept in {self.how}: the decoded values carry no graph; "
                "remove() its ampc.memory.compress handle for this backward")
        t = ref()
        if t is not None and t._version != version:
            raise RuntimeError(
                "one of the variables needed for gradient computation has been modified by an "
                f"inplace operation: [{t.type()} {list(t.shape)}] is at version {t._version}; "
                f"expected version {version} instead (a tensor a {self.name} saved, kept in "
                f"{self.how} by ampc.memory)")
        return kept.value()


_AS_IS = object()     # seen: a tensor the code could not keep exactly, saved as it is


def _code(x, how):
    """``x`` coded as ``how``, or None where the code cannot hold it: a value that is not
    finite (an attention mask's -inf makes its whole 8-bit block NaN), or an fp32 value past
    bf16's range (a mask's finfo.min becomes -inf in bf16). One pass over the small side
    (the block scales, or the bf16 copy); on CUDA it waits for the check."""
    with torch.no_grad():
        if how == "8bit":
            codes, scales = ops.encode_q8([x])
            # a block's scale is its absmax: not finite exactly where a value is not
            return (codes[0], scales[0]) if bool(torch.isfinite(scales[0]).all()) else None
        data = x.to(torch.bfloat16)
        return data if bool(torch.isfinite(data).all()) else None


def _apart(t, gaps=True):
    """Whether no two of ``t``'s elements share an address (with ``gaps=False``: and they
    fill their span, a contiguous layout with the dims in some order)."""
    expected = 1
    for stride, size in sorted((st, n) for n, st in zip(t.shape, t.stride()) if n != 1):
        if stride < expected or (stride != expected and not gaps):
            return False
        expected = stride * size
    return True


class _Span:
    """The elements [lo, hi) of one storage that its saved views with gaps cover; decoded,
    they share one buffer while it lives."""

    def __init__(self, first):
        self.first, self.lo, self.hi = first, None, None
        self.storage, self.dtype = None, None   # the decoded buffer's, weakly: while it lives

    def cover(self, lo, hi):
        self.lo = lo if self.lo is None else min(self.lo, lo)
        self.hi = hi if self.hi is None else max(self.hi, hi)

    def view(self, like, stride, start):
        # the storage, not a tensor, is what the views a backward receives keep alive
        store = self.storage() if self.storage is not None else None
        if store is None or self.dtype != like.dtype or store.device != like.device:
            store = torch.empty(self.hi - self.lo, dtype=like.dtype,
                                device=like.device).untyped_storage()
            self.storage, self.dtype = weakref.ref(store), like.dtype
        out = torch.empty(0, dtype=like.dtype, device=like.device)
        return out.set_(store, start - self.lo, like.shape, stride)


class _Kept:
    """A saved tensor in fewer bits, decoded on demand, with the strides it was saved with
    (``_Packer.layout``)."""
    __slots__ = ("data", "dtype", "how", "layout")

    def __init__(self, data, dtype, how, layout=None):
        self.data, self.dtype, self.how, self.layout = data, dtype, how, layout

    def value(self):
        if self.how == "8bit":
            codes, scales = self.data
            v = ops.decode_q8([codes], [scales], self.dtype)[0]
        else:
            v = self.data.to(self.dtype)
        if self.layout is None:
            return v
        stride, span, start = self.layout
        out = (torch.empty_strided(v.shape, stride, dtype=v.dtype, device=v.device)
               if span is None else span.view(v, stride, start))
        return out.copy_(v)
