"""GradScaler's step records: each iteration's scale, skip and clip norm kept as device
tensors (``GradScaler(step_records=N)``), and read to the host in one transfer."""
from __future__ import annotations  # "X | None" hints on Python 3.9 too; none evaluated at import

from typing import Any, Iterable, NamedTuple, Tuple, Union

import torch


class StepRecord(NamedTuple):
    """One iteration as device tensors, kept by ``GradScaler(step_records=N)``.

    scale: 0-dim float32, the scale the iteration's gradients were scaled by.
    skipped: 0-dim bool, whether a step of the iteration found an inf or a nan.
    grad_norm: what :meth:`GradScaler.clip_grad_norm_` returned in the iteration (the
        unscaled total norm), None without a clip, a tuple with several clipped optimizers.
    """
    scale: torch.Tensor
    skipped: torch.Tensor
    grad_norm: Union[None, torch.Tensor, Tuple[torch.Tensor, ...]]


def make_record(scale: torch.Tensor, skipped: torch.Tensor,
                norms: Iterable[torch.Tensor]) -> StepRecord:
    """The record of an iteration; ``norms``: what clip_grad_norm_ returned in it, one per
    clipped optimizer."""
    norms = tuple(norms)
    return StepRecord(scale, skipped, None if not norms else norms[0] if len(norms) == 1 else norms)


def read_step_records(records: Iterable[StepRecord]) -> list[dict[str, Any]]:
    """Reads StepRecords to the host in one transfer (one wait for the device in all).

    Returns a list of dicts {"scale": float, "skipped": bool, "grad_norm": float, None
    or a list of floats}, in the order of ``records``.
    """
    records = list(records)
    if not records:
        return []
    device, n = records[0].scale.device, len(records)
    # float64 holds every float32 and bool exactly; a norm on another device is copied
    # here first, blocking (a non-blocking copy to the host would not be waited for)
    norms = [t.to(device=device, dtype=torch.float64)
             for r in records for t in _norm_tuple(r.grad_norm)]
    values = torch.cat([torch.stack([r.scale for r in records]).double(),
                        torch.stack([r.skipped for r in records]).double(),
                        torch.stack(norms) if norms else
                        torch.zeros(0, dtype=torch.float64, device=device)]).tolist()
    out, at = [], 2 * n
    for i, r in enumerate(records):
        count = len(_norm_tuple(r.grad_norm))
        norm = values[at:at + count]
        if not isinstance(r.grad_norm, tuple):
            norm = norm[0] if count else None
        out.append({"scale": values[i], "skipped": bool(values[n + i]), "grad_norm": norm})
        at += count
    return out


def _norm_tuple(grad_norm):
    if grad_norm is None:
        return ()
    return grad_norm if isinstance(grad_norm, tuple) else (grad_norm,)
