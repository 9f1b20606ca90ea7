"""A batch split into micro-batches whose gradients add up to the whole batch's.

A step's saved activations grow with its batch; run as k micro-batches, one after another,
each saves about a k-th of them, and the gradients, summed over the pieces with each
piece's loss weighted by its share of the examples, are those of the whole batch (for a
loss that is a mean over the examples: the same update). The weights' gradients stay alive
from the first piece to the step, so with ``step_in_backward`` the pieces but the last run
inside the optimizer's ``accumulating()``.

BatchNorm in training takes its statistics per piece, so a model with one is not the
same model split: :func:`why_not_split` says so, and the search leaves the move.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch

from .._walk import map_tensors, tensors


def _pieces(x, size, k):
    """``x`` as ``k`` values, each tensor whose first dim is ``size`` cut along it."""
    cuts = {}

    def piece(i):
        def cut(t):
            if not (t.dim() and t.shape[0] == size):
                return t
            if id(t) not in cuts:
                cuts[id(t)] = torch.tensor_split(t, k)
            return cuts[id(t)][i]
        return map_tensors(cut, x)
    return [piece(i) for i in range(k)]


def batch_size(batch, where: str = "ampc.memory.micro_batches") -> int:
    """The examples in ``batch`` (``(inputs, target)``): the first dim of its first tensor."""
    if not isinstance(batch, (tuple, list)) or len(batch) != 2:
        raise TypeError(f"{where}: batch must be an (inputs, target) pair, got "
                        f"{type(batch).__name__}")
    first = next((t for t in tensors(batch) if t.dim()), None)
    if first is None:
        raise ValueError(f"{where}: batch holds no tensor with a batch dimension to split")
    return first.shape[0]


def micro_batches(batch: tuple, k: int) -> list[tuple[tuple, float]]:
    """``batch`` (``(inputs, target)``) as ``k`` micro-batches: ``[(piece, share), ...]``,
    each piece an ``(inputs, target)`` pair holding a slice of the examples (views, no
    copy) and its share of them (the shares add up to 1). Every tensor whose first dim is
    the batch's (that of its first tensor) is cut along it; other values go to every piece.
    ``k`` 1: ``[(batch, 1.0)]``, the batch itself."""
    where = "ampc.memory.micro_batches"
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"{where}: k is {k!r}, expected an int >= 1")
    if k == 1:
        return [(batch, 1.0)]
    size = batch_size(batch, where)
    if k > size:
        raise ValueError(f"{where}: k is {k}, more than the batch's {size} examples")
    inputs, target = batch
    ins, tgs = _pieces(inputs, size, k), _pieces(target, size, k)
    counts = [size // k + (i < size % k) for i in range(k)]     # torch.tensor_split's sizes
    return [((x, y), n / size) for x, y, n in zip(ins, tgs, counts)]


def micro_batch_backward(optimizer: torch.optim.Optimizer | None, batch: tuple, k: int,
                         loss_of: Callable[[tuple], torch.Tensor], scaler=None) -> torch.Tensor:
    """The backward of ``batch`` as ``k`` micro-batches: ``loss_of(piece)`` is each piece's
    loss, weighted by its share (and scaled by ``scaler``, a GradScaler, where given); the
    pieces but the last inside ``optimizer.accumulating()`` where the optimizer has it (an
    optimizer that steps in the backward then steps once, on the sum). Returns the whole
    batch's loss (detached)."""
    pieces = micro_batches(batch, k)
    first = accumulate(optimizer, pieces[:-1], loss_of, scaler)
    last = backward_pieces(pieces[-1:], loss_of, scaler)
    return last if first is None else first + last


def backward_pieces(pieces, loss_of, scaler=None) -> torch.Tensor | None:
    """Each piece's forward and backward, its loss weighted by its share (and scaled by
    ``scaler`` where given); the sum of the weighted losses (detached), None for none."""
    total = None
    for piece, share in pieces:
        loss = loss_of(piece)
        weighted = loss * share if share != 1.0 else loss
        (scaler.scale(weighted) if scaler is not None else weighted).backward()
        part = weighted.detach()
        total = part if total is None else total + part
    return total


def accumulate(optimizer, pieces, loss_of, scaler=None) -> torch.Tensor | None:
    """:func:`backward_pieces` inside ``optimizer.accumulating()`` where the optimizer has it
    (one that steps in the backward then keeps the gradients for a later backward)."""
    keep = getattr(optimizer, "accumulating", contextlib.nullcontext)
    with keep():
        return backward_pieces(pieces, loss_of, scaler)


def why_not_split(model: torch.nn.Module) -> str | None:
    """Why ``model`` is not the same model split into micro-batches, or None."""
    for name, m in model.named_modules():
        if isinstance(m, torch.nn.modules.batchnorm._BatchNorm):
            return (f"{name or 'the model'} is a {type(m).__name__}: in training it would take "
                    "its statistics per micro-batch")
    return None
