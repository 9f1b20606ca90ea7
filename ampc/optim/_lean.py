"""The lean step: 8-bit or bf16 moments, and the weight kept by a master, a bf16 Kahan
compensation, or the param alone (stochastic rounding), in one ``adam_lean`` call per
(device, dtypes, layout) of the params with grads; where the param is its own weight, the
small params' state is packed and stepped by one ``adam_lean_packed`` call (PACK_MAX). The
layouts are in ``_codes``."""
from __future__ import annotations  # "X | None" hints on Python 3.9 too; none evaluated at import

from itertools import repeat
from operator import attrgetter, is_

import torch

from .. import _distributed, ops
from . import _shards
from ._codes import MOMENTS, blocks, has_moments, layout_of, moment_keys, moment_names
from ._control import control, hyper, lr_on, name
from ._packed import Pack, wants_master

_DTYPE, _LAYOUT = attrgetter("dtype"), attrgetter("layout")
_STRIDED = {torch.strided}
# Params of at most this many elements keep their state packed (one adam_lean_packed call
# takes two tensor lists, not eight): on small tensors the per-tensor host work is a fair
# share of the step. Larger ones keep tensors of their own, so that packing (a copy) never
# holds a large state twice.
PACK_MAX = 1 << 16

# The one-word presets of Adam(state=...): the options each one sets.
PRESETS = {
    # bf16 weights written by stochastic rounding, 8-bit moments: about 6 B a parameter
    "lean": dict(master_weights=False, stochastic_rounding=True, moments="8bit"),
}


def is_lean(group):
    return group["moments"] != "fp32" or group["kahan_summation"]


def check_options(who, group, index):
    """The lean options of a group, refused (ValueError naming the option) before any
    state exists."""
    if group["moments"] not in MOMENTS:
        raise ValueError(f"{who}: moments must be one of {sorted(MOMENTS)}, got "
                         f"{group['moments']!r} (param group {index})")
    n = group["moments_min_numel"]
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"{who}: moments_min_numel must be an int >= 0, got {n!r}")
    if group["kahan_summation"]:
        if group["master_weights"]:
            raise ValueError(f"{who}: kahan_summation=True keeps a bf16 compensation instead "
                             "of a master weight; it cannot go with master_weights=True")
        if group["stochastic_rounding"]:
            raise ValueError(f"{who}: kahan_summation=True and stochastic_rounding=True are "
                             "two ways to write the weight without a master: give one")
        for i, p in enumerate(group["params"]):
            if p.dtype == torch.float16:
                raise ValueError(f"{who}: kahan_summation=True needs torch.bfloat16 params; "
                                 f"param {i} of group {index} is torch.float16")
    if is_lean(group) and group["amsgrad"]:
        raise ValueError(f"{who}: amsgrad=True is not supported with moments="
                         f"{group['moments']!r} or kahan_summation=True")


def layout(group, p):
    """(moments, weight) the group keeps for p: see ``_codes``."""
    moments = group["moments"]
    if moments != "fp32" and (p.numel() < group["moments_min_numel"] or p.dim() < 2):
        moments = "fp32"
    if group["kahan_summation"]:    # an fp32 param (a norm prepare kept) is its own weight
        return moments, "none" if p.dtype == torch.float32 else "kahan"
    return moments, "master" if wants_master(group, p) else "none"


def new_moments(who, p, moments) -> dict:
    """A param's zero step and moments of kind `moments` (with their scales)."""
    zeros = lambda dt: torch.zeros_like(p, dtype=dt,  # noqa: E731
                                        memory_format=torch.contiguous_format)
    m_key, v_key = moment_names(moments)
    state = {"step": torch.zeros((), dtype=torch.float32, device=p.device),
             m_key: zeros(MOMENTS[moments]), v_key: zeros(MOMENTS[moments])}
    if moments == "8bit" and _distributed.is_dtensor(p):     # per-shard blocks
        state["exp_avg_scale"] = _shards.lean_scales(who, p)
        state["exp_avg_sq_scale"] = _shards.lean_scales(who, p)
    elif moments == "8bit":
        state["exp_avg_scale"] = torch.zeros(blocks(p.numel()), device=p.device)
        state["exp_avg_sq_scale"] = torch.zeros(blocks(p.numel()), device=p.device)
    return state


