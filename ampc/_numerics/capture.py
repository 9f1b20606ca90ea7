"""One training step of a whole model, recording what each module saw on its first call.

Both tools start from this: validate compares the records of an fp32 step with those of a
mixed step; autoprecision re-runs each unit alone on its fp32 record.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from .._walk import map_tensors
from .model import call_model, detached, first_float


@dataclass
class Call:
    """A module's first call in a step: its arguments (detached copies), its first float
    output and the loss's gradient at that output (None where there is none)."""
    args: tuple
    kwargs: dict
    out: torch.Tensor | None = None
    grad: torch.Tensor | None = None
    returned: bool = False          # the forward finished (a pre-hook alone ran otherwise)

    @property
    def input(self) -> torch.Tensor | None:
        """The first float tensor among the arguments."""
        return first_float((self.args, self.kwargs))


@dataclass
class Step:
    """What :func:`capture` recorded: the loss, each named module's first :class:`Call`, and
    every parameter's gradient by qualified name (shared parameters under each name), and,
    where asked for, the model's output (detached) and the target the loss was computed from."""
    loss: float
    calls: dict[str, Call]
    grads: dict[str, torch.Tensor]
    output: Any = None
    target: Any = None

    def module_grads(self, model: torch.nn.Module, name: str) -> list[torch.Tensor]:
        """The gradients of the parameters ``name`` holds itself (not its children's)."""
        module = model.get_submodule(name)
        prefix = f"{name}." if name else ""
        return [self.grads[prefix + pn] for pn, _ in module.named_parameters(recurse=False)
                if prefix + pn in self.grads]


def capture(model: torch.nn.Module, batch: tuple, loss_fn: Callable, names: Iterable[str],
            region: Callable[[], Any] = contextlib.nullcontext,
            state: dict[str, torch.Tensor] | None = None, keep_output: bool = False) -> Step:
    """One forward (inside ``region()``) and backward of ``model`` on ``(inputs, target)``,
    dropout seeded with 0, recording the first call of each module in ``names`` (qualified
    names, '' for the model itself). The model's own ``.grad`` are left as they were. With
    ``state`` (every parameter and buffer by qualified name) the model runs on those tensors
    instead of its own (see :func:`call_model`), and the gradients are theirs. With
    ``keep_output`` the step keeps the model's output and the target (a loss measured on
    its own needs them); otherwise the output is freed with the step's graph."""
    modules = dict(model.named_modules())
    calls: dict[str, Call] = {}
    handles = []

    def hooks(name):
        def pre(mod, args, kwargs):
            if name not in calls:
                calls[name] = Call(detached(args), detached(kwargs))

        def post(mod, args, out):
            rec = calls[name]
            if rec.returned:
                return
            rec.returned = True
            t = first_float(out)
            rec.out = None if t is None else t.detach().clone()
            if t is not None and t.requires_grad:
                t.register_hook(lambda g: setattr(rec, "grad", g.detach().clone()))
        return pre, post

    for name in names:
        pre, post = hooks(name)
        handles.append(modules[name].register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(modules[name].register_forward_hook(post))
    params = (list(model.named_parameters(remove_duplicate=False)) if state is None
              else [(n, t) for n, t in state.items() if t.requires_grad])
    saved = [p.grad for _, p in params]
    try:
        inputs, target = batch
        for _, p in params:
            p.grad = None
        torch.manual_seed(0)                    # the same dropout draws in every run
        with region():
            out = call_model(model, inputs, state)
        loss = loss_fn(out, target)
        loss.backward()
        copies: dict[int, torch.Tensor] = {}
        grads = {n: copies.setdefault(id(p), p.grad.detach().clone())
                 for n, p in params if p.grad is not None}
    finally:
        for h in handles:
            h.remove()
        for (_, p), g in zip(params, saved):
            p.grad = g
    if not keep_output:
        return Step(loss.detach().float().item(), calls, grads)
    # the output detached, not copied: nothing writes to it after the step
    return Step(loss.detach().float().item(), calls, grads,
                map_tensors(lambda t: t.detach(), out), target)
