"""What a search minimises, one record each: what the solver, the whole-plan check and the
table read of an objective lives here, so that adding one is a record (and its tests)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Objective:
    name: str
    cost: str           # the measurement a unit's choices are ranked by: "ms" or "bytes"
    # choices are judged by measured time: candidates whose matmul is far slower here are
    # not tried, close times count as ties, the whole model is raced in its fastest form,
    # and a lower-precision loss must be clearly faster
    by_speed: bool
    # without a budget, a step may not slow down past max_slowdown x the fastest plan
    # measured (the time objective takes the fastest anyway)
    has_ceiling: bool
    candidates: tuple = ("fp32", "bf16", "fp16", "fp8")    # what search() tries when not told


REGISTRY = {o.name: o for o in (
    Objective("time", cost="ms", by_speed=True, has_ceiling=False),
    # and the precisions with saved activations in 8 bits: fewer bytes, for some time
    Objective("memory", cost="bytes", by_speed=False, has_ceiling=True,
              candidates=("fp32", "bf16", "fp16", "fp8", "fp32+8b", "bf16+8b")),
)}


def get(name: str) -> Objective:
    return REGISTRY[name]
