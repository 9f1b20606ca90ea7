"""The lean state's layouts and 8-bit codes: what one param's optimizer state holds, and
the moments it decodes to.

A param's layout is its moments' kind (``"fp32"``, ``"bf16"`` or ``"8bit"``) and how its
weight is kept (``"master"``: an fp32 master weight; ``"kahan"``: a bf16 compensation;
``"none"``: the param alone). State keys, beside torch's ``step``: the moments as
``exp_avg`` and ``exp_avg_sq`` (fp32 or bf16 values, under torch's names) or, 8-bit,
``exp_avg_codes`` and ``exp_avg_sq_codes`` (uint8) with ``exp_avg_scale`` and
``exp_avg_sq_scale`` (one fp32 absmax a block of ``ampc.ops.QBLOCK``); ``master``,
``compensation``. The codes are defined in csrc/math/lean.h (Note [8-bit moments]);
``decode_moments`` reads them.

The codes are not under torch's names on purpose: ``torch.optim.AdamW.load_state_dict``
casts any tensor it finds under ``exp_avg`` to the param's dtype, so codes there would
be trained on as if they were moments. Under their own names torch finds no moments and
its step raises. (Checkpoints written before this kept the codes under torch's names;
``upgrade_codes`` reads them.)
"""
from __future__ import annotations  # "X | None" hints on Python 3.9 too; none evaluated at import

import torch

from .. import ops
from ..ops import blocks
from ._shards import block_index

MOMENTS = {"fp32": torch.float32, "bf16": torch.bfloat16, "8bit": torch.uint8}
_KIND = {v: k for k, v in MOMENTS.items()}

# torch's moment names -> where 8-bit codes live instead (see the module docstring)
CODES = {"exp_avg": "exp_avg_codes", "exp_avg_sq": "exp_avg_sq_codes"}

_M_MAX, _V_MAX = ops.Q8M_MAX, ops.Q8V_MAX      # the largest code values (lean.h)


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
    return "exp_avg" in state or CODES["exp_avg"] in state


def moment_names(kind: str) -> tuple[str, str]:
    """The keys moments of `kind` are kept under: torch's names, or those of 8-bit codes."""
    return (CODES["exp_avg"], CODES["exp_avg_sq"]) if kind == "8bit" else ("exp_avg", "exp_avg_sq")


def moment_keys(state: dict) -> tuple[str, str]:
    """The keys of one param's moments."""
    return moment_names("8bit" if CODES["exp_avg"] in state else "fp32")


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
    if CODES["exp_avg"] in state and kind != "8bit":
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
    idx = block_index(m.shape, state["exp_avg_scale"], m.device)
    fm = (state["exp_avg_scale"].reshape(-1) / _M_MAX)[idx]
    fv = (state["exp_avg_sq_scale"].reshape(-1) / _V_MAX)[idx]
    c = m.reshape(-1).long()
    mag = tm[c & 127] * fm
    mf = torch.where(c >= 128, -mag, mag)
    s = tv[v.reshape(-1).long()] * fv
    return mf.reshape(m.shape), (s * s).reshape(v.shape)


def encode_moments(m: torch.Tensor, v: torch.Tensor, kind: str, step: torch.Tensor | None = None,
                   seed: int = 0) -> dict:
    """The state entries of fp32 moments stored as `kind`. 8-bit codes come from the step
    kernel itself, so they are the kernel's: with beta1 = beta2 = 0, lr = 0 and grad g a
    step stores m = g and v = g * g, once with g = m (keeping its exp_avg codes) and once
    with g = sqrt(v) (keeping its exp_avg_sq codes, rounded stochastically by the step's
    random bits of `seed`). bf16 moments are rounded to nearest."""
    if kind == "fp32":
        return {"exp_avg": m.float().clone(), "exp_avg_sq": v.float().clone()}
    if kind == "bf16":
        return {"exp_avg": m.to(torch.bfloat16), "exp_avg_sq": v.to(torch.bfloat16)}
    if kind != "8bit":
        raise ValueError(f"ampc.lean_state: unknown moments kind {kind!r}")
    n = m.numel()
    out = {}
    for key, g in (("exp_avg", m), ("exp_avg_sq", v.float().sqrt())):
        # zeros: the step decodes the old codes first (0 * garbage could be nan)
        cm = torch.zeros(m.shape, dtype=torch.uint8, device=m.device)
        cv = torch.zeros_like(cm)
        sm = torch.zeros(blocks(n), device=m.device)
        sv = torch.zeros_like(sm)
        ops.adam_lean([torch.zeros(n, device=m.device)],
                      [g.float().contiguous().reshape(-1)], [cm.reshape(-1)], [cv.reshape(-1)],
                      [torch.zeros(1, device=m.device)], lr=0.0, beta1=0.0, beta2=0.0,
                      exp_avg_scales=[sm], exp_avg_sq_scales=[sv], seed=seed)
        out[CODES[key]], out[key + "_scale"] = (cm, sm) if key == "exp_avg" else (cv, sv)
    return out