def init_state(opt, group, p, master=None):
    """Creates a param's lean state; ``master`` (fp32), when known, is the value p was
    rounded from: it seeds the master or the compensation."""
    state = opt.state[p]
    moments, weight = layout(group, p)
    if weight == "kahan" and p.dtype != torch.bfloat16:
        raise ValueError(f"{name(opt)}: kahan_summation=True needs torch.bfloat16 (or float32) "
                         f"params, got {p.dtype}")
    state.update(new_moments(name(opt), p, moments))
    if weight == "master":
        src = p if master is None else master
        state["master"] = src.detach().to(device=p.device, dtype=torch.float32,
                                          memory_format=torch.contiguous_format, copy=True)
    elif weight == "kahan":
        # the fp32 value p was rounded from, when known, is kept in the compensation
        state["compensation"] = (torch.zeros_like(p, dtype=torch.bfloat16) if master is None else
                                 (master.detach().to(p.device, torch.float32)
                                  - p.detach().float()).to(torch.bfloat16))
    return state


def step(opt, group, index, first, grads, mask, cache):
    """One adam_lean call per (device, dtypes, layout) of the params with grads (its small
    params packed, see PACK_MAX), from a plan cached while the params, their grads'
    presence and their state entries stay the same (the per-param work of finding the
    calls is most of a step's host time on many small tensors)."""
    params = group["params"]
    plans = opt.__dict__.setdefault("_ampc_lean_plans", {})
    plan = plans.get(index)
    split = None if plan is None else plan.grads_of(opt.state, params, mask, grads)
    if split is not None:
        args = hyper(group)
        for b, g in zip(plan.buckets, split):
            _call(opt, group, b, g, cache, args)
        return
    live = [(i, p, g) for i, p, g in zip(range(first, first + len(grads)), params, grads)
            if g is not None]
    sharded = _distributed.is_dtensor(params[0])
    packs = None if sharded else opt.__dict__.setdefault("_ampc_lean_packs", {})
    buckets = _buckets(opt, group, live, packs, index)
    _call_buckets(opt, group, buckets, cache, hyper(group))
    if not sharded:         # shards are looked up each step
        plans[index] = _Plan(opt.state, params, mask, buckets, first)


def step_one(opt, group, position, p, g):
    """Steps param p alone (the step in the backward). Its random bits (stochastic rounding,
    bf16 moments, the 8-bit second moment's codes) draw from a stream of its own: a
    one-param call would otherwise start every param's at 0."""
    args = hyper(group)
    args["seed"] = stream_seed(args["seed"], position + 1)
    _step_live(opt, group, [(position, p, g)], {}, args)


# a packed call beside an unpacked one: a stream past any param's position
PACKED_STREAM = 999983


def stream_seed(seed, stream):
    """The seed of random stream `stream` (>= 1) beside the group's own `seed`: a param
    stepped alone takes its position + 1, a packed call beside an unpacked one
    PACKED_STREAM."""
    return (seed * 1000003 + stream) % (1 << 62)


def _step_live(opt, group, live, cache, args):
    _call_buckets(opt, group, _buckets(opt, group, live), cache, args)


class _Bucket:
    """The params of one adam_lean call, with their state dicts and state tensors."""

    def __init__(self, indices, params, grads, states, moments, weight):
        self.indices = indices
        self.params = params
        self.grads = grads          # of the step that made the bucket; a plan passes its own
        self.grad_dtype, self.dtype, self.device = grads[0].dtype, params[0].dtype, params[0].device
        self.states = states
        self.m_key, self.v_key = moment_keys(states[0])
        keys = ["step", self.m_key, self.v_key] + (
            ["master"] if weight == "master" else ["compensation"] if weight == "kahan" else [])
        self.scale_keys = ["exp_avg_scale", "exp_avg_sq_scale"] if moments == "8bit" else []
        self.lists = {k: [s[k] for s in states] for k in keys + self.scale_keys}
        self.slots = None           # set by a plan: the params' places in the group's list
        self.whole = False          # set by a plan: they are all the group's params
        self.pack = None            # the Pack holding their state, when packed
        self.layout = None          # its layout of these params
        self.stream = 0             # packed beside an unpacked call: its random bits' stream


def _buckets(opt, group, live, packs=None, index=None):
    """The calls of a step on `live` (position, param, grad): every check before any
    state is made, then each param's state, grouped by device, dtypes and layout; with
    `packs` (the optimizer's, by group `index` and group key) the small params of a group
    whose params are their own weights are packed."""
    who = name(opt)
    state = opt.state
    for i, p, _ in live:        # every check before any allocation
        if not has_moments(state[p]) and group["kahan_summation"] and p.dtype == torch.float16:
            raise ValueError(f"{who}: kahan_summation=True needs torch.bfloat16 params; "
                             f"param {i} is torch.float16")
    keyed = {}
    for i, p, g in live:
        if g.is_sparse:
            raise RuntimeError(f"{who} does not support sparse gradients")
        s = state[p]
        if not has_moments(s):
            s = init_state(opt, group, p, s.get("master"))
        moments, weight = layout_of(s)
        key = (p.device, p.dtype, g.dtype, moments, weight)
        keyed.setdefault(key, []).append((i, p, g, s))
    buckets = []
    for key, items in keyed.items():
        small = [] if packs is None or key[4] != "none" else [
            item for item in items if item[1].numel() <= PACK_MAX]
        rest = [item for item in items if item[1].numel() > PACK_MAX] if small else items
        if small:
            buckets.append(_packed_bucket(packs, (index, key), small, bool(rest)))
        if rest:
            buckets.append(_Bucket(*map(list, zip(*rest)), key[3], key[4]))
    return buckets


