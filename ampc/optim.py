"""Adam and AdamW with a fused C step and optional fp32 master weights.

``ampc.optim.AdamW`` is a drop-in for ``torch.optim.AdamW`` (same arguments, same state
keys, same results: bit-identical to ``AdamW(fused=True)`` on fp32 params). On fp16 or
bf16 params it keeps fp32 master weights in its state and runs the whole update (grad
widening, unscale, clipping, Adam, the cast back to the model's dtype) as one pass over
memory, 28 bytes per parameter.

Master weights and moments live in ``optimizer.state[p]`` (keys ``master``,
``exp_avg``, ``exp_avg_sq``, ``max_exp_avg_sq``, ``step``), so ``state_dict()`` carries
them, and ``load_state_dict()`` keeps them fp32 (torch's default would cast them to the
param's dtype).

Loss scaling: the optimizers take part in torch's fused-scaling protocol
(``_step_supports_amp_scaling``): a GradScaler sets ``grad_scale`` and ``found_inf`` on
the optimizer before ``step()``, the grads are unscaled inside the update and a step
with inf/nan grads is skipped on the device, with no host sync. ``grad_clip_coef`` (a
1-element tensor set the same way) folds gradient clipping into the update too.
"""
from __future__ import annotations  # "X | None" hints on Python 3.9 too; none evaluated at import

from itertools import chain, repeat
from operator import attrgetter, is_, is_not
from typing import Any, Callable, Iterable

import torch

from . import _distributed, ops
from .lean_state import (CODES, MOMENTS, PRESETS, decode_moments, encode_moments,
                         has_moments, layout_of, moment_keys, scales_fit, shard_blocks,
                         upgrade_codes)

__all__ = ["Adam", "AdamW"]

_MOMENTS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "master")
# How a group's state is laid out: the options a checkpoint's groups may not overwrite,
# since load_state_dict converts the state into this optimizer's layout
_LAYOUT_OPTIONS = ("master_weights", "stochastic_rounding", "moments", "moments_min_numel",
                   "kahan_summation")
_ALIGN = 16             # fp32 elements: each param's state starts 64-byte aligned
_grad = attrgetter("grad")
_NONE = type(None)


