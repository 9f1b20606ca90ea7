"""Checkpoints in and out: ``load_state_dict`` converts a state of any layout (torch's
AdamW, ampc's master weights, any lean layout, an 8-bit state of another sharding loaded
into one process) into the optimizer's own layout, or refuses it before anything is
loaded; ``to_torch_state`` writes one that torch's AdamW reads."""
from __future__ import annotations  # "X | None" hints on Python 3.9 too; none evaluated at import

from itertools import chain

import torch

from .. import _distributed
from . import _lean, _packed, _shards
from ._codes import (CODES, blocks, decode_moments, encode_moments, has_moments, layout_of,
                     moment_keys, upgrade_codes)

# torch's keys of the master-weight state, all fp32 in ampc
_FP32_KEYS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "master")
_LEAN_ONLY = ("exp_avg_scale", "exp_avg_sq_scale", "compensation") + tuple(CODES.values())
# How a group's state is laid out: the options a checkpoint's groups may not overwrite,
# since the state is converted into the layout they name
LAYOUT_OPTIONS = ("master_weights", "stochastic_rounding", "moments", "moments_min_numel",
                  "kahan_summation")


def load(opt, load_torch, state_dict):
    """opt.load_state_dict(state_dict); `load_torch` is torch's own load."""
    who = f"ampc.optim.{type(opt).__name__}.load_state_dict"
    saved_ids = list(chain.from_iterable(g["params"] for g in state_dict["param_groups"]))
    saved_state = {k: upgrade_codes(v) if isinstance(v, dict) else v
                   for k, v in state_dict["state"].items()}
    groups = {id(p): g for g in opt.param_groups for p in g["params"]}
    params = list(chain.from_iterable(g["params"] for g in opt.param_groups))
    layouts = [{k: g[k] for k in LAYOUT_OPTIONS} for g in opt.param_groups]
    for index, (saved_group, layout) in enumerate(zip(state_dict["param_groups"], layouts)):
        # the group as it will step: the checkpoint's hyperparameters, our layout
        _lean.check_options(f"ampc.optim.{type(opt).__name__}",
                            {**opt.defaults, **saved_group, **layout,
                             "params": opt.param_groups[index]["params"]}, index)
    for i, (sid, p) in enumerate(zip(saved_ids, params)):
        _check_saved(who, i, p, groups[id(p)], saved_state.get(sid, {}))
    before = {id(p): dict(opt.state[p]) for p in params if p in opt.state}
    load_torch(state_dict)
    for group, layout in zip(opt.param_groups, layouts):
        group.update(layout)
    for sid, p in zip(saved_ids, params):
        saved = saved_state.get(sid)
        if saved is None:
            continue
        group = groups[id(p)]
        state = opt.state[p]
        old = before.get(id(p), {})
        if _lean.is_lean(group):
            _load_lean(who, state, group, p, saved, _held_weight(p, old))
        else:
            _load_fp32(state, group, p, saved, old)


def _load_fp32(state, group, p, saved, old):
    """saved (any layout, checked) as fp32 moments and masters, copied into the packed
    state's views it replaces so that the packing survives a load."""
    if has_moments(saved) and layout_of(saved)[0] != "fp32":
        saved = dict(saved)     # a lean checkpoint into fp32 moments: decoded
        saved["exp_avg"], saved["exp_avg_sq"] = decode_moments(saved)
    if "compensation" in saved:
        saved = dict(saved)     # Kahan's weight, param + compensation, as the master
        saved["master"] = p.detach().float() + saved["compensation"].to(p.device).float()
    if "master" not in saved and _packed.wants_master(group, p):
        saved = dict(saved)     # a state without masters (torch's): from the weights
        held = _held_weight(p, old)
        saved["master"] = p.detach().float() if held is None else held
    for key in _LEAN_ONLY:
        state.pop(key, None)
    for key in _FP32_KEYS:
        if key in saved:
            state[key] = _into(old.get(key), saved[key].to(
                device=p.device, dtype=torch.float32, memory_format=torch.contiguous_format,
                copy=True))
    if "step" in saved:
        state["step"] = _into(old.get("step"), _step_of(saved, p))


