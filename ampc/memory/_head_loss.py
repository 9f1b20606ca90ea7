"""The head and the loss together, a slice of tokens at a time: the whole logits never exist.

``linear_cross_entropy(hidden, weight, target)`` is ``F.cross_entropy(F.linear(hidden,
weight), target)``. With a large vocabulary the logits (with the fp32 copy and the
log-softmax the loss keeps) are a step's largest activations; here each slice of tokens
has its logits made, its loss and its gradients taken (softmax minus one-hot, then the
two matmuls of the head's backward), and is dropped before the next. The gradients are
therefore complete at the end of the forward: the backward only scales them by the
incoming gradient, so nothing is recomputed. What stays between forward and backward is
one hidden-sized and one weight-sized gradient, not the logits.

The weight's gradient is summed over the slices in bf16 for a bf16 weight (the dtype of the
``.grad`` torch gives it), in fp32 otherwise: it stands at the forward's end beside every
saved activation, and an fp32 sum was twice the bytes of the gradient handed over (16 MiB
for a bf16 head of 8,192 x 512). Each slice adds with one rounding (``addmm_`` sums in fp32
first): over 8 slices the bf16 gradient's error against float64 is about 2x torch's own
under autocast (which rounds once), 1.4x over 4. An fp16 weight keeps the fp32 sum: the sum
is not yet scaled by 1 / tokens, and over many tokens it can pass fp16's 65,504.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

_WHO = "ampc.memory.linear_cross_entropy"
_SLICE_BYTES = 4 << 20      # a slice's fp32 logits: small beside the full ones, big enough a matmul
_MOST_FEWEST = 512          # see default_chunk


def default_chunk(vocab: int, hidden_size: int, tokens: int) -> int:
    """Tokens a slice: its fp32 logits about 4 MiB, or more: min(hidden_size, 512, a quarter
    of the tokens). Each slice adds its part of the weight's gradient into an fp32 sum, one
    pass over vocab x hidden_size values: with a large vocabulary 4 MiB is a few dozen tokens,
    and those passes took 4x the whole head and loss's time (vocab 32,768, width 512, 2,048
    tokens). As many tokens as the hidden size make a slice's logits no larger than that
    gradient; four slices at least keep the saving where the tokens are few."""
    return max(16, _SLICE_BYTES // (4 * max(vocab, 1)),
               min(hidden_size, _MOST_FEWEST, -(-tokens // 4)))


def _block_rows(t):
    """Rows of ``t`` (2-D) that make about a quarter of a slice's bytes: a block of the sums
    below, small beside a weight-sized tensor."""
    return max(1, _SLICE_BYTES // 4 // max(1, t.shape[1] * t.element_size()))


def _add_product(total, a, b):
    """``total += a @ b``, a block of ``total``'s rows at a time: whole, the product (weight-
    sized, in the matmul's dtype) and its fp32 copy that the add makes would stand beside the
    sum, 1.5x an fp32 weight, at the forward's end, when every saved activation is alive. A
    bf16 ``total`` takes the product in one ``addmm_``: the sum in fp32, one rounding."""
    rows = _block_rows(total)
    low = total.element_size() < 4
    if low:
        a, b = a.to(total.dtype), b.to(total.dtype)     # once, not a block at a time
    for i in range(0, total.shape[0], rows):
        if low:
            total[i:i + rows].addmm_(a[i:i + rows], b)
        else:
            total[i:i + rows] += a[i:i + rows] @ b


def _scaled(t, f, dtype):
    """``(t * f).to(dtype)``, a block of rows at a time where ``dtype`` is not ``t``'s: whole,
    an fp32 product the size of the head's weight would stand beside ``t`` and the output at
    the backward's start, when every saved activation is alive; the same values either way."""
    if t.dtype == dtype or t.dim() == 0:
        return (t * f).to(dtype)
    out = torch.empty(t.shape, dtype=dtype, device=t.device)
    rows = _block_rows(t)
    for i in range(0, t.shape[0], rows):
        out[i:i + rows] = t[i:i + rows] * f
    return out