class _Pack:
    """The state of some params of one group that share device, dtype and master weights,
    packed: one fp32 buffer of equal sections (exp_avg, exp_avg_sq, max_exp_avg_sq with
    amsgrad, master with master weights) and one tensor of step counts. Each param's
    state entries are views into them, so everything that reads ``optimizer.state`` sees
    torch's per-param tensors."""

    def __init__(self, params, states, keys):
        self.keys = keys
        self.offsets = []
        size = 0
        for p in params:
            self.offsets.append(size)
            size += -(-p.numel() // _ALIGN) * _ALIGN
        device = params[0].device
        self.buffer = torch.empty(len(keys) * size, dtype=torch.float32, device=device)
        self.steps = torch.empty(len(params), dtype=torch.float32, device=device)
        self.buffer._ampc_packed = self.steps._ampc_packed = True      # for _into
        self.slot = {id(p): i for i, p in enumerate(params)}
        self.views = {k: [] for k in keys}
        self.views["step"] = []
        for i, (p, s) in enumerate(zip(params, states)):
            for j, k in enumerate(keys):
                begin = j * size + self.offsets[i]
                view = self.buffer[begin:begin + p.numel()].view(p.shape)
                view.copy_(s[k])
                s[k] = view
                self.views[k].append(view)
            step = self.steps[i]
            step.copy_(s["step"].reshape(()))
            s["step"] = step
            self.views["step"].append(step)

    def holds(self, p, s):
        """Whether p's state entries are still this pack's views."""
        i = self.slot.get(id(p))
        return i is not None and all(s.get(k) is v[i] for k, v in self.views.items())


class _Bucket:
    """The params of one kernel call of a cached plan: with their grads, by position."""

    def __init__(self, indices, params, states, pack):
        self.indices = indices          # positions in the group's params
        self.params = params
        self.pack = pack
        slots = [pack.slot[id(p)] for p in params]
        self.layout = torch.tensor([[pack.offsets[i], p.numel(), i] for i, p in zip(slots, params)],
                                   dtype=torch.int64).reshape(-1)
        self.states = states
        self.views = {k: [v[i] for i in slots] for k, v in pack.views.items()}
        self.whole = None               # set by the plan: the group's params are all here
        self.packed = True              # False once the kernel found they do not fit

    def intact(self):
        """Whether every state entry is still the pack's view (nothing replaced them)."""
        return all(all(map(is_, map(dict.get, self.states, repeat(k)), v))
                   for k, v in self.views.items())


class _Plan:
    """What a group's step does while nothing changes: which params have grads, and the
    buckets of packed params, each one kernel call."""

    def __init__(self, state, params, mask, buckets):
        self.state = state
        self.params = params
        self.count = len(params)
        self.mask = mask
        self.buckets = buckets

    def valid(self, state, params, mask):
        return (state is self.state and params is self.params and len(params) == self.count
                and mask == self.mask and all(b.intact() for b in self.buckets))


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
        seed (int): seed of the stochastic rounding. Default: 0.
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

    With ``moments`` other than ``"fp32"`` or with ``kahan_summation`` the step is
    ``ampc.ops.adam_lean`` (one pass, no amsgrad); the layouts are in ``ampc.lean_state``.
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
                 decoupled_weight_decay: bool | None = None) -> None:
        name = f"ampc.optim.{type(self).__name__}"
        if state is not None:
            if state not in PRESETS:
                raise ValueError(f"{name}: state must be one of {sorted(PRESETS)} or None, "
                                 f"got {state!r}")
            preset = PRESETS[state]
            if master_weights:
                raise ValueError(f"{name}: state={state!r} keeps no master weights; it cannot "
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
            _distributed.check_group(f"ampc.optim.{type(self).__name__}",
                                     self.param_groups[-1]["params"], len(self.param_groups) - 1)
            self._check_lean_options(self.param_groups[-1], len(self.param_groups) - 1)
        except ValueError:
            self.param_groups.pop()
            raise

    # ---- the lean state (ampc.lean_state) ----

    @staticmethod
    def _is_lean(group):
        return group["moments"] != "fp32" or group["kahan_summation"]

    def _check_lean_options(self, group, index):
        """The lean options of a new group, refused (ValueError naming the option) before
        any state exists."""
        name = f"ampc.optim.{type(self).__name__}"
        if group["moments"] not in MOMENTS:
            raise ValueError(f"{name}: moments must be one of {sorted(MOMENTS)}, got "
                             f"{group['moments']!r} (param group {index})")
        n = group["moments_min_numel"]
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"{name}: moments_min_numel must be an int >= 0, got {n!r}")
        if group["kahan_summation"]:
            if group["master_weights"]:
                raise ValueError(f"{name}: kahan_summation=True keeps a bf16 compensation "
                                 "instead of a master weight; it cannot go with "
                                 "master_weights=True")
            if group["stochastic_rounding"]:
                raise ValueError(f"{name}: kahan_summation=True and stochastic_rounding=True "
                                 "are two ways to write the weight without a master: give one")
            for i, p in enumerate(group["params"]):
                if p.dtype == torch.float16:
                    raise ValueError(f"{name}: kahan_summation=True needs torch.bfloat16 "
                                     f"params; param {i} of group {index} is torch.float16")
        if self._is_lean(group) and group["amsgrad"]:
            raise ValueError(f"{name}: amsgrad=True is not supported with moments="
                             f"{group['moments']!r} or kahan_summation=True")

    def _lean_layout(self, group, p):
        """(moments, weight) this optimizer keeps for p: see ampc.lean_state."""
        moments = group["moments"]
        if moments != "fp32" and (p.numel() < group["moments_min_numel"] or p.dim() < 2):
            moments = "fp32"
        if group["kahan_summation"]:    # an fp32 param (a norm prepare kept) is its own weight
            return moments, "none" if p.dtype == torch.float32 else "kahan"
        return moments, "master" if self._wants_master(group, p) else "none"

    def _init_lean_state(self, group, p, master=None):
        state = self.state[p]
        moments, weight = self._lean_layout(group, p)
        if weight == "kahan" and p.dtype != torch.bfloat16:
            raise ValueError(f"ampc.optim.{type(self).__name__}: kahan_summation=True needs "
                             f"torch.bfloat16 (or float32) params, got {p.dtype}")
        zeros = lambda dt: torch.zeros_like(p, dtype=dt,  # noqa: E731
                                            memory_format=torch.contiguous_format)
        state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
        m_key, v_key = (CODES["exp_avg"], CODES["exp_avg_sq"]) if moments == "8bit" else \
            ("exp_avg", "exp_avg_sq")
        state[m_key] = zeros(MOMENTS[moments])
        state[v_key] = zeros(MOMENTS[moments])
        if moments == "8bit" and _distributed.is_dtensor(p):     # per-shard blocks
            name = f"ampc.optim.{type(self).__name__}"
            state["exp_avg_scale"] = _distributed.lean_scales(name, p, ops.QBLOCK)
            state["exp_avg_sq_scale"] = _distributed.lean_scales(name, p, ops.QBLOCK)
        elif moments == "8bit":
            blocks = -(-p.numel() // ops.QBLOCK)
            state["exp_avg_scale"] = torch.zeros(blocks, device=p.device)
            state["exp_avg_sq_scale"] = torch.zeros(blocks, device=p.device)
        if weight == "master":
            src = p if master is None else master
            state["master"] = src.detach().to(device=p.device, dtype=torch.float32,
                                              memory_format=torch.contiguous_format, copy=True)
        elif weight == "kahan":
            # the fp32 value p was rounded from, when known, is kept in the compensation
            state["compensation"] = (zeros(torch.bfloat16) if master is None else
                                     (master.detach().to(p.device, torch.float32)
                                      - p.detach().float()).to(torch.bfloat16))
        return state

    def _step_lean(self, group, live, control):
        """One adam_lean call per (device, dtypes, layout) of the params with grads."""
        name = f"ampc.optim.{type(self).__name__}"
        state = self.state
        fresh = [(i, p) for i, p, _ in live if not has_moments(state[p])]
        for i, p in fresh:      # every check before any allocation
            if group["kahan_summation"] and p.dtype == torch.float16:
                raise ValueError(f"{name}: kahan_summation=True needs torch.bfloat16 params; "
                                 f"param {i} is torch.float16")
        buckets = {}
        for i, p, g in live:
            if g.is_sparse:
                raise RuntimeError(f"{name} does not support sparse gradients")
            s = state[p]
            if not has_moments(s):
                s = self._init_lean_state(group, p, s.get("master"))
            moments, weight = layout_of(s)
            key = (p.device, p.dtype, g.dtype, moments, weight)
            buckets.setdefault(key, []).append((i, p, g, s))
        beta1, beta2 = (float(b) for b in group["betas"])
        seed = int(group["seed"]) if group["stochastic_rounding"] else 0
        for (device, _, _, moments, weight), items in buckets.items():
            indices = [i for i, _, _, _ in items]
            params = [p for _, p, _, _ in items]
            grads = [g for _, _, g, _ in items]
            states = [s for _, _, _, s in items]
            q8 = moments == "8bit"
            m_key, v_key = moment_keys(states[0])
            keys = ["step", m_key, v_key] + (
                ["master"] if weight == "master" else ["compensation"] if weight == "kahan"
                else [])
            lists = {k: [s[k] for s in states] for k in keys}
            if q8:
                lists["exp_avg_scale"] = [s["exp_avg_scale"] for s in states]
                lists["exp_avg_sq_scale"] = [s["exp_avg_sq_scale"] for s in states]
            if _distributed.is_dtensor(params[0]):      # the kernel on the local shards
                scales = {k: lists.pop(k) for k in ("exp_avg_scale", "exp_avg_sq_scale")
                          if k in lists}
                params_d = params
                params, grads, lists = _distributed.local_lists(name, indices, params, grads,
                                                                lists)
                for k, v in scales.items():
                    lists[k] = [_distributed.local_scales(name, i, p, t, ops.QBLOCK)
                                for i, p, t in zip(indices, params_d, v)]
            grads = [g if g.is_contiguous() else g.contiguous() for g in grads]
            get = lists.__getitem__
            inv_scale, clip, found_inf = self._control(device, control)
            lr = group["lr"]
            if isinstance(lr, torch.Tensor) and lr.device != device:
                lr = lr.to(device, non_blocking=True)
            targets = [p if p.is_contiguous() else p.detach().contiguous() for p in params]
            ops.adam_lean(
                targets, grads, get(m_key), get(v_key), get("step"), lr=lr,
                masters=get("master") if weight == "master" else None,
                compensations=get("compensation") if weight == "kahan" else None,
                exp_avg_scales=get("exp_avg_scale") if q8 else None,
                exp_avg_sq_scales=get("exp_avg_sq_scale") if q8 else None,
                beta1=beta1, beta2=beta2, eps=group["eps"], weight_decay=group["weight_decay"],
                decoupled=group["decoupled_weight_decay"], maximize=group["maximize"],
                inv_scale=inv_scale,
                clip_coef=clip, found_inf=found_inf, stochastic=group["stochastic_rounding"],
                seed=seed)
            for p, t in zip(params, targets):
                if t is not p:
                    p.copy_(t)

    # ---- state ----

    def _wants_master(self, group, p):
        if group["master_weights"] is None:
            return p.dtype in (torch.float16, torch.bfloat16)
        return bool(group["master_weights"])

    def _init_state(self, group, p, master=None):
        """Creates a param's state; ``master`` (fp32) seeds its master weight, so a
        master can start from the fp32 value a 16-bit param was rounded from."""
        if self._is_lean(group):
            return self._init_lean_state(group, p, master)
        state = self.state[p]
        # zeros_like: a DTensor param gets DTensor moments, sharded like it
        zeros = lambda: torch.zeros_like(p, dtype=torch.float32,  # noqa: E731
                                         memory_format=torch.contiguous_format)
        state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
        state["exp_avg"] = zeros()
        state["exp_avg_sq"] = zeros()
        if group["amsgrad"]:
            state["max_exp_avg_sq"] = zeros()
        if master is not None:
            state["master"] = master.detach().to(device=p.device, dtype=torch.float32,
                                                 memory_format=torch.contiguous_format)
        elif self._wants_master(group, p):
            state["master"] = p.detach().to(torch.float32, memory_format=torch.contiguous_format,
                                            copy=True)
        return state

    def _checked_state(self, group, p, index):
        state = self.state[p]
        if not has_moments(state):      # a new param, or only a master from prepare()
            return self._init_state(group, p, state.get("master"))
        for key in self._state_keys(group):
            if key not in state:
                raise RuntimeError(f"ampc.optim.{type(self).__name__}: the state of param "
                                   f"{index} has no '{key}' (a checkpoint of another "
                                   f"optimizer or of amsgrad=False?)")
        return state

    # ---- the step ----

    def _control(self, device, cache):
        """inv_scale, clip_coef and found_inf on `device` (moved without a host sync)."""
        if device not in cache:
            scale = getattr(self, "grad_scale", None)
            clip = getattr(self, "grad_clip_coef", None)
            found = getattr(self, "found_inf", None)
            inv = None
            if scale is not None:
                # torch's unscale_ uses this very value, so folding it in gives the same grads
                inv = scale.double().reciprocal().float()
            cache[device] = tuple(None if t is None else
                                  t.to(device=device, dtype=torch.float32, non_blocking=True)
                                  .reshape(1)
                                  for t in (inv, clip, found))
        return cache[device]

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Performs one optimization step; returns the closure's loss, if any."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        control = {}
        first = 0
        plans = self.__dict__.setdefault("_ampc_plans", {})
        for index, group in enumerate(self.param_groups):
            params = group["params"]
            grads = list(map(_grad, params))
            mask = None
            if _NONE in set(map(type, grads)):
                mask = tuple(map(is_not, grads, repeat(None)))
                if not any(mask):
                    first += len(params)
                    continue
            if self._is_lean(group):
                live = [(i, p, g) for i, p, g in zip(range(first, first + len(params)),
                                                     params, grads) if g is not None]
                self._step_lean(group, live, control)
                first += len(params)
                continue
            if params and _distributed.is_dtensor(params[0]):    # the unpacked path
                live = [(i, p, g) for i, p, g in zip(range(first, first + len(params)),
                                                     params, grads) if g is not None]
                self._step_group(group, self._buckets(group, live), control)
                first += len(params)
                continue
            plan = plans.get(index)
            if plan is None or not plan.valid(self.state, params, mask):
                plan = plans[index] = self._plan(group, index, first, grads, mask)
            self._step_plan(group, plan, grads, first, control)
            first += len(params)
        return loss

    def _plan(self, group, index, first, grads, mask):
        """Packs the state of the params that have grads (with that of the group's other
        params that have state and share their device, dtype and master weights), reusing
        packs that still hold it, and returns the group's plan."""
        params = group["params"]
        packs = self.__dict__.setdefault("_ampc_packs", {}).setdefault(index, {})
        keyed = {}
        for i, (p, g) in enumerate(zip(params, grads)):
            if g is None:
                continue
            if g.is_sparse:
                raise RuntimeError(f"ampc.optim.{type(self).__name__} does not support "
                                   "sparse gradients")
            s = self._checked_state(group, p, first + i)
            keyed.setdefault((p.device, p.dtype, "master" in s), []).append(i)
        buckets = []
        for key, indices in keyed.items():
            live = [params[i] for i in indices]
            states = [self.state[p] for p in live]
            pack = packs.get(key)
            if pack is None or not all(map(pack.holds, live, states)):
                keys = self._state_keys(group, key[2])[1:]
                held = [p for p in params if p.device == key[0] and p.dtype == key[1]
                        and all(k in self.state.get(p, ()) for k in keys + ["step"])
                        and ("master" in self.state[p]) == key[2]]
                pack = packs[key] = _Pack(held, [self.state[p] for p in held], keys)
            bucket = _Bucket(indices, live, states, pack)
            bucket.whole = len(indices) == len(params)
            buckets.append(bucket)
        return _Plan(self.state, params, mask, buckets)

    def _step_plan(self, group, plan, grads, first, control):
        beta1, beta2 = (float(b) for b in group["betas"])
        seed = int(group["seed"]) if group["stochastic_rounding"] else 0
        lr = group["lr"]
        for b in plan.buckets:
            device = b.params[0].device
            g = grads if b.whole else list(map(grads.__getitem__, b.indices))
            if b.packed:
                inv_scale, clip, found_inf = self._control(device, control)
                lr_d = lr.to(device, non_blocking=True) if (
                    isinstance(lr, torch.Tensor) and lr.device != device) else lr
                b.packed = ops.adam_packed(
                    b.params, g, b.pack.buffer, b.pack.steps, b.layout, lr=lr_d,
                    amsgrad=group["amsgrad"], master="master" in b.pack.keys,
                    beta1=beta1, beta2=beta2, eps=group["eps"],
                    weight_decay=group["weight_decay"], decoupled=group["decoupled_weight_decay"],
                    maximize=group["maximize"], inv_scale=inv_scale, clip_coef=clip,
                    found_inf=found_inf, stochastic=group["stochastic_rounding"], seed=seed)
                if b.packed:
                    continue
            # the params or grads changed in a way the packing does not take (dtype,
            # contiguity, device, shape): the per-tensor path, until the plan is rebuilt
            live = [(first + i, p, gi) for i, p, gi in zip(b.indices, b.params, g)]
            self._step_group(group, self._buckets(group, live), control)

    def _buckets(self, group, live):
        """The params that have grads, by (device, dtype, grad dtype, master): one kernel
        call each. Per-param Python work is kept to a few attribute reads."""
        state = self.state
        buckets = {}
        for i, p, g in live:
            if g.is_sparse:
                raise RuntimeError(f"ampc.optim.{type(self).__name__} does not support "
                                   "sparse gradients")
            s = state[p]
            if "exp_avg" not in s:
                s = self._checked_state(group, p, i)
            key = (p.device, p.dtype, g.dtype, "master" in s)
            b = buckets.get(key)
            if b is None:
                b = buckets[key] = ([], [], [], [])
            b[0].append(i)
            b[1].append(p)
            b[2].append(g)
            b[3].append(s)
        return buckets

    @staticmethod
    def _state_keys(group, master=False):
        return (["step", "exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if group["amsgrad"] else [])
                + (["master"] if master else []))

    def _state_lists(self, group, indices, params, states, master):
        """{key: that state tensor of every param}, for the kernel's lists."""
        try:
            return {k: [s[k] for s in states] for k in self._state_keys(group, master)}
        except KeyError:                # name the param and the key
            for i, p in zip(indices, params):
                self._checked_state(group, p, i)
            raise

    def _step_group(self, group, buckets, control):
        beta1, beta2 = (float(b) for b in group["betas"])
        # the kernel mixes each param's step count into the seed, on the device
        seed = int(group["seed"]) if group["stochastic_rounding"] else 0
        for (device, _, _, has_master), (indices, params, grads, states) in buckets.items():
            lists = self._state_lists(group, indices, params, states, has_master)
            if _distributed.is_dtensor(params[0]):      # the whole group is (add_param_group)
                params, grads, lists = _distributed.local_lists(
                    f"ampc.optim.{type(self).__name__}", indices, params, grads, lists)
            inv_scale, clip, found_inf = self._control(device, control)
            lr = group["lr"]
            if isinstance(lr, torch.Tensor) and lr.device != device:
                lr = lr.to(device, non_blocking=True)
            targets = [p if p.is_contiguous() else p.detach().contiguous() for p in params]
            ops.adam_master(
                targets, [g if g.is_contiguous() else g.contiguous() for g in grads],
                lists["exp_avg"], lists["exp_avg_sq"], lists["step"], lr=lr,
                masters=lists.get("master"), max_exp_avg_sqs=lists.get("max_exp_avg_sq"),
                beta1=beta1, beta2=beta2, eps=group["eps"], weight_decay=group["weight_decay"],
                decoupled=group["decoupled_weight_decay"], maximize=group["maximize"],
                inv_scale=inv_scale,
                clip_coef=clip, found_inf=found_inf,
                stochastic=group["stochastic_rounding"], seed=seed)
            for p, t in zip(params, targets):
                if t is not p:
                    p.copy_(t)

    # ---- checkpoints ----

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
        name = f"ampc.optim.{type(self).__name__}.load_state_dict"
        saved_ids = list(chain.from_iterable(g["params"] for g in state_dict["param_groups"]))
        saved_state = {k: upgrade_codes(v) if isinstance(v, dict) else v
                       for k, v in state_dict["state"].items()}
        groups = {id(p): g for g in self.param_groups for p in g["params"]}
        params = list(chain.from_iterable(g["params"] for g in self.param_groups))
        layouts = [{k: g[k] for k in _LAYOUT_OPTIONS} for g in self.param_groups]
        for index, (saved_group, layout) in enumerate(zip(state_dict["param_groups"], layouts)):
            # the group as it will step: the checkpoint's hyperparameters, our layout
            self._check_lean_options({**self.defaults, **saved_group, **layout,
                                      "params": self.param_groups[index]["params"]}, index)
        for i, (sid, p) in enumerate(zip(saved_ids, params)):
            saved = saved_state.get(sid, {})
            self._check_saved(name, i, p, groups[id(p)], saved)
        before = {id(p): dict(self.state[p]) for p in params if p in self.state}
        super().load_state_dict(state_dict)
        for group, layout in zip(self.param_groups, layouts):
            group.update(layout)
        for sid, p in zip(saved_ids, params):
            saved = saved_state.get(sid)
            if saved is None:
                continue
            group = groups[id(p)]
            state = self.state[p]
            old = before.get(id(p), {})
            if self._is_lean(group):
                self._load_lean(state, group, p, saved, _held_weight(p, old))
                continue
            if has_moments(saved) and layout_of(saved)[0] != "fp32":
                saved = dict(saved)     # a lean checkpoint into fp32 moments: decoded
                saved["exp_avg"], saved["exp_avg_sq"] = decode_moments(saved)
            if "compensation" in saved:
                saved = dict(saved)     # Kahan's weight, param + compensation, as the master
                saved["master"] = p.detach().float() + saved["compensation"].to(p.device).float()
            for key in _LEAN_ONLY:
                state.pop(key, None)
            if "master" not in saved and self._wants_master(group, p):
                saved = dict(saved)     # a state without masters (torch's): from the weights
                held = _held_weight(p, old)
                saved["master"] = p.detach().float() if held is None else held
            for key in _MOMENTS:
                if key in saved:
                    state[key] = _into(old.get(key), saved[key].to(
                        device=p.device, dtype=torch.float32,
                        memory_format=torch.contiguous_format, copy=True))
            if "step" in saved:
                state["step"] = _into(old.get("step"), _step_of(saved, p))

    def _check_saved(self, name, i, p, group, saved):
        """A checkpoint entry that this optimizer could misread is refused (ValueError)
        before anything is loaded; every other layout converts."""
        for key in _MOMENTS + tuple(CODES.values()) + ("compensation",):
            value = saved.get(key)
            if value is not None and (not isinstance(value, torch.Tensor)
                                      or value.shape != p.shape):
                got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value)
                raise ValueError(f"{name}: '{key}' of param {i} has shape {got}, but the "
                                 f"param has shape {tuple(p.shape)}: the checkpoint is "
                                 "of another model or optimizer")
        if not has_moments(saved):
            return
        moments, weight = layout_of(saved)
        if moments == "?":
            key = moment_keys(saved)[0]
            raise ValueError(f"{name}: '{key}' of param {i} is {saved[key].dtype}, "
                             "not a moments layout ampc knows (float32, bfloat16, uint8 codes)")
        if moments == "8bit":
            blocks = -(-p.numel() // ops.QBLOCK)
            for key in ("exp_avg_scale", "exp_avg_sq_scale"):
                if not scales_fit(saved.get(key), p.shape):
                    raise ValueError(f"{name}: param {i} has 8-bit moments but its '{key}' is "
                                     f"not {blocks} scales (nor those of a sharding along "
                                     "dim 0): the checkpoint is damaged or of another layout")
        if self._is_lean(group) and _distributed.is_dtensor(p):
            self._check_saved_sharded(name, i, p, group, saved)
        if self._is_lean(group):
            want = self._lean_layout(group, p)[1]
        else:
            want = "master" if group["master_weights"] is not False else "none"
        if weight == "master" and want == "none":
            raise ValueError(f"{name}: param {i} has a master weight in the checkpoint, but "
                             "this optimizer was made with master_weights=False")
        if weight == "kahan" and want == "none":
            raise ValueError(f"{name}: param {i} has a Kahan compensation in the checkpoint, "
                             "but this optimizer keeps the weight in neither a master nor a "
                             "compensation: make it with kahan_summation=True (or "
                             "master_weights=True) to load it")
        if want == "kahan" and p.dtype == torch.float16:
            raise ValueError(f"{name}: kahan_summation=True needs torch.bfloat16 params; "
                             f"param {i} is torch.float16")

    def _check_saved_sharded(self, name, i, p, group, saved):
        """The lean state of a DTensor param loads only as it was saved: the same moments
        kind, each tensor a DTensor laid out like this optimizer's (DCP reshards the
        elementwise tensors; per-shard 8-bit scales of another sharding are refused)."""
        moments = self._lean_layout(group, p)[0]
        if layout_of(saved)[0] != moments:
            raise ValueError(f"{name}: param {i} is a DTensor with {moments} moments, but the "
                             f"checkpoint holds {layout_of(saved)[0]} moments; sharded lean "
                             "state loads only in its own layout (load it into a single "
                             "process to convert it)")
        for key in moment_keys(saved) + ("master", "compensation"):
            if key in saved and not _distributed.is_dtensor(saved[key]):
                raise ValueError(f"{name}: '{key}' of param {i} is a plain tensor but the param "
                                 "is a DTensor (load sharded state with "
                                 "torch.distributed.checkpoint)")
        if moments == "8bit":
            shards = p.device_mesh.size()
            for key in ("exp_avg_scale", "exp_avg_sq_scale"):
                t = saved[key]
                want = (shards, shard_blocks(p.shape, shards)) if len(p.placements) == 1 and \
                    p.placements[0].is_shard(0) else (-(-p.numel() // ops.QBLOCK),)
                if not _distributed.is_dtensor(t) or tuple(t.shape) != want:
                    raise ValueError(f"{name}: '{key}' of param {i} is not the per-shard "
                                     f"scales of this sharding (shape {want}, a DTensor): a "
                                     "checkpoint of another number of ranks holds other "
                                     "blocks; load it into a single process, which "
                                     "converts it (docs/lean_state.md)")

    def _load_lean(self, state, group, p, saved, held):
        """saved (any layout, checked) converted into this optimizer's layout for p; held
        is the fp32 weight this optimizer kept for p (see _held_weight), or None."""
        moments, weight = self._lean_layout(group, p)
        state.clear()
        state["step"] = _step_of(saved, p)
        dtensor = _distributed.is_dtensor(p)
        if has_moments(saved):
            if layout_of(saved)[0] == moments and (
                    moments != "8bit" or dtensor
                    or saved["exp_avg_scale"].shape == (-(-p.numel() // ops.QBLOCK),)):
                # the same layout: the tensors as saved
                for key in moment_keys(saved) + ("exp_avg_scale", "exp_avg_sq_scale"):
                    if key in saved:
                        state[key] = saved[key].to(p.device, copy=True)
            else:
                m, v = decode_moments({k: t.to(p.device) if isinstance(t, torch.Tensor) else t
                                       for k, t in saved.items()})
                state.update(encode_moments(m, v, moments))
        else:
            self._init_lean_state(group, p)
            state["step"] = _step_of(saved, p)
        wsaved = layout_of(saved)[1]
        if weight == "master":
            if wsaved == "master":
                state["master"] = saved["master"].to(p.device, torch.float32, copy=True)
            elif wsaved == "kahan":
                state["master"] = p.detach().float() + saved["compensation"].to(p.device).float()
            else:
                state["master"] = p.detach().float().clone() if held is None else held.clone()
        elif weight == "kahan":
            if wsaved == "kahan":
                state["compensation"] = saved["compensation"].to(p.device, torch.bfloat16,
                                                                 copy=True)
            elif wsaved == "master":
                master = saved["master"].to(p.device, torch.float32)
                state["compensation"] = (master - p.detach().float()).to(torch.bfloat16)
            elif held is not None:
                state["compensation"] = (held - p.detach().float()).to(torch.bfloat16)
            else:
                state["compensation"] = torch.zeros_like(p, dtype=torch.bfloat16)


_LEAN_ONLY = ("exp_avg_scale", "exp_avg_sq_scale", "compensation") + tuple(CODES.values())


def _held_weight(p, old):
    """The fp32 weight the state `old` kept for p (its master, or p + its compensation:
    prepare's masters are the fp32 values the weights were cast from), when it still
    rounds to p; None when it does not (new weights were loaded since) or there is none.
    A checkpoint without a weight of its own (torch's AdamW) keeps it, so converting does
    not round the weights to 16 bits."""
    if _distributed.is_dtensor(p):
        return None
    if "master" in old:
        held = old["master"].detach().float()
    elif "compensation" in old:
        held = p.detach().float() + old["compensation"].float()
    else:
        return None
    if held.shape != p.shape or not torch.equal(held.to(p.dtype), p.detach()):
        return None
    return held.clone()


def _step_of(saved, p):
    step = saved.get("step", 0.0)
    step = step if isinstance(step, torch.Tensor) else torch.tensor(float(step))
    return step.to(device=p.device, dtype=torch.float32).reshape(())


def _into(view, value):
    """value copied into the packed state's view it replaces (so the packing survives a
    load), or value itself where there is no such view."""
    if (isinstance(view, torch.Tensor) and getattr(view._base, "_ampc_packed", False)
            and view.shape == value.shape
            and view.dtype == value.dtype and view.device == value.device):
        return view.copy_(value)
    return value


class AdamW(Adam):
    """AdamW: ``Adam`` with decoupled weight decay (default 0.01); the same arguments."""
    _decoupled = True
    _default_weight_decay = 1e-2
