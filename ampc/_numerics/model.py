"""A model and its batches as both tools handle them."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F

from .._walk import map_tensors, tensors


def default_loss(output: Any, target: torch.Tensor | None) -> torch.Tensor:
    """Cross-entropy over the last dimension of the model's logits (computed in fp32).

    ``output`` is a tensor, or what transformers models return (a ``ModelOutput``, a dict,
    a tuple): the loss the model computed itself when it carries one (its ``loss``: the
    model was given labels, and ``target`` is not used), else the cross-entropy of its
    ``logits``, else of the first floating tensor inside it."""
    if not isinstance(output, torch.Tensor):
        own = output.get("loss") if isinstance(output, Mapping) else getattr(output, "loss", None)
        if isinstance(own, torch.Tensor):
            return own.float().mean()
        output = logits_of(output)
        if output is None:
            raise TypeError("ampc: the default loss found no loss, logits or floating tensor "
                            "in the model's output; pass a loss_fn")
    if target is None:
        raise TypeError("ampc: the default loss needs a target (or a model that returns its "
                        "own loss); pass a loss_fn")
    return F.cross_entropy(output.float().reshape(-1, output.shape[-1]), target.reshape(-1))


def logits_of(output: Any) -> torch.Tensor | None:
    """The logits in a model's output: the tensor itself, its ``logits`` (what transformers
    models return), else the first floating tensor inside it; None without one."""
    if isinstance(output, torch.Tensor):
        return output
    logits = (output.get("logits") if isinstance(output, Mapping)
              else getattr(output, "logits", None))
    return logits if isinstance(logits, torch.Tensor) else first_float(output)


def call_model(model: torch.nn.Module, inputs: Any, state: dict[str, torch.Tensor] | None = None
               ) -> Any:
    """``model(**inputs)`` for a dict of keyword arguments (a tokenizer's output),
    ``model(*inputs)`` for a tuple or list of positional arguments, else ``model(inputs)``.
    With ``state`` (qualified name -> tensor), the model runs on those tensors in place of
    its own parameters and buffers (``torch.func.functional_call``)."""
    if isinstance(inputs, Mapping):
        args, kwargs = (), dict(inputs)
    else:
        args, kwargs = (tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)), {}
    if state is None:
        return model(*args, **kwargs)
    return torch.func.functional_call(model, state, args, kwargs)


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

