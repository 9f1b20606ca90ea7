"""ampc.optim.Adam and AdamW: torch's optimizer protocol, the options, and the choice of a
step strategy per param group (see the package docstring)."""
from __future__ import annotations  # "X | None" hints on Python 3.9 too; none evaluated at import

import contextlib
from itertools import repeat
from operator import attrgetter, is_not
from typing import Any, Callable, Iterable

import torch

from .. import _distributed
from . import _convert, _lean, _packed
from ._in_backward import InBackward
from ._control import name
from ._lean import PRESETS

_grad = attrgetter("grad")
_NONE = type(None)


class Adam(torch.optim.Optimizer):
    """Adam with a fused C step (see the module docstring); ``AdamW`` is the same with
    decoupled weight decay.

    Args:
        params: parameters or param groups, as for any torch optimizer.
        lr (float or Tensor): learning rate; a 1-element tensor lets a schedule live
            on the device. Default: 1e-3.
        betas (Tuple[float, float]), eps (float), weight_decay (float), amsgrad (bool),
        maximize (bool): as torch.optim.Adam.
        foreach, fused, capturable: accepted for compatibility; every step is fused, and
            needs no host sync, so it can be captured in a CUDA graph.
        master_weights (bool or None): keep fp32 master weights. None (default): for
            fp16 and bf16 params, not for fp32 ones.
        stochastic_rounding (bool): write fp16/bf16 params from the masters with
            stochastic rounding instead of round to nearest. Default: False.
        seed (int): seed of the random bits a step draws: the stochastic rounding of the
            weights, bf16 moments and the 8-bit second moment's codes. Default: 0.
        moments (str): how exp_avg and exp_avg_sq are stored: ``"fp32"`` (default),
            ``"bf16"`` (stochastic rounding), or ``"8bit"`` (block-wise codes with an fp32
            scale a block of 256). Params under ``moments_min_numel`` elements, and 1-d
            params (norms, biases), keep fp32 moments.
        moments_min_numel (int): see ``moments``. Default: 4096.
        kahan_summation (bool): bf16 params without master weights keep a bf16
            compensation buffer; param + compensation is the weight the step updates
            (2 bytes a parameter instead of a 4-byte master). fp32 params (the norms
            ``ampc.prepare`` keeps) are their own weight; fp16 params are refused.
            Default: False.
        state (str or None): a preset: ``"lean"`` is ``master_weights=False,
            stochastic_rounding=True, moments="8bit"`` (about 6 bytes a parameter of
            persistent state for a bf16 model). Options given explicitly win over the
            preset's, except ``master_weights=True``, which it refuses.
        decoupled_weight_decay (bool or None): AdamW's decoupled weight decay, as
            torch.optim.Adam's; None (default): False for ``Adam``, True for ``AdamW``. A
            group option, so torch's AdamW checkpoint brings it along.
        step_in_backward (bool): step each param inside the backward, as soon as its
            gradient is complete, and free that gradient there, so that no whole-model
            gradient exists (``step()`` then has nothing left to do). Refused with fp16
            params, a loss scaler, global-norm clipping, FSDP and several ranks (they need
            every gradient first); accumulate micro-batches inside ``accumulating()``.
            Not saved in the state dict. Default: False.

    The step is one of two strategies, chosen per param group: the packed master-weight
    step (``_packed``: fp32 moments, ``ampc.ops.adam_packed``) or, with ``moments`` other
    than ``"fp32"`` or with ``kahan_summation``, the lean step (``_lean``:
    ``ampc.ops.adam_lean``, one pass, no amsgrad; the layouts are in ``ampc.lean_state``).
    """

    _step_supports_amp_scaling = True
    _ampc_supports_clip_coef = True
    _decoupled = False
    _default_weight_decay = 0.0

    def __init__(self, params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
                 lr: float | torch.Tensor = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float | None = None, amsgrad: bool = False, *,
                 maximize: bool = False, foreach: bool | None = None, capturable: bool = False,
                 differentiable: bool = False, fused: bool | None = None,
                 master_weights: bool | None = None, stochastic_rounding: bool | None = None,
                 seed: int = 0, moments: str | None = None, moments_min_numel: int = 4096,
                 kahan_summation: bool = False, state: str | None = None,
                 decoupled_weight_decay: bool | None = None,
                 step_in_backward: bool = False) -> None:
        who = name(self)
        if state is not None:
            if state not in PRESETS:
                raise ValueError(f"{who}: state must be one of {sorted(PRESETS)} or None, "
                                 f"got {state!r}")
            preset = PRESETS[state]
            if master_weights:
                raise ValueError(f"{who}: state={state!r} keeps no master weights; it cannot "
                                 "go with master_weights=True")
            master_weights = preset["master_weights"]
            moments = preset["moments"] if moments is None else moments
            if stochastic_rounding is None and not kahan_summation:
                stochastic_rounding = preset["stochastic_rounding"]
        moments = "fp32" if moments is None else moments
        stochastic_rounding = bool(stochastic_rounding)
        if weight_decay is None:
            weight_decay = self._default_weight_decay
        if isinstance(lr, torch.Tensor) and lr.numel() != 1:
            raise ValueError("Tensor lr must be 1-element")
        if not 0.0 <= lr:
            raise ValueError(f"Invalid learning rate: {lr}")
        if not 0.0 <= eps:
            raise ValueError(f"Invalid epsilon value: {eps}")
        if not 0.0 <= betas[0] < 1.0:
            raise ValueError(f"Invalid beta parameter at index 0: {betas[0]}")
        if not 0.0 <= betas[1] < 1.0:
            raise ValueError(f"Invalid beta parameter at index 1: {betas[1]}")
        if not 0.0 <= weight_decay:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")
        if differentiable:
            raise ValueError(f"ampc.optim.{type(self).__name__} does not support "
                             "differentiable=True; use torch.optim for that")
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                        amsgrad=amsgrad, maximize=maximize, foreach=foreach,
                        capturable=capturable, differentiable=False, fused=fused,
                        master_weights=master_weights,
                        stochastic_rounding=stochastic_rounding, seed=seed, moments=moments,
                        moments_min_numel=moments_min_numel, kahan_summation=kahan_summation,
                        decoupled_weight_decay=self._decoupled if decoupled_weight_decay is None
                        else bool(decoupled_weight_decay))
        super().__init__(params, defaults)
        if step_in_backward:
            hooks = InBackward(self)
            for index in range(len(self.param_groups)):
                hooks.add_group(index)
            self._ampc_in_backward = hooks

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        for group in self.param_groups:
            group.setdefault("master_weights", None)
            group.setdefault("stochastic_rounding", False)
            group.setdefault("seed", 0)
            group.setdefault("moments", "fp32")
            group.setdefault("moments_min_numel", 4096)
            group.setdefault("kahan_summation", False)
            group.setdefault("decoupled_weight_decay", self._decoupled)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        try:
            index = len(self.param_groups) - 1
            _distributed.check_group(name(self), self.param_groups[-1]["params"], index)
            _lean.check_options(name(self), self.param_groups[-1], index)
            if "_ampc_in_backward" in self.__dict__:
                self._ampc_in_backward.add_group(index)
        except ValueError:
            self.param_groups.pop()
            raise

    def relayout(self, *, step_in_backward: bool = False, **layout: Any) -> None:
        """Gives an optimizer made elsewhere (a framework's ``configure_optimizers``), before
        its first step, the state layout its constructor would have made from ``layout``
        (``state``, ``master_weights``, ``moments``, ``moments_min_numel``,
        ``stochastic_rounding``, ``kahan_summation``) and, with ``step_in_backward``, the
        step in the backward. Refused, before anything changes, when the optimizer has
        state, or a group chose a layout option of its own that differs."""
        who = f"{name(self)}.relayout"
        if any(self.state[p] for g in self.param_groups for p in g["params"]):
            raise ValueError(f"{who}: the optimizer has state already; relayout it before its "
                             "first step")
        probe = [torch.zeros(1, requires_grad=True)]
        plain, wanted = type(self)(probe).defaults, type(self)(probe, **layout).defaults
        keys = _convert.LAYOUT_OPTIONS
        for index, group in enumerate(self.param_groups):
            own = [k for k in keys if group[k] != plain[k] and group[k] != wanted[k]]
            if own:
                raise ValueError(f"{who}: param group {index} has {own[0]}="
                                 f"{group[own[0]]!r}, the layout asks {wanted[own[0]]!r}")
            _lean.check_options(who, {**group, **{k: wanted[k] for k in keys}}, index)
        for group in self.param_groups:
            group.update({k: wanted[k] for k in keys})
        if step_in_backward and not self.step_in_backward:
            hooks = InBackward(self)
            for index in range(len(self.param_groups)):
                hooks.add_group(index)
            self._ampc_in_backward = hooks

    @staticmethod
    def _strategy(group):
        """The step a group takes: the lean one, or the packed master-weight one."""
        return _lean if _lean.is_lean(group) else _packed

    def _init_state(self, group, p, master=None):
        """Creates a param's state; ``master`` (fp32) seeds its master weight (or Kahan
        compensation), so that it can start from the fp32 value a 16-bit param was
        rounded from."""
        return self._strategy(group).init_state(self, group, p, master)

    # read with getattr: a framework's wrapper that subclasses this class on the fly
    # (Fabric's) holds the hooks only through its __getattr__
    @property
    def step_in_backward(self) -> bool:
        return getattr(self, "_ampc_in_backward", None) is not None

    def accumulating(self):
        """A context in which backwards keep (accumulate) the gradients instead of stepping
        in the backward; the next backward outside it, or ``step()``, steps on their sum.
        Without ``step_in_backward`` it does nothing."""
        hooks = getattr(self, "_ampc_in_backward", None)
        return contextlib.nullcontext() if hooks is None else hooks.keep_grads()

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Performs one optimization step; returns the closure's loss, if any."""
        loss = None
        if "_ampc_in_backward" in self.__dict__:
            self._ampc_in_backward.check_step()
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        cache = {}          # the scaler's control tensors, moved once a device
        first = 0
        for index, group in enumerate(self.param_groups):
            params = group["params"]
            grads = list(map(_grad, params))
            mask = None
            if _NONE in set(map(type, grads)):
                mask = tuple(map(is_not, grads, repeat(None)))
            if mask is None or any(mask):
                self._strategy(group).step(self, group, index, first, grads, mask, cache)
            first += len(params)
        return loss

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """As torch's, but the state is converted into this optimizer's layout: master
        weights, moments and steps stay fp32 on the param's device (torch's default would
        cast them to the param's dtype), a checkpoint of another layout (torch's AdamW, a
        lean state) is converted, and each group keeps this optimizer's layout options
        (``master_weights``, ``stochastic_rounding``, ``moments``, ``moments_min_numel``,
        ``kahan_summation``; a checkpoint without them, torch's, would otherwise reset them
        while the state holds another layout). Hyperparameters (lr, betas, ..., seed) come
        from the checkpoint, as in torch. A checkpoint that does not fit this optimizer's
        params raises before anything is loaded."""
        _convert.load(self, super().load_state_dict, state_dict)


class AdamW(Adam):
    """AdamW: ``Adam`` with decoupled weight decay (default 0.01); the same arguments."""
    _decoupled = True
    _default_weight_decay = 1e-2
