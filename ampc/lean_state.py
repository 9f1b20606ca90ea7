"""The lean training state: what ``ampc.optim.Adam``/``AdamW`` keep per parameter when
asked for less than fp32 moments and fp32 master weights, how it converts to and from
torch's AdamW state, and what the state of a model and its optimizer costs.

A param's layout is its moments' kind (``"fp32"``, ``"bf16"`` or ``"8bit"``) and how its
weight is kept (``"master"``: an fp32 master weight; ``"kahan"``: a bf16 compensation;
``"none"``: the param alone). State keys, beside torch's ``step``: the moments as
``exp_avg`` and ``exp_avg_sq`` (fp32 or bf16 values, under torch's names) or, 8-bit,
``exp_avg_codes`` and ``exp_avg_sq_codes`` (uint8) with ``exp_avg_scale`` and
``exp_avg_sq_scale`` (one fp32 absmax a block of ``ampc.ops.QBLOCK``); ``master``,
``compensation``. The codes are defined in csrc/math/lean.h (Note [8-bit moments]);
``decode_moments`` below reads them.

The codes are not under torch's names on purpose: ``torch.optim.AdamW.load_state_dict``
casts any tensor it finds under ``exp_avg`` to the param's dtype, so codes there would
be trained on as if they were moments. Under their own names torch finds no moments and
its step raises. (Checkpoints written before this kept the codes under torch's names;
``ampc`` still reads them.)
"""
from __future__ import annotations  # "X | None" hints on Python 3.9 too; none evaluated at import

from collections import OrderedDict

import torch

from . import ops

__all__ = ["MOMENTS", "PRESETS", "CODES", "decode_moments", "encode_moments", "layout_of",
           "has_moments", "moment_keys", "upgrade_codes", "to_torch_state", "state_bytes",
           "scales_fit", "shard_blocks"]

MOMENTS = {"fp32": torch.float32, "bf16": torch.bfloat16, "8bit": torch.uint8}
_KIND = {v: k for k, v in MOMENTS.items()}

# The one-word presets of Adam(state=...): the options each one sets.
PRESETS = {
    # bf16 weights written by stochastic rounding, 8-bit moments: about 6 B a parameter
    "lean": dict(master_weights=False, stochastic_rounding=True, moments="8bit"),
}

_M_MAX, _V_MAX = 480.0, 496.0

# torch's moment names -> where 8-bit codes live instead (see the module docstring)
CODES = {"exp_avg": "exp_avg_codes", "exp_avg_sq": "exp_avg_sq_codes"}


def _table(mant_bits):
    """The values of lean.h's codes, exactly (powers of two times small integers)."""
    c = torch.arange(1 << (4 + mant_bits), dtype=torch.float64)
    e, f = torch.div(c, 1 << mant_bits, rounding_mode="floor"), c % (1 << mant_bits)
    sub = f * 2.0 ** (-6 - mant_bits)
    normal = (1 + f / 2 ** mant_bits) * torch.exp2(e - 7)
    return torch.where(e == 0, sub, normal).to(torch.float32)


_TABLES = {}


def _tables(device):
    if device not in _TABLES:
        _TABLES[device] = (_table(3).to(device), _table(4).to(device))
    return _TABLES[device]


def has_moments(state: dict) -> bool:
    """Whether one param's state holds moments (of any kind)."""
    return "exp_avg" in state or "exp_avg_codes" in state


def moment_keys(state: dict) -> tuple[str, str]:
    """The keys of one param's moments: torch's names, or those of 8-bit codes."""
    return ("exp_avg_codes", "exp_avg_sq_codes") if "exp_avg_codes" in state else \
        ("exp_avg", "exp_avg_sq")


def upgrade_codes(state: dict) -> dict:
    """One param's saved state with 8-bit codes under their own names: a checkpoint from
    before they moved out of torch's names (uint8 under ``exp_avg``) is read the same."""
    m = state.get("exp_avg")
    if not (isinstance(m, torch.Tensor) and m.dtype == torch.uint8):
        return state
    state = dict(state)
    for key, code in CODES.items():
        if key in state:
            state[code] = state.pop(key)
    return state


def layout_of(state: dict) -> tuple[str, str]:
    """(moments, weight) of one param's optimizer state, read from what it holds."""
    m = state.get(moment_keys(state)[0])
    kind = _KIND.get(m.dtype, "?") if isinstance(m, torch.Tensor) else "fp32"
    if "exp_avg_codes" in state and kind != "8bit":
        kind = "?"
    weight = "master" if "master" in state else "kahan" if "compensation" in state else "none"
    return kind, weight