def _packed_bucket(packs, key, items, beside):
    """The bucket of `items` (position, param, grad, state) with their state in a Pack:
    the one kept under `key` where it still holds exactly them, else a new one."""
    indices, params, grads, states = map(list, zip(*items))
    moments = key[1][3]
    pack = packs.get(key)
    if pack is None or len(pack.slot) != len(params) or not all(map(pack.holds, params, states)):
        m_key, v_key = moment_keys(states[0])
        q8 = moments == "8bit"
        pack = packs[key] = Pack(
            params, states, [m_key, v_key], dtype=MOMENTS[moments], align=ops.QBLOCK if q8 else 16,
            scale_keys=["exp_avg_scale", "exp_avg_sq_scale"] if q8 else ())
    b = _Bucket(indices, params, grads, states, moments, "none")
    b.pack, b.layout, b.stream = pack, pack.layout(params), int(beside)
    return b


def _call_buckets(opt, group, buckets, cache, args):
    for b in buckets:
        _call(opt, group, b, b.grads, cache, args)
        b.grads = None          # a cached plan must not keep a step's grads alive


def _call(opt, group, b, grads, cache, args):
    who = name(opt)
    params, device = b.params, b.device
    if b.pack is not None:
        if b.stream:        # its random bits are not those of the unpacked call's elements
            args = dict(args, seed=stream_seed(args["seed"], PACKED_STREAM))
        if ops.adam_lean_packed(params, grads, b.pack.buffer, b.pack.scales, b.pack.steps,
                                b.layout, lr=lr_on(group, device), **args,
                                **control(opt, device, cache)):
            return
        # grads not contiguous, of mixed dtypes, ...: the call on the pack's views below
    scales = {k: b.lists[k] for k in b.scale_keys}
    state_lists = {k: v for k, v in b.lists.items() if k not in b.scale_keys}
    if _distributed.is_dtensor(params[0]):      # the kernel on the local shards
        scales = {k: [_shards.local_scales(who, i, p, t) for i, p, t in
                      zip(b.indices, params, v)] for k, v in scales.items()}
        params, grads, state_lists = _distributed.local_lists(who, b.indices, params, grads,
                                                              state_lists)
    if not all(map(torch.Tensor.is_contiguous, grads)):
        grads = [g if g.is_contiguous() else g.contiguous() for g in grads]
    targets = params
    if not all(map(torch.Tensor.is_contiguous, params)):
        targets = [p if p.is_contiguous() else p.detach().contiguous() for p in params]
    ops.adam_lean(
        targets, grads, state_lists[b.m_key], state_lists[b.v_key], state_lists["step"],
        lr=lr_on(group, device), masters=state_lists.get("master"),
        compensations=state_lists.get("compensation"),
        exp_avg_scales=scales.get("exp_avg_scale"),
        exp_avg_sq_scales=scales.get("exp_avg_sq_scale"),
        **args, **control(opt, device, cache))
    if targets is not params:
        for p, t in zip(params, targets):
            if t is not p:
                p.copy_(t)


class _Plan:
    """A group's calls while nothing changes: the same params list, the same params with
    grads, each param's state dict the same and holding the same tensors, each bucket's
    params of the dtype and device it was made for and its grads of one dtype."""

    def __init__(self, state, params, mask, buckets, first):
        self.state = state
        self.params = params
        self.count = len(params)
        self.mask = mask
        self.buckets = buckets
        for b in buckets:
            b.slots = [i - first for i in b.indices]
            b.whole = len(buckets) == 1 and len(b.slots) == len(params)

    def grads_of(self, state, params, mask, grads):
        """Each bucket's grads where the plan still holds, else None."""
        if not (state is self.state and params is self.params and len(params) == self.count
                and mask == self.mask):
            return None
        split = []
        for b in self.buckets:
            g = grads if b.whole else list(map(grads.__getitem__, b.slots))
            if set(map(_DTYPE, g)) != {b.grad_dtype} or set(map(_LAYOUT, g)) != _STRIDED:
                return None
            if not all(map(is_, map(state.get, b.params), b.states)):
                return None
            if not all(all(map(is_, map(dict.get, b.states, repeat(k)), v))
                       for k, v in b.lists.items()):
                return None
            if (set(map(_DTYPE, b.params)) != {b.dtype}
                    or {p.device for p in b.params} != {b.device}):
                return None
            split.append(g)
        return split
