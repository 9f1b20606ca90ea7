"""The plan's choices for the whole training step beside each module's precision: how the
weights and the optimizer's state are kept, whether each gradient is freed in the backward,
the blocks recomputed and the heads whose logits the loss takes in slices (:class:`Step`);
what the step's peak measured and what it is made of (:class:`Peak`); and the model and
optimizer made as the plan says (:func:`prepare`)."""
from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from .._distributed import is_dtensor

# name -> (ampc.prepare's options, or None: the model as it is; bytes a parameter of the
# weights and of the optimizer's state, and of a gradient kept to the step)
STATES = {
    # fp32 weights, fp32 moments (torch's AdamW)
    "fp32": (None, 4.0, 8.0, 4.0),
    # bf16 weights, fp32 master weights and moments (ampc.prepare)
    "master": ({}, 2.0, 12.0, 2.0),
    # bf16 weights written by stochastic rounding, 8-bit moments (ampc.prepare(state="lean"))
    "lean": ({"state": "lean"}, 2.0, 2.03, 2.0),
    # bf16 weights with a bf16 Kahan compensation, 8-bit moments
    "kahan8": ({"master_weights": False, "kahan_summation": True, "moments": "8bit"},
               2.0, 4.03, 2.0),
}
# what each keeps of fp32's quality, measured (docs/lean_state.md: GPT-2 on text, a char
# model, a CNN; 300+ steps, the last quarter's loss against fp32's seed spread)
QUALITY = {"fp32": "fp32", "master": "fp32's (fp32 masters)",
           "lean": "inside fp32's seed spread on three models at 2,000 steps, on two of them at 300 "
                   "(the CNN's train loss below fp32's range there) (docs/lean_state.md)",
           "kahan8": "inside fp32's seed spread on three models at 300 and 2,000 steps "
                     "(docs/lean_state.md)"}


def _bad(msg):
    return ValueError(f"ampc.autoprecision.Plan: {msg}")


def _names(key, value):
    if not (isinstance(value, (list, tuple)) and all(isinstance(n, str) for n in value)):
        raise _bad(f"{key} must be a list of module names, got {value!r}")
    return tuple(value)


@dataclass(frozen=True)
class Step:
    """The whole-step choices of a plan.

    Attributes:
        state: how the weights and the optimizer's state are kept, one of :data:`STATES`:
            "fp32" (the model as it is), "master" (bf16 weights, fp32 masters), "lean" (bf16
            weights by stochastic rounding, 8-bit moments), "kahan8".
        grads_freed: each parameter stepped, and its gradient freed, as soon as the backward
            completes it (``step_in_backward=True``; ampc's Adam/AdamW).
        recompute: blocks recomputed in the backward (``ampc.memory.recompute``).
        sliced_head: heads whose logits the loss takes a slice at a time
            (``ampc.memory.sliced_head``).
        micro_batches: the batch run as this many micro-batches, their gradients summed
            (the same update; ``Plan.backward`` runs them), where nothing else fits.
        why: {move: why it was taken or left}, in a few words each.
    """
    state: str = "fp32"
    grads_freed: bool = False
    recompute: tuple[str, ...] = ()
    sliced_head: tuple[str, ...] = ()
    why: Mapping[str, str] = dataclasses.field(default_factory=dict)
    micro_batches: int = 1

    def __post_init__(self):
        if self.state not in STATES:
            raise _bad(f"state must be one of {', '.join(STATES)}, got {self.state!r}")
        if not isinstance(self.grads_freed, bool):
            raise _bad(f"grads_freed must be True or False, got {self.grads_freed!r}")
        object.__setattr__(self, "recompute", _names("recompute", self.recompute))
        object.__setattr__(self, "sliced_head", _names("sliced_head", self.sliced_head))
        if isinstance(self.micro_batches, bool) or not isinstance(self.micro_batches, int) \
                or self.micro_batches < 1:
            raise _bad(f"micro_batches must be an int >= 1, got {self.micro_batches!r}")
        if not (isinstance(self.why, Mapping) and all(isinstance(v, str) for v in self.why.values())):
            raise _bad(f"step_why must map moves to reasons, got {self.why!r}")

    @classmethod
    def from_record(cls, data: Mapping[str, Any]) -> Step:
        """The step of a saved plan (a plan saved before the state was chosen: fp32; one
        saved before the step was a record kept grads_freed in its peak)."""
        old = data.get("peak") if isinstance(data.get("peak"), Mapping) else {}
        return cls(data.get("state", "fp32"), data.get("grads_freed", old.get("grads_freed", False)),
                   data.get("recompute") or (), data.get("sliced_head") or (),
                   dict(data.get("step_why") or {}), data.get("micro_batches", 1))

    def record(self) -> dict[str, Any]:
        return {"state": self.state, "grads_freed": self.grads_freed,
                "recompute": list(self.recompute), "sliced_head": list(self.sliced_head),
                "step_why": dict(self.why), "micro_batches": self.micro_batches}

    def bytes_per_param(self) -> float:
        """Weights, optimizer state and gradients a parameter (none with grads_freed, unless
        micro-batches keep them from one to the next)."""
        _, weights, state, grad = STATES[self.state]
        return weights + state + (0.0 if self.grads_freed and self.micro_batches == 1 else grad)


