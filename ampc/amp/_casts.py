"""Casts that autograd sees, through ampc's multi-tensor cast kernel.

A Python ``autograd.Function`` casts many tensors in one kernel call and casts each gradient
back to its input's dtype in backward, so gradients reach fp32 leaves in fp32. Each node
costs tens of microseconds of Python per step, against a few for torch's C++ cast node; so
autocast uses it only for the weight cache (one node per bucket of weights) and for ops whose
ampc policy differs from torch's lists. Calls go straight to the kernel's dispatch key
(``ops.cast_new``): the outputs are fresh tensors and ``_Cast`` does autograd's part.

A tensor whose storage is not allocated (numel > 0, no data: FSDP2 frees unsharded parameters
between uses) never reaches the kernel: it goes through ``.to()``, which raises torch's clear
error instead of reading address 0.
"""
import torch

from .. import _lib, ops

_Tensor = torch.Tensor
_KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_PLAIN = (_Tensor, torch.nn.Parameter)


def has_data(t):
    """False for a tensor with elements but no allocated storage."""
    return t.numel() == 0 or t.untyped_storage().data_ptr() != 0


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
    if not has_data(t):
        return None
    if t.is_cpu:
        return "cpu"
    return "cuda" if t.is_cuda and _lib.HAS_CUDA_KERNELS else None


def raw_cast(tensors, dtype):
    """Copies of ``tensors`` in ``dtype``, one ampc cast call per (dtype, device) group;
    not recorded by autograd. Others (fp8, other devices, subclasses) go through .to()."""
    first = tensors[0]
    if _kernel_device(first, dtype) == "cpu":     # the usual call (a bucket of weights): one pass
        src = first.dtype
        if all(type(t) in _PLAIN and t.dtype is src and t.is_cpu and t.is_contiguous() and has_data(t)
               for t in tensors):
            dsts = [torch.empty_like(t, dtype=dtype) for t in tensors]
            ops.cast_new(dsts, tensors, "cpu")
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
        ops.cast_new(dsts, srcs, dev)
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
        out = tuple(raw_cast(list(tensors), dtype))
        # a cast of a tensor that needs no grad needs none either (else backward would
        # compute the grad of, say, a model's input that joined the weights' call)
        frozen = [o for o, t in zip(out, tensors) if not t.requires_grad]
        if frozen:
            ctx.mark_non_differentiable(*frozen)
        return out

    @staticmethod
    def backward(ctx, *grads):
        out = [None] * len(grads)
        by_dtype = {}
        for i, g in enumerate(grads):
            if g is not None:
                by_dtype.setdefault(ctx.dtypes[i], []).append(i)
        cast = cast_tensors if torch.is_grad_enabled() else raw_cast   # on only for create_graph
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
    return raw_cast(tensors, dtype)
