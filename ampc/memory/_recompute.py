"""Modules that recompute their forward in the backward instead of saving for it.

Each chosen module's forward runs inside torch's non-reentrant checkpoint: nothing the module
computes is saved, only its inputs are kept, and the backward runs the forward again, with
the CPU and device random states of the first run (``preserve_rng_state``), so dropout draws
the same masks and the gradients are those of the plain module. The module itself is not
replaced (an instance attribute ``forward`` wraps the class's), so its name, its state_dict
and the hooks on it stay as they were.

State outside the forward's outputs is not changed twice: buffers the first run changed in
place (BatchNorm's running statistics and its counter) are put back after the recomputation,
and a KV cache is turned off while the modules recompute (``config.use_cache`` of a
transformers model, as its own gradient checkpointing does, said once); a cache that still
reaches a recomputed module in training is refused by name before the module runs.

A module that changes its input in place (an activation with ``inplace=True``) is refused:
its recomputation would start from the values it overwrote (torch would stop the backward
with a version-counter error that names no module).
"""
from __future__ import annotations

import difflib
import functools
import warnings
from collections.abc import Iterable
from fnmatch import fnmatchcase

import torch
import torch.utils.checkpoint

from .._checkpoint import current_region
from ._saved import note_held

# torch's checkpoint re-enters the CPU autocast state of the forward before the region does;
# under ampc's fp32 scope that state holds fp32, which torch.amp.autocast refuses with a
# warning (and disables itself) on every recomputation. The region entered right after sets
# the state that was measured, so the warning says nothing true: it is hidden, from that
# module only.
warnings.filterwarnings("ignore", message="In CPU autocast, but the target dtype is not supported",
                        category=UserWarning, module=r"torch\.utils\.checkpoint")

_ATTR = "_ampc_recompute"   # on a wrapped module: (its handle, the forward it had before)