def decode_moments(state: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 exp_avg and exp_avg_sq of one param's state, whatever its kind: the values the
    next step starts from, bit for bit (the 8-bit decode is lean.h's)."""
    state = upgrade_codes(state)
    m, v = (state[k] for k in moment_keys(state))
    if m.dtype != torch.uint8:
        return m.float(), v.float()
    tm, tv = _tables(m.device)
    idx = _block_index(m.shape, state["exp_avg_scale"], m.device)
    fm = (state["exp_avg_scale"].reshape(-1) / _M_MAX)[idx]
    fv = (state["exp_avg_sq_scale"].reshape(-1) / _V_MAX)[idx]
    c = m.reshape(-1).long()
    mag = tm[c & 127] * fm
    mf = torch.where(c >= 128, -mag, mag)
    s = tv[v.reshape(-1).long()] * fv
    return mf.reshape(m.shape), (s * s).reshape(v.shape)


def shard_blocks(shape, shards):
    """Blocks of the largest of `shards` Shard(0) shards of a tensor of `shape` (torch.chunk's
    cut: ceil(rows / shards) rows): the row length of its per-shard scales (see
    ampc._distributed.lean_scales)."""
    rows = shape[0] if len(shape) else 0
    if not rows:
        return 0
    shard_rows = -(-rows // shards)
    elements = shard_rows * (torch.Size(shape).numel() // rows)
    return -(-elements // ops.QBLOCK)


def scales_fit(scales, shape):
    """Whether `scales` are those of 8-bit codes of `shape`: ceil(numel / QBLOCK) of them,
    or (shards, shard_blocks) of a Shard(0) sharding."""
    if not isinstance(scales, torch.Tensor):
        return False
    if scales.dim() == 2:
        return scales.shape[0] >= 1 and scales.shape[1] == shard_blocks(shape, scales.shape[0])
    return scales.numel() == -(-torch.Size(shape).numel() // ops.QBLOCK)


def _block_index(shape, scales, device):
    """For each element of codes of `shape`, the index of its block's scale in
    scales.reshape(-1): blocks of the whole tensor, or of each Shard(0) shard when the
    scales are per shard (2-d)."""
    n = torch.Size(shape).numel()
    i = torch.arange(n, device=device)
    if scales.dim() != 2:
        return i // ops.QBLOCK
    shards, width = scales.shape
    per_row = n // shape[0] if n else 1
    chunk = -(-shape[0] // shards) * per_row       # elements of every shard but the last
    shard = i // chunk
    return shard * width + (i - shard * chunk) // ops.QBLOCK


def encode_moments(m: torch.Tensor, v: torch.Tensor, kind: str, step: torch.Tensor | None = None,
                   seed: int = 0) -> dict:
    """The state entries of fp32 moments stored as `kind`. 8-bit codes come from the step
    kernel itself, so they are the kernel's: with beta1 = beta2 = 0, lr = 0 and grad g a
    step stores m = g and v = g * g, once with g = m (keeping its exp_avg codes) and once
    with g = sqrt(v) (keeping its exp_avg_sq codes; v comes back within an ulp). bf16
    moments are rounded to nearest."""
    if kind == "fp32":
        return {"exp_avg": m.float().clone(), "exp_avg_sq": v.float().clone()}
    if kind == "bf16":
        return {"exp_avg": m.to(torch.bfloat16), "exp_avg_sq": v.to(torch.bfloat16)}
    if kind != "8bit":
        raise ValueError(f"ampc.lean_state: unknown moments kind {kind!r}")
    n = m.numel()
    blocks = -(-n // ops.QBLOCK)
    out = {}
    for key, g in (("exp_avg", m), ("exp_avg_sq", v.float().sqrt())):
        # zeros: the step decodes the old codes first (0 * garbage could be nan)
        cm = torch.zeros(m.shape, dtype=torch.uint8, device=m.device)
        cv = torch.zeros_like(cm)
        sm = torch.zeros(blocks, device=m.device)
        sv = torch.zeros_like(sm)
        ops.adam_lean([torch.zeros(n, device=m.device)],
                      [g.float().contiguous().reshape(-1)], [cm.reshape(-1)], [cv.reshape(-1)],
                      [torch.zeros(1, device=m.device)], lr=0.0, beta1=0.0, beta2=0.0,
                      exp_avg_scales=[sm], exp_avg_sq_scales=[sv])
        if key == "exp_avg":
            out["exp_avg_codes"], out["exp_avg_scale"] = cm, sm
        else:
            out["exp_avg_sq_codes"], out["exp_avg_sq_scale"] = cv, sv
    return out


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


# ---- memory ----

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
