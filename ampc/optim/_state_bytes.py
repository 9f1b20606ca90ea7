"""What the training state of a model and its optimizer costs, measured from the tensors
that exist."""
from __future__ import annotations  # "X | None" hints on Python 3.9 too; none evaluated at import

from collections import OrderedDict

import torch

_KINDS = ("weights", "grads", "masters", "compensation", "moments", "scales", "steps")


def state_bytes(model: torch.nn.Module, optimizer=None) -> dict:
    """Persistent training-state bytes of a model and its optimizer, by kind, measured from
    the tensors that exist (each tensor's elements, counted once if two names hold it; a
    tensor subclass by the tensors inside it):
    weights, grads (those allocated now), masters, compensation, moments (exp_avg,
    exp_avg_sq, max_exp_avg_sq), scales (of 8-bit moments), steps. Returns
    ``{"params": parameter count, "bytes": {kind: bytes}, "per_param": {kind: bytes a
    parameter}, "total_per_param": ...}``."""
    seen = set()
    out = OrderedDict((k, 0) for k in _KINDS)

    def add(kind, t):
        if not isinstance(t, torch.Tensor):
            return
        if hasattr(t, "__tensor_flatten__"):
            # a tensor subclass (a DTensor's shard, another library's 8-bit state): the
            # tensors it holds, since its own size is that of the values it stands for
            for name in t.__tensor_flatten__()[0]:
                add(kind, getattr(t, name))
            return
        nbytes = t.numel() * t.element_size()
        key = (t.data_ptr(), nbytes)
        if key in seen or nbytes == 0:
            return
        seen.add(key)
        out[kind] += nbytes

    params = [p for p in model.parameters()]
    count = sum(p.numel() for p in params)
    key_kind = {"master": "masters", "compensation": "compensation", "exp_avg": "moments",
                "exp_avg_sq": "moments", "max_exp_avg_sq": "moments",
                "exp_avg_codes": "moments", "exp_avg_sq_codes": "moments",
                "exp_avg_scale": "scales", "exp_avg_sq_scale": "scales", "step": "steps"}
    for p in params:
        add("weights", p)
        add("grads", p.grad)
    if optimizer is not None:
        for g in optimizer.param_groups:
            for p in g["params"]:
                for key, t in optimizer.state.get(p, {}).items():
                    add(key_kind.get(key, "moments"), t)
    per = OrderedDict((k, v / count if count else 0.0) for k, v in out.items())
    return {"params": count, "bytes": dict(out), "per_param": dict(per),
            "total_per_param": sum(per.values())}
