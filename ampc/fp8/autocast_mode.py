"""ampc.fp8.autocast: a region in which the GEMMs of listed modules run in FP8.

Inside it, ampc.fp8.Linear runs FP8, and modules whose type is exactly one of ``modules``
(nn.Linear by default) become ampc.fp8.Linear when their parent module is called, so they
run FP8 from their first call; a listed module called directly (no parent) is converted by
its first call and runs FP8 from its second. Call ampc.fp8.convert(model) first to avoid
both, and before loading an FP8 checkpoint into a fresh model. Under torch.distributed a
region reduces delayed scaling's amaxes across its process group (_amax_reduction.py).
"""
from __future__ import annotations  # "X | None" hints on Python 3.9 too; none evaluated at import

import threading
from typing import Any

import torch.distributed as dist
from torch import nn
from torch.nn.modules import module as _module

from . import _open_regions
from ._amax_reduction import Pending, check_group, resolve_group
from .linear import Linear, to_fp8
from .recipe import DelayedScaling, Recipe, check_recipe

__all__ = ["autocast"]

_hook_lock = threading.Lock()
_hook = None
_hook_users = 0


def _convert_listed(module, args):
    region = _open_regions.current()
    if region is None:
        return
    listed = region[1]
    if type(module) in listed:
        to_fp8(module)
    for child in module._modules.values():
        if child is not None and type(child) in listed:
            to_fp8(child)


def _add_hook(handle):
    """Registers _convert_listed, under the key of its last registration if it had one:
    torch.compile guards on the keys of the global hooks, and a new key every region (every
    step) recompiled the model each time."""
    if handle is None:
        return _module.register_module_forward_pre_hook(_convert_listed)
    _module._global_forward_pre_hooks[handle.id] = _convert_listed
    return handle


def _check_modules(modules):
    if not isinstance(modules, (tuple, list)):
        raise TypeError(f"ampc.fp8.autocast: modules must be a tuple of module types, "
                        f"got {type(modules).__name__}")
    for m in modules:
        if not (isinstance(m, type) and issubclass(m, nn.Linear)) or \
                m.forward is not nn.Linear.forward and m is not Linear:
            raise TypeError(f"ampc.fp8.autocast: modules lists module types to run in FP8; "
                            f"only nn.Linear and its subclasses that keep its forward can, "
                            f"got {m!r}")
    return tuple(modules)


class autocast:
    """Runs the GEMMs of listed modules in FP8 with ``recipe``.

    Args:
        enabled (bool): False makes a region without FP8 (nested regions included).
        recipe: ampc.fp8.DelayedScaling (default: DelayedScaling()) or
            ampc.fp8.Float8CurrentScaling.
        modules (tuple of types): module types turned into ampc.fp8.Linear inside the region.
            Default: (nn.Linear,).
        fp8_group (ProcessGroup, optional): the ranks across which DelayedScaling's amaxes
            are reduced (MAX) when its ``reduce_amax`` is True: one all_reduce of the forward
            amaxes of every module that ran in the region at its exit, one of the backward
            amaxes at the end of the backward pass, the scale updates after each, on the
            device. Default: the default group when torch.distributed is initialized with
            more than one rank; a group of one rank, or one process, reduces nothing. Every
            rank must run the same FP8 modules in the same order; a region left by an
            exception skips its reduction and updates.

    Example::

        >>> with ampc.fp8.autocast(recipe=ampc.fp8.DelayedScaling(amax_history_len=16)):
        ...     loss = model(x).float().pow(2).mean()
        >>> loss.backward()     # the backward of an FP8 forward runs FP8 wherever it runs
    """

    def __init__(self, enabled: bool = True, recipe: Recipe | None = None,
                 modules: tuple[type[nn.Module], ...] = (nn.Linear,),
                 fp8_group: "dist.ProcessGroup | None" = None) -> None:
        self.enabled = bool(enabled)
        self.recipe = check_recipe(DelayedScaling() if recipe is None else recipe,
                                   "ampc.fp8.autocast: recipe")
        self.modules = _check_modules(modules)
        check_group(fp8_group)
        self.fp8_group = fp8_group

    def __enter__(self) -> "autocast":
        global _hook, _hook_users
        pending = None
        if self.enabled and self.recipe.reduce_amax:
            group = resolve_group(self.fp8_group)
            pending = None if group is None else Pending(group)
        with _hook_lock:
            if _hook_users == 0:
                _hook = _add_hook(_hook)
            _hook_users += 1
        _open_regions.stack().append((self.recipe, self.modules, pending) if self.enabled else None)
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> bool:
        global _hook, _hook_users
        region = _open_regions.stack().pop()
        pending = None if region is None else region[2]
        with _hook_lock:
            _hook_users -= 1
            if _hook_users == 0:
                _hook.remove()
        if pending is not None and exc_type is None:
            pending.finish()
        return False
