"""The master-weight step: fp32 moments (and fp32 masters for 16-bit params) packed in one
buffer per (device, dtype, master) so that a step is one ``adam_packed`` call over all of
a group's params; ``adam_master`` per bucket where the packing does not fit (DTensors, a
param whose dtype, shape or contiguity changed since the plan was made)."""
from __future__ import annotations  # "X | None" hints on Python 3.9 too; none evaluated at import

import math
from itertools import repeat
from operator import is_

import torch

from .. import _distributed, ops
from ._codes import has_moments
from ._control import control, hyper, lr_on, name

_ALIGN = 16             # fp32 elements: each param's state starts 64-byte aligned


class Pack:
    """The state of some params packed: one buffer of ``dtype`` in equal sections, one a
    key of ``keys`` (the master-weight step's: fp32 exp_avg, exp_avg_sq, max_exp_avg_sq with
    amsgrad, master with master weights; the lean step's: its two moments), each param's
    state at a multiple of ``align`` elements; with ``scale_keys`` one fp32 buffer of equal
    sections of one value a block of ``align`` elements (8-bit moments' scales); and one
    tensor of step counts. Each param's state entries are views into them, so everything that reads
    ``optimizer.state`` sees torch's per-param tensors."""

    def __init__(self, params, states, keys, dtype=torch.float32, align=_ALIGN, scale_keys=()):
        self.keys = keys
        self.offsets = []
        size = 0
        for p in params:
            self.offsets.append(size)
            size += -(-p.numel() // align) * align
        device = params[0].device
        self.buffer = torch.empty(len(keys) * size, dtype=dtype, device=device)
        self.scales = torch.empty(len(scale_keys) * (size // align), device=device)
        self.steps = torch.empty(len(params), dtype=torch.float32, device=device)
        for t in (self.buffer, self.scales, self.steps):
            t._ampc_packed = True       # for _convert's into()
        self.slot = {id(p): i for i, p in enumerate(params)}
        self.views = {k: [] for k in (*keys, *scale_keys, "step")}
        sections = [(k, self.buffer, j * size, 1) for j, k in enumerate(keys)] + [
            (k, self.scales, j * (size // align), align) for j, k in enumerate(scale_keys)]
        for i, (p, s) in enumerate(zip(params, states)):
            for k, buffer, begin, per in sections:
                # a param's shape, or one scale a block: a state of another size fails the copy
                shape = p.shape if per == 1 else (-(-p.numel() // per),)
                begin += self.offsets[i] // per
                view = buffer[begin:begin + math.prod(shape)].view(shape)
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

    def layout(self, params):
        """The kernels' layout of params (some of this pack's, in its order): each one's
        offset, numel and step index."""
        slots = [self.slot[id(p)] for p in params]
        return torch.tensor([[self.offsets[i], p.numel(), i] for i, p in zip(slots, params)],
                            dtype=torch.int64).reshape(-1)


class _Bucket:
    """The params of one kernel call of a cached plan: with their grads, by position."""

    def __init__(self, indices, params, states, pack):
        self.indices = indices          # positions in the group's params
        self.params = params
        self.pack = pack
        slots = [pack.slot[id(p)] for p in params]
        self.layout = pack.layout(params)
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


def wants_master(group, p):
    if group["master_weights"] is None:
        return p.dtype in (torch.float16, torch.bfloat16)
    return bool(group["master_weights"])


def init_state(opt, group, p, master=None):
    """Creates a param's state; ``master`` (fp32) seeds its master weight, so a master can
    start from the fp32 value a 16-bit param was rounded from."""
    state = opt.state[p]
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
    elif wants_master(group, p):
        state["master"] = p.detach().to(torch.float32, memory_format=torch.contiguous_format,
                                        copy=True)
    return state


def _state_keys(group, master=False):
    return (["step", "exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if group["amsgrad"] else [])
            + (["master"] if master else []))


def _checked_state(opt, group, p, index):
    state = opt.state[p]
    if not has_moments(state):      # a new param, or only a master from prepare()
        return init_state(opt, group, p, state.get("master"))
    for key in _state_keys(group):
        if key not in state:
            raise RuntimeError(f"{name(opt)}: the state of param {index} has no '{key}' (a "
                               "checkpoint of another optimizer or of amsgrad=False?)")
    return state


def _refuse_sparse(opt, g):
    if g.is_sparse:
        raise RuntimeError(f"{name(opt)} does not support sparse gradients")


def step(opt, group, index, first, grads, mask, cache):
    """One step of the group's params that have grads (`first`: the position of the
    group's first param among all the optimizer's, for messages)."""
    params = group["params"]
    if params and _distributed.is_dtensor(params[0]):      # the unpacked path
        live = [(i, p, g) for i, p, g in zip(range(first, first + len(params)), params, grads)
                if g is not None]
        _step_buckets(opt, group, _buckets(opt, group, live), cache)
        return
    plans = opt.__dict__.setdefault("_ampc_plans", {})
    plan = plans.get(index)
    if plan is None or not plan.valid(opt.state, params, mask):
        plan = plans[index] = _plan(opt, group, index, first, grads, mask)
    args = hyper(group)
    for b in plan.buckets:
        device = b.params[0].device
        g = grads if b.whole else list(map(grads.__getitem__, b.indices))
        if b.packed:
            b.packed = ops.adam_packed(
                b.params, g, b.pack.buffer, b.pack.steps, b.layout, lr=lr_on(group, device),
                amsgrad=group["amsgrad"], master="master" in b.pack.keys,
                **args, **control(opt, device, cache))
            if b.packed:
                continue
        # the params or grads changed in a way the packing does not take (dtype,
        # contiguity, device, shape): the per-tensor path, until the plan is rebuilt
        live = [(first + i, p, gi) for i, p, gi in zip(b.indices, b.params, g)]
        _step_buckets(opt, group, _buckets(opt, group, live), cache)


def step_one(opt, group, position, p, g):
    """Steps param p alone (the step in the backward), on its own state tensors (views of
    a pack, or its own until a whole step packs them)."""
    _step_buckets(opt, group, _buckets(opt, group, [(position, p, g)]), {})


def _plan(opt, group, index, first, grads, mask):
    """Packs the state of the params that have grads (with that of the group's other
    params that have state and share their device, dtype and master weights), reusing
    packs that still hold it, and returns the group's plan."""
    params = group["params"]
    packs = opt.__dict__.setdefault("_ampc_packs", {}).setdefault(index, {})
    keyed = {}
    for i, (p, g) in enumerate(zip(params, grads)):
        if g is None:
            continue
        _refuse_sparse(opt, g)
        s = _checked_state(opt, group, p, first + i)
        keyed.setdefault((p.device, p.dtype, "master" in s), []).append(i)
    buckets = []
    for key, indices in keyed.items():
        live = [params[i] for i in indices]
        states = [opt.state[p] for p in live]
        pack = packs.get(key)
        if pack is None or not all(map(pack.holds, live, states)):
            keys = _state_keys(group, key[2])[1:]
            held = [p for p in params if p.device == key[0] and p.dtype == key[1]
                    and all(k in opt.state.get(p, ()) for k in keys + ["step"])
                    and ("master" in opt.state[p]) == key[2]]
            pack = packs[key] = Pack(held, [opt.state[p] for p in held], keys)
        bucket = _Bucket(indices, live, states, pack)
        bucket.whole = len(indices) == len(params)
        buckets.append(bucket)
    return _Plan(opt.state, params, mask, buckets)


def _buckets(opt, group, live):
    """The params that have grads, by (device, dtype, grad dtype, master): one kernel
    call each. Per-param Python work is kept to a few attribute reads."""
    state = opt.state
    buckets = {}
    for i, p, g in live:
        _refuse_sparse(opt, g)
        s = state[p]
        if "exp_avg" not in s:
            s = _checked_state(opt, group, p, i)
        key = (p.device, p.dtype, g.dtype, "master" in s)
        b = buckets.get(key)
        if b is None:
            b = buckets[key] = ([], [], [], [])
        b[0].append(i)
        b[1].append(p)
        b[2].append(g)
        b[3].append(s)
    return buckets


def _state_lists(opt, group, indices, params, states, master):
    """{key: that state tensor of every param}, for the kernel's lists."""
    try:
        return {k: [s[k] for s in states] for k in _state_keys(group, master)}
    except KeyError:                # name the param and the key
        for i, p in zip(indices, params):
            _checked_state(opt, group, p, i)
        raise


def _step_buckets(opt, group, buckets, cache):
    args = hyper(group)
    for (device, _, _, has_master), (indices, params, grads, states) in buckets.items():
        lists = _state_lists(opt, group, indices, params, states, has_master)
        if _distributed.is_dtensor(params[0]):      # the whole group is (add_param_group)
            params, grads, lists = _distributed.local_lists(name(opt), indices, params, grads,
                                                            lists)
        targets = [p if p.is_contiguous() else p.detach().contiguous() for p in params]
        ops.adam_master(
            targets, [g if g.is_contiguous() else g.contiguous() for g in grads],
            lists["exp_avg"], lists["exp_avg_sq"], lists["step"], lr=lr_on(group, device),
            masters=lists.get("master"), max_exp_avg_sqs=lists.get("max_exp_avg_sq"),
            **args, **control(opt, device, cache))
        for p, t in zip(params, targets):
            if t is not p:
                p.copy_(t)