def _check_saved(who, i, p, group, saved):
    """A checkpoint entry that the optimizer could misread is refused (ValueError) before
    anything is loaded; every other layout converts."""
    for key in _FP32_KEYS + tuple(CODES.values()) + ("compensation",):
        value = saved.get(key)
        if value is not None and (not isinstance(value, torch.Tensor)
                                  or value.shape != p.shape):
            got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value)
            raise ValueError(f"{who}: '{key}' of param {i} has shape {got}, but the param has "
                             f"shape {tuple(p.shape)}: the checkpoint is of another model or "
                             "optimizer")
    if not has_moments(saved):
        return
    moments, weight = layout_of(saved)
    if moments == "?":
        key = moment_keys(saved)[0]
        raise ValueError(f"{who}: '{key}' of param {i} is {saved[key].dtype}, not a moments "
                         "layout ampc knows (float32, bfloat16, uint8 codes)")
    if moments == "8bit":
        for key in ("exp_avg_scale", "exp_avg_sq_scale"):
            if not _shards.scales_fit(saved.get(key), p.shape):
                raise ValueError(f"{who}: param {i} has 8-bit moments but its '{key}' is not "
                                 f"{blocks(p.numel())} scales (nor those of a sharding along "
                                 "dim 0): the checkpoint is damaged or of another layout")
    lean = _lean.is_lean(group)
    if lean and _distributed.is_dtensor(p):
        _check_saved_sharded(who, i, p, group, saved)
    if lean:
        want = _lean.layout(group, p)[1]
    else:
        want = "master" if group["master_weights"] is not False else "none"
    if weight == "master" and want == "none":
        raise ValueError(f"{who}: param {i} has a master weight in the checkpoint, but this "
                         "optimizer was made with master_weights=False")
    if weight == "kahan" and want == "none":
        raise ValueError(f"{who}: param {i} has a Kahan compensation in the checkpoint, but "
                         "this optimizer keeps the weight in neither a master nor a "
                         "compensation: make it with kahan_summation=True (or "
                         "master_weights=True) to load it")
    if want == "kahan" and p.dtype == torch.float16:
        raise ValueError(f"{who}: kahan_summation=True needs torch.bfloat16 params; param {i} "
                         "is torch.float16")


def _check_saved_sharded(who, i, p, group, saved):
    """The lean state of a DTensor param loads only as it was saved: the same moments
    kind, each tensor a DTensor laid out like the optimizer's (DCP reshards the
    elementwise tensors; per-shard 8-bit scales of another sharding are refused)."""
    moments = _lean.layout(group, p)[0]
    if layout_of(saved)[0] != moments:
        raise ValueError(f"{who}: param {i} is a DTensor with {moments} moments, but the "
                         f"checkpoint holds {layout_of(saved)[0]} moments; sharded lean state "
                         "loads only in its own layout (load it into a single process to "
                         "convert it)")
    for key in moment_keys(saved) + ("master", "compensation"):
        if key in saved and not _distributed.is_dtensor(saved[key]):
            raise ValueError(f"{who}: '{key}' of param {i} is a plain tensor but the param is "
                             "a DTensor (load sharded state with torch.distributed.checkpoint)")
    if moments == "8bit":
        want = _shards.saved_scales_shape(p)
        for key in ("exp_avg_scale", "exp_avg_sq_scale"):
            t = saved[key]
            if not _distributed.is_dtensor(t) or tuple(t.shape) != want:
                raise ValueError(f"{who}: '{key}' of param {i} is not the per-shard scales of "
                                 f"this sharding (shape {want}, a DTensor): a checkpoint of "
                                 "another number of ranks holds other blocks; load it into a "
                                 "single process, which converts it (docs/lean_state.md)")


def _load_lean(who, state, group, p, saved, held):
    """saved (any layout, checked) converted into the group's lean layout for p; held is
    the fp32 weight the optimizer kept for p (see _held_weight), or None."""
    moments, weight = _lean.layout(group, p)
    state.clear()
    dtensor = _distributed.is_dtensor(p)
    if has_moments(saved):
        if layout_of(saved)[0] == moments and (
                moments != "8bit" or dtensor
                or saved["exp_avg_scale"].shape == (blocks(p.numel()),)):
            # the same layout: the tensors as saved
            for key in moment_keys(saved) + ("exp_avg_scale", "exp_avg_sq_scale"):
                if key in saved:
                    state[key] = saved[key].to(p.device, copy=True)
        else:
            m, v = decode_moments({k: t.to(p.device) if isinstance(t, torch.Tensor) else t
                                   for k, t in saved.items()})
            state.update(encode_moments(m, v, moments))
    else:
        state.update(_lean.new_moments(who, p, moments))
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
            state["compensation"] = saved["compensation"].to(p.device, torch.bfloat16, copy=True)
        elif wsaved == "master":
            master = saved["master"].to(p.device, torch.float32)
            state["compensation"] = (master - p.detach().float()).to(torch.bfloat16)
        elif held is not None:
            state["compensation"] = (held - p.detach().float()).to(torch.bfloat16)
        else:
            state["compensation"] = torch.zeros_like(p, dtype=torch.bfloat16)


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


def to_torch_state(optimizer) -> dict:
    """``optimizer.state_dict()`` in torch.optim.AdamW's layout: fp32 ``exp_avg`` and
    ``exp_avg_sq`` (decoded), ``step``; the lean keys (scales, compensation, master)
    left out. It loads into ``torch.optim.AdamW`` over fp32 params."""
    sd = optimizer.state_dict()
    state = {}
    for k, s in sd["state"].items():
        if not has_moments(s):
            state[k] = dict(s)
            continue
        m, v = decode_moments(s)
        state[k] = {"step": s["step"].float().reshape(()).clone(), "exp_avg": m, "exp_avg_sq": v}
    keep = ("lr", "betas", "eps", "weight_decay", "amsgrad", "maximize", "params")
    groups = [{k: g[k] for k in keep if k in g} for g in sd["param_groups"]]
    return {"state": state, "param_groups": groups}
