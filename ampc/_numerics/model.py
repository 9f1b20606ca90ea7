"""A model and its batches as both tools handle them."""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from .._walk import map_tensors, tensors


def default_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Cross-entropy over the last dimension of ``output`` (computed in fp32)."""
    return F.cross_entropy(output.float().reshape(-1, output.shape[-1]), target.reshape(-1))


def call_model(model: torch.nn.Module, inputs: Any) -> Any:
    """``model(*inputs)`` for a tuple or list of positional arguments, else ``model(inputs)``."""
    return model(*inputs) if isinstance(inputs, (tuple, list)) else model(inputs)


def first_float(value: Any) -> torch.Tensor | None:
    """The first floating tensor inside ``value`` (nested lists, tuples, dicts), or None."""
    return next((t for t in tensors(value) if t.is_floating_point()), None)


def float_tensors(value: Any) -> list[torch.Tensor]:
    """Every floating tensor inside ``value``, depth first."""
    return [t for t in tensors(value) if t.is_floating_point()]


def to_device(value: Any, device: torch.device | str) -> Any:
    """``value`` with every tensor inside it moved to ``device`` (namedtuples and dicts kept)."""
    return map_tensors(lambda t: t.to(device), value)


def detached(value: Any) -> Any:
    """``value`` with every tensor inside it replaced by a detached copy."""
    return map_tensors(lambda t: t.detach().clone(), value)


def expression(path: str) -> str:
    """'blocks.0.attn' -> 'model.blocks[0].attn' (pasteable Python); '' or '(model)' -> 'model'."""
    if path in ("", "(model)"):
        return "model"
    return "model" + "".join(f"[{p}]" if p.isdigit() else f".{p}" for p in path.split("."))