RECORD_KEYS = ("state", "grads_freed", "recompute", "sliced_head", "step_why", "micro_batches")


@dataclass(frozen=True)
class Peak:
    """A byte budget's figures: the budget, the step's peak measured in fp32, in the
    fastest plan and in the plan, the rounds of lowering, and the plan's peak by kind
    (weights, grads, state, activations, other: ``ampc.memory.report``'s parts)."""
    budget: int | None       # None: the memory objective without a byte budget
    fp32: int
    fastest: int
    bytes: int
    rounds: int = 0
    met: bool | None = None
    by_kind: Mapping[str, int] = dataclasses.field(default_factory=dict)

    @classmethod
    def from_record(cls, d: Mapping[str, Any] | None) -> Peak | None:
        if d is None:
            return None
        if not isinstance(d, Mapping) or not all(
                isinstance(d.get(k), int) for k in ("fp32", "fastest", "bytes")) or not (
                d.get("budget") is None or isinstance(d["budget"], int)):
            raise _bad(f"peak must hold budget, fp32, fastest and bytes (ints), got {d!r}")
        return cls(d["budget"], d["fp32"], d["fastest"], d["bytes"], d.get("rounds", 0),
                   d.get("met"), dict(d.get("by_kind") or {}))

    def record(self) -> dict[str, Any]:
        return dataclasses.asdict(self) | {"by_kind": dict(self.by_kind)}


def make(step: Step, model: torch.nn.Module, optimizer: Callable, **kwargs: Any):
    """(model, optimizer) with ``step``'s state and gradient release: the model as it is
    with ``optimizer(params, **kwargs)`` for "fp32", else ``ampc.prepare`` with the state's
    options (bf16 weights); ``optimizer`` may be one made already, before its first step. An option in ``kwargs`` that contradicts the step's is refused
    before anything changes."""
    from ..lean_state import PRESETS
    options, *_ = STATES[step.state]
    chosen = dict(options or {})
    chosen.update(PRESETS.get(chosen.get("state"), {}))
    if step.grads_freed:
        chosen["step_in_backward"] = True
    clash = sorted(k for k in kwargs if k in chosen and kwargs[k] != chosen[k])
    if clash:
        raise ValueError(f"ampc.autoprecision.Plan.prepare: {', '.join(clash)} is the plan's "
                         f"choice (state {step.state!r}, grads_freed {step.grads_freed}); leave "
                         "it out of the optimizer's arguments")
    kwargs = {k: v for k, v in kwargs.items() if k not in chosen}
    if isinstance(optimizer, torch.optim.Optimizer):
        return model, _made(step, model, optimizer, options, kwargs)
    if step.grads_freed:
        kwargs["step_in_backward"] = True
    if options is None:
        return model, optimizer(model.parameters(), **kwargs)
    import ampc
    return ampc.prepare(model, optimizer, torch.bfloat16, **options, **kwargs)