class _LinearCrossEntropy(torch.autograd.Function):

    @staticmethod
    def forward(ctx, hidden, weight, bias, target, ignore_index, mean, chunk):
        h = hidden.reshape(-1, hidden.shape[-1])
        t = target.reshape(-1)
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        grads = need_h or need_w or need_b
        # fp32 at least for the softmax, the losses and the weight's sum over tokens
        acc = torch.promote_types(torch.promote_types(hidden.dtype, weight.dtype), torch.float32)
        flush = math.log(torch.finfo(acc).tiny) + 0.5       # exp(flush): a normal number
        flush_exp = math.exp(flush) * (1 + 2.0 ** -20)
        losses = torch.empty(h.shape[0], dtype=acc, device=h.device)
        grad_h = torch.empty_like(h) if need_h else None
        # a bf16 sum for a bf16 weight, fp32 otherwise (module docstring)
        sum_w = weight.dtype if weight.dtype == torch.bfloat16 else acc
        grad_w = torch.zeros_like(weight, dtype=sum_w) if need_w else None
        grad_b = torch.zeros_like(bias, dtype=acc) if need_b else None
        for s in range(0, h.shape[0], chunk):
            hc, tc = h[s:s + chunk], t[s:s + chunk]
            out = F.linear(hc, weight, bias)        # autocast, if on, picks its dtype
            logits = out.to(acc)
            keep = tc != ignore_index
            safe = tc.masked_fill(~keep, 0)
            picked = logits.gather(1, safe[:, None]).squeeze(1)
            # one exp over the logits serves the loss and the softmax (the logsumexp and then
            # the softmax took two, about 40% of the slice's time on a CPU); a row's largest
            # logit is subtracted first, 0 where it is infinite (as torch's logsumexp does)
            top = logits.amax(1, keepdim=True)
            top.masked_fill_(top.isinf(), 0.0)
            # in place of the logits; a logit more than ~87 below its row's largest (or
            # -inf) has an exp under fp32's normal range, which torch's exp on the CPU makes
            # 5-20x slower than an exp in range (a trained head's rows can spread that far):
            # it is raised to that bound, and exp(bound) (and 2^-20 of it, exp's own error
            # and more) taken off every exp, so that it gives exactly 0, as a CPU that
            # flushes subnormals would (any exp of 2^-100 or more stays what it was: the
            # 2^-125 taken off is under half its ulp)
            d = logits.sub_(top).clamp_(min=flush).exp_().sub_(flush_exp).clamp_(min=0.0)
            total_exp = d.sum(1, keepdim=True)
            lse = (top + total_exp.log()).squeeze(1)
            losses[s:s + chunk] = (lse - picked).masked_fill_(~keep, 0.0)
            if not grads:
                continue
            d.div_(total_exp)                       # the softmax
            d.scatter_add_(1, safe[:, None], -keep[:, None].to(acc))
            d.mul_(keep[:, None])
            if need_b:
                grad_b += d.sum(0)
            d = d.to(out.dtype)
            if need_h:
                grad_h[s:s + chunk] = d @ weight.to(out.dtype)
            if need_w:
                _add_product(grad_w, d.t(), hc.to(out.dtype))
        total = losses.sum()
        scale = (1.0 / (t != ignore_index).sum().to(acc) if mean
                 else torch.ones((), dtype=acc, device=h.device))
        ctx.save_for_backward(grad_h, grad_w, grad_b, scale)
        ctx.shapes = hidden.shape, hidden.dtype, weight.dtype, None if bias is None else bias.dtype
        return total * scale

    @staticmethod
    def backward(ctx, g):
        if torch.is_grad_enabled():         # create_graph=True: a second derivative is wanted
            raise RuntimeError(f"{_WHO}: the gradients are taken in the forward, slice by slice; "
                               "they cannot be differentiated again (create_graph=True): use "
                               "F.cross_entropy(F.linear(...)) for that")
        grad_h, grad_w, grad_b, scale = ctx.saved_tensors
        shape, h_dtype, w_dtype, b_dtype = ctx.shapes
        f = g.to(scale.dtype) * scale
        out_h = None if grad_h is None else _scaled(grad_h, f.to(grad_h.dtype), h_dtype).reshape(shape)
        out_w = None if grad_w is None else _scaled(grad_w, f, w_dtype)
        out_b = None if grad_b is None else (grad_b * f).to(b_dtype)
        return out_h, out_w, out_b, None, None, None, None


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                         bias: torch.Tensor | None = None, *, ignore_index: int = -100,
                         reduction: str = "mean", chunk_tokens: int | None = None) -> torch.Tensor:
    """``F.cross_entropy(F.linear(hidden, weight, bias), target)``, the logits made a slice
    of tokens at a time and never held whole (see the module docstring).

    Args:
        hidden (Tensor): ``(..., hidden_size)``, the last hidden states.
        weight (Tensor): ``(vocab, hidden_size)``, the head's weight (a tied embedding too).
        target (Tensor): integer classes, ``hidden``'s shape without its last dimension.
        bias (Tensor or None): ``(vocab,)``.
        ignore_index (int): targets with this value add nothing. Default: -100.
        reduction (str): ``"mean"`` (over the targets not ignored) or ``"sum"``.
        chunk_tokens (int or None): tokens a slice; None: a slice's fp32 logits about 4 MiB, or
            min(hidden_size, 512, a quarter of the tokens) where that is more
            (:func:`default_chunk`).

    Returns the scalar loss. Its backward cannot be differentiated again (create_graph=True
    raises).
    """
    if not isinstance(hidden, torch.Tensor) or hidden.dim() < 1 or not hidden.is_floating_point():
        raise TypeError(f"{_WHO}: hidden must be a floating tensor of shape (..., hidden_size)")
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or \
            weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"{_WHO}: weight must be (vocab, {hidden.shape[-1]}) to go with hidden "
                         f"{tuple(hidden.shape)}, got "
                         f"{tuple(weight.shape) if isinstance(weight, torch.Tensor) else weight!r}")
    if not isinstance(target, torch.Tensor) or target.is_floating_point() or \
            target.is_complex() or target.dtype == torch.bool:
        raise TypeError(f"{_WHO}: target must be an integer tensor of classes")
    if target.shape != hidden.shape[:-1]:
        raise ValueError(f"{_WHO}: target must have hidden's shape without its last dimension, "
                         f"{tuple(hidden.shape[:-1])}, got {tuple(target.shape)}")
    if bias is not None and (not isinstance(bias, torch.Tensor) or
                             bias.shape != (weight.shape[0],)):
        raise ValueError(f"{_WHO}: bias must be ({weight.shape[0]},), got "
                         f"{tuple(bias.shape) if isinstance(bias, torch.Tensor) else bias!r}")
    if reduction not in ("mean", "sum"):
        raise ValueError(f"{_WHO}: reduction must be 'mean' or 'sum', got {reduction!r} (per-token "
                         "losses would need the logits again in the backward)")
    if chunk_tokens is None:
        chunk_tokens = default_chunk(*weight.shape, target.numel())
    if isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or chunk_tokens < 1:
        raise ValueError(f"{_WHO}: chunk_tokens must be an int >= 1, got {chunk_tokens!r}")
    devices = {t.device for t in (hidden, weight, target, bias) if t is not None}
    if len(devices) > 1:
        raise ValueError(f"{_WHO}: hidden, weight, target and bias must share a device, got "
                         f"{sorted(map(str, devices))}")
    return _LinearCrossEntropy.apply(hidden, weight, bias, target, int(ignore_index),
                                     reduction == "mean", chunk_tokens)