class ModuleHandle:
    """Modules whose forward an instance attribute wraps, marked with ``_attr`` (the handle,
    the forward they had before, ...): ``remove()`` (or the end of a ``with`` block)
    restores each, once."""
    _attr = ""

    def __init__(self, names: list[str], modules: list[torch.nn.Module]):
        self.names = names
        self._modules = modules

    def wrap(self, forward, *extra) -> None:
        """Marks each module ``(self, the forward it had, *extra)`` and makes its forward
        ``forward(module, ...)``: a module-level function bound by functools.partial, so that
        a deepcopy of the model calls its own module and pickle can save it."""
        for m in self._modules:
            m.__dict__[self._attr] = (self, m.__dict__.get("forward"), *extra)
            m.__dict__["forward"] = functools.partial(forward, m)

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
    the modules save for the backward again (and turns back on a KV cache it turned off)."""
    _attr = _ATTR

    def __init__(self, names, modules, caches_off=()):
        super().__init__(names, modules)
        self._caches_off = list(caches_off)

    def remove(self) -> None:
        super().remove()
        for config in self._caches_off:
            config.use_cache = True
        self._caches_off = []


def _cache_off(model):
    """Turns off ``config.use_cache`` (transformers' KV cache) on ``model`` and its modules:
    a recomputed forward would add its keys and values to the cache a second time. Returns
    the configs turned off."""
    configs = []
    for m in model.modules():
        config = getattr(m, "config", None)
        if getattr(config, "use_cache", False) is True and not any(c is config for c in configs):
            config.use_cache = False
            configs.append(config)
    if configs:
        warnings.warn(f"ampc.memory.recompute: {type(model).__name__}'s config.use_cache set "
                      "to False while its modules recompute (a recomputed forward would add "
                      "to the KV cache twice); remove() turns it back on", stacklevel=3)
    return configs


def _running_stats(module):
    """The running statistics of the batch norms in ``module`` that a training forward
    updates: their kernel changes them in place without a new version."""
    return [b for m in module.modules()
            if isinstance(m, torch.nn.modules.batchnorm._NormBase) and m.training
            and m.track_running_stats
            for b in (m.running_mean, m.running_var) if b is not None]


def _is_cache(value):
    """A KV cache (transformers' Cache classes): a forward adds to it in place."""
    return callable(getattr(value, "update", None)) and callable(
        getattr(value, "get_seq_length", None))


def marked(model: torch.nn.Module, attr: str) -> dict[str, tuple]:
    """{name: mark} of the modules of ``model`` that a handle marked with ``attr``, in the
    model's order."""
    return {n or "(model)": m.__dict__[attr] for n, m in model.named_modules()
            if attr in m.__dict__}


def recomputed(model: torch.nn.Module) -> list[str]:
    """Names of the modules of ``model`` that recompute in the backward."""
    return list(marked(model, _ATTR))


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
    for m, n in zip(chosen, names):
        if getattr(m, "inplace", False) is True:
            raise ValueError(f"ampc.memory.recompute: {n!r} ({type(m).__name__}) works in place "
                             "(inplace=True): its recomputation would start from the input it "
                             "overwrote; leave it out (its output is its input: recomputing it "
                             "saves nothing) or recompute the module around it")
    handle = Recompute(names, chosen, _cache_off(model))
    handle.wrap(_recomputed_forward)
    return handle


def _recomputed_forward(module, *args, **kwargs):
    # a module-level function bound by functools.partial, not a closure: a deepcopy of the
    # model then calls its own module (and pickle can save it)
    before = module.__dict__[_ATTR][1]
    inner = before if before is not None else type(module).forward.__get__(module)
    if not torch.is_grad_enabled():
        return inner(*args, **kwargs)                      # nothing is saved: nothing to recompute
    for key, value in [*enumerate(args), *kwargs.items()]:
        if _is_cache(value):
            raise RuntimeError(
                f"ampc.memory.recompute: a {type(module).__name__} that recomputes was given a "
                f"KV cache ({type(value).__name__}, argument {key!r}): its recomputation would add "
                "to the cache a second time; call the model with use_cache=False")
    note_held(module, (args, kwargs))
    keys = list(kwargs)
    buffers = list(module.buffers())
    versions = [b._version for b in buffers]
    changed = []        # the buffers the first run changed in place (running statistics)
    compiling = torch.compiler.is_compiling()   # (the compiler recomputes from its graph)
    region = None if compiling else current_region()  # the scopes whose hooks ran once
    ran = []

    # keyword values go in as positional ones: torch's checkpoint finds the devices whose
    # random state it replays in its positional arguments only
    def run(*values):
        n = len(values) - len(keys)
        if ran:                          # the recomputation: as the first run, buffers left
            after = [b.detach().clone() for b in changed]
            try:       # (torch's checkpoint may stop a recomputation early by raising)
                with region:
                    return inner(*values[:n], **dict(zip(keys, values[n:])))
            finally:
                with torch.no_grad():
                    for b, a in zip(changed, after):
                        b.copy_(a)
        if not compiling:
            ran.append(True)
        # (under torch.compile a version read would break the graph: its own checks apply)
        inputs = ([] if compiling else
                  [(v, v._version) for v in values if isinstance(v, torch.Tensor)])
        out = inner(*values[:n], **dict(zip(keys, values[n:])))
        if any(v._version != version for v, version in inputs):
            raise RuntimeError(
                f"ampc.memory.recompute: a {type(module).__name__} that recomputes changed its "
                "input in place (an in-place op on it, such as an activation with inplace=True): "
                "its recomputation would start from the changed values; make that op out of "
                "place or recompute the module around it")
        changed.extend(b for b, v in zip(buffers, versions) if b._version != v)
        changed.extend(b for b in _running_stats(module) if all(b is not c for c in changed))
        return out
    return torch.utils.checkpoint.checkpoint(run, *args, *kwargs.values(), use_reentrant=False,
                                             preserve_rng_state=True)