def _made(step, model, opt, options, kwargs):
    """An optimizer made elsewhere (a framework made it from the user's code) turned into
    the one the plan chose: its state's layout and gradient release set, before its first
    step, then ``ampc.prepare`` for bf16 weights."""
    import ampc
    if kwargs:
        raise TypeError("ampc.autoprecision.Plan.prepare: an optimizer already made takes no "
                        f"arguments; got {', '.join(sorted(kwargs))}")
    if options is None and not step.grads_freed:
        return opt
    if not isinstance(opt, ampc.optim.Adam):
        raise TypeError(f"ampc.autoprecision.Plan.prepare: the plan's state is {step.state!r}"
                        f"{' with gradients freed' if step.grads_freed else ''}, which needs an "
                        f"ampc.optim optimizer; got {type(opt).__name__}")
    opt.relayout(step_in_backward=step.grads_freed, **(options or {}))
    if options is None:
        return opt
    return ampc.prepare(model, opt, torch.bfloat16)[1]


def _sharded(step, optimizer, kwargs):
    """The part of ``step`` that composes with FSDP2 (the params are DTensor shards), and the
    optimizer's options with it; what is left out is said once. The fp32 shards stay: FSDP2
    keeps them as the master weights (its MixedPrecisionPolicy computes in bf16), so the
    states' bf16 weights are left out and 8-bit moments kept; each gradient must reach its
    reduce-scatter, so none is freed in the backward."""
    import ampc
    left = []
    if step.state != "fp32":
        left.append(f"the {step.state} state's bf16 weights (FSDP2's fp32 shards are the masters: "
                    "fully_shard(..., mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16)) "
                    "computes in bf16)")
    eight = step.state in ("lean", "kahan8") and (
        isinstance(optimizer, ampc.optim.Adam) or
        (isinstance(optimizer, type) and issubclass(optimizer, ampc.optim.Adam)))
    if eight:
        left[-1] += "; its 8-bit moments kept"
        if isinstance(optimizer, torch.optim.Optimizer):
            optimizer.relayout(moments="8bit")
        else:
            kwargs = dict(kwargs, moments="8bit")
    if step.grads_freed:
        left.append("the gradients freed in the backward (each must reach FSDP2's reduce-scatter)")
    if left:
        warnings.warn("ampc.autoprecision.Plan.prepare: the model is sharded (FSDP2): left out "
                      + "; ".join(left) + "; the modules' precision, saved activations, recompute, "
                      "sliced heads and micro-batches are applied", stacklevel=4)
    return dataclasses.replace(step, state="fp32", grads_freed=False), kwargs


def prepare_state(plan, model, optimizer=None, **kwargs):
    """Plan.prepare_state: the model and optimizer with the plan's state (see Plan.prepare)."""
    import ampc
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"ampc.autoprecision.Plan.prepare: model must be an nn.Module, got "
                        f"{type(model).__name__}")
    optimizer = optimizer or ampc.optim.AdamW
    for n, p in model.named_parameters():
        if p.is_floating_point() and p.dtype != torch.float32:
            raise ValueError(f"ampc.autoprecision.Plan.prepare: parameter {n} is {p.dtype}; "
                             "prepare takes the fp32 model the plan was searched on")
    step = plan.step
    if any(is_dtensor(p) for p in model.parameters()):
        step, kwargs = _sharded(step, optimizer, kwargs)
    if step.grads_freed and plan.needs_scaler():
        raise ValueError("ampc.autoprecision.Plan.prepare: the plan frees gradients in the "
                         "backward and runs a module in fp16, whose loss scaler must see every "
                         "gradient before a step")
    return make(step, model, optimizer, **kwargs)
