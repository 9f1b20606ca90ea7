"""Modules that recompute their forward in the backward instead of saving for it.

Each chosen module's forward runs inside torch's non-reentrant checkpoint: nothing the module
computes is saved, only its inputs are kept, and the backward runs the forward again, with
the CPU and device random states of the first run (``preserve_rng_state``), so dropout draws
the same masks and the gradients are those of the plain module. The module itself is not
replaced (an instance attribute ``forward`` wraps the class's), so its name, its state_dict
and the hooks on it stay as they were.
"""
from __future__ import annotations

import difflib
import functools
from collections.abc import Iterable
from fnmatch import fnmatchcase

import torch
import torch.utils.checkpoint

from ._saved import note_held

_ATTR = "_ampc_recompute"   # on a wrapped module: (its handle, the forward it had before)


class ModuleHandle:
    """Modules whose forward an instance attribute wraps, marked with ``_attr`` (the handle,
    the forward they had before, ...): ``remove()`` (or the end of a ``with`` block)
    restores each, once."""
    _attr = ""

    def __init__(self, names: list[str], modules: list[torch.nn.Module]):
        self.names = names
        self._modules = modules

    def remove(self) -> None:
        for m in self._modules:
            mark = m.__dict__.get(self._attr)
            if mark is None or mark[0] is not self:
                continue                                 # removed already
            del m.__dict__[self._attr]
            if mark[1] is None:
                del m.__dict__["forward"]                  # the class's forward again
            else:
                m.__dict__["forward"] = mark[1]
        self._modules = []

    def __repr__(self):
        return f"ampc.memory.{type(self).__name__}({self.names})"

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.remove()


class Recompute(ModuleHandle):
    """What :func:`recompute` returns: ``remove()`` (or the end of a ``with`` block) makes
    the modules save for the backward again."""
    _attr = _ATTR


def recomputed(model: torch.nn.Module) -> list[str]:
    """Names of the modules of ``model`` that recompute in the backward."""
    return [n or "(model)" for n, m in model.named_modules() if _ATTR in m.__dict__]


def _matches(name: str, pattern: str) -> bool:
    """Shell-style match, part by part: ``*`` stands within one dotted part, so
    ``"blocks.*"`` is each block, not also every module inside them."""
    names, pats = name.split("."), pattern.split(".")
    return len(names) == len(pats) and all(fnmatchcase(n, p) for n, p in zip(names, pats))


def _find_modules(where, model, modules, attr, already):
    """The modules named or given (a name or pattern, a module, or a list of them), in
    order, each once, as (modules, names); raises before anything changes, also for a
    module that has ``attr`` already (it ``already``...)."""
    if isinstance(modules, (str, torch.nn.Module)):
        items = [modules]
    elif isinstance(modules, Iterable):
        items = list(modules)
    else:
        raise TypeError(f"{where}: modules is {type(modules).__name__}, expected a "
                        "module name, a module, or a list of them")
    if not items:
        raise ValueError(f"{where}: modules is empty")
    named = list(model.named_modules())
    name_of = {m: n for n, m in named}
    chosen = []
    for i, item in enumerate(items):
        if isinstance(item, str):
            found = [m for n, m in named if _matches(n, item)]
            if not found:
                near = difflib.get_close_matches(item, [n for n, _ in named if n], n=3)
                raise ValueError(f"{where}: modules[{i}] {item!r} names no module of the model"
                                 + (f" (close: {', '.join(near)})" if near else ""))
        elif isinstance(item, torch.nn.Module):
            if item not in name_of:
                raise ValueError(f"{where}: modules[{i}] ({type(item).__name__}) is not a module of model")
            found = [item]
        else:
            raise TypeError(f"{where}: modules[{i}] is {type(item).__name__}, expected a module "
                            "name (str) or an nn.Module of model")
        for m in found:
            if attr in m.__dict__:
                raise ValueError(f"{where}: modules[{i}] {name_of[m] or '(model)'!r} {already} "
                                 "(remove() the handle that made it so first)")
            if m not in chosen:
                chosen.append(m)
    return chosen, [name_of[m] or "(model)" for m in chosen]


def recompute(model: torch.nn.Module, modules: str | torch.nn.Module | Iterable) -> Recompute:
    """Makes ``modules`` of ``model`` recompute their forward in the backward instead of
    saving what the backward needs (torch's ``checkpoint(use_reentrant=False)`` around each,
    random states replayed; keyword arguments passed through). The gradients are those of
    the plain model; a step takes one more forward of those modules; the memory saved is
    what they saved, less their inputs, which are kept.

    Args:
        model (nn.Module): the model.
        modules: a qualified module name (``"transformer.h.0.attn"``; shell-style patterns
            match several, ``*`` within one dotted part: ``"transformer.h.*.mlp"``), a module
            of ``model``, or a list of them.

    Returns:
        :class:`Recompute`: ``.remove()`` undoes it; usable as a context manager.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"ampc.memory.recompute: model is {type(model).__name__}, expected a torch.nn.Module")
    chosen, names = _find_modules("ampc.memory.recompute", model, modules, _ATTR,
                                  "recomputes already")
    handle = Recompute(names, chosen)
    for m in chosen:
        m.__dict__[_ATTR] = (handle, m.__dict__.get("forward"))
        m.__dict__["forward"] = functools.partial(_recomputed_forward, m)
    return handle


def _recomputed_forward(module, *args, **kwargs):
    # a module-level function bound by functools.partial, not a closure: a deepcopy of the
    # model then calls its own module (and pickle can save it)
    before = module.__dict__[_ATTR][1]
    inner = before if before is not None else type(module).forward.__get__(module)
    if not torch.is_grad_enabled():
        return inner(*args, **kwargs)                      # nothing is saved: nothing to recompute
    note_held(module, (args, kwargs))
    keys = list(kwargs)

    # keyword values go in as positional ones: torch's checkpoint finds the devices whose
    # random state it replays in its positional arguments only
    def run(*values):
        n = len(values) - len(keys)
        return inner(*values[:n], **dict(zip(keys, values[n:])))
    return torch.utils.checkpoint.checkpoint(run, *args, *kwargs.values(), use_reentrant=False,
                                             preserve_rng_state=True)
