"""Adam(step_in_backward=True): each param is stepped as soon as autograd has finished its
gradient, and the gradient is freed there, so a whole model's gradients never exist at
once (their bytes leave the step's peak).

What needs every gradient before any step is refused before a param changes: a loss
scaler that skips a step on inf/nan gradients (fp16), gradient clipping by the global
norm, and data-parallel training, whose gradients are averaged across ranks after
autograd hands them over. Gradient accumulation works inside ``optimizer.accumulating()``:
the gradients of those backwards are kept, and the next backward outside it steps on
their sum."""
from __future__ import annotations  # "X | None" hints on Python 3.9 too; none evaluated at import

import contextlib

import torch

from .. import _distributed, grad_scaler
from ._control import name

_SCALER = ("{who}(step_in_backward=True) steps each param inside the backward, before a loss "
           "scaler can see every gradient and skip a step on an inf or a nan: train without a "
           "GradScaler (bf16 autocast or bf16 weights need none), or pass "
           "step_in_backward=False")
_CLIP = ("{who}(step_in_backward=True) has freed the gradients in the backward: there is "
         "no global norm left to clip by; pass step_in_backward=False to clip")


def check_params(who, params):
    """Refuses, before any hook exists, the params a step in the backward cannot serve."""
    if any(map(_distributed.is_dtensor, params)):
        raise ValueError(f"{who}(step_in_backward=True): the params are sharded (FSDP); their "
                         "gradients are reduced after autograd hands them over. Pass "
                         "step_in_backward=False")
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        raise ValueError(f"{who}(step_in_backward=True): {dist.get_world_size()} ranks train "
                         "together, and data parallelism averages the gradients after "
                         "autograd hands them over; a step in the backward would take each "
                         "rank's own. Pass step_in_backward=False")
    for i, p in enumerate(params):
        if p.dtype == torch.float16:
            raise ValueError(f"{who}(step_in_backward=True): param {i} is torch.float16, which "
                             "needs a loss scaler that sees every gradient first; use "
                             "torch.bfloat16 or pass step_in_backward=False")


class InBackward:
    """The hooks of one optimizer: where each param sits, and whether gradients are being
    accumulated."""

    def __init__(self, opt):
        self.opt = opt
        self.where = {}             # param -> (group index, position among all params)
        self.handles = []
        self.accumulating = False

    def add_group(self, index):
        """Hooks the params of group `index` (just added)."""
        opt = self.opt
        params = opt.param_groups[index]["params"]
        check_params(name(opt), params)
        first = sum(len(g["params"]) for g in opt.param_groups[:index])
        for i, p in enumerate(params):
            if p.requires_grad and p not in self.where:
                self.where[p] = (index, first + i)
                self.handles.append(p.register_post_accumulate_grad_hook(self._step))

    def remove(self):
        for h in self.handles:
            h.remove()
        self.handles.clear()
        self.where.clear()

    @contextlib.contextmanager
    def keep_grads(self):
        was, self.accumulating = self.accumulating, True
        try:
            yield
        finally:
            self.accumulating = was

    def check_step(self):
        """Refuses what a scaler's step() hands the optimizer: its gradients were already
        stepped unscaled and unclipped, or are kept for one step() that a scaler may skip."""
        opt = self.opt
        if getattr(opt, "grad_scale", None) is not None or getattr(opt, "found_inf", None) \
                is not None:
            raise RuntimeError(_SCALER.format(who=name(opt)))
        if getattr(opt, "grad_clip_coef", None) is not None:
            raise RuntimeError(_CLIP.format(who=name(opt)))

    def _step(self, p):
        if self.accumulating:
            return
        opt = self.opt
        if grad_scaler.scaling_now():
            raise RuntimeError(_SCALER.format(who=name(opt)))
        self.check_step()
        index, position = self.where[p]
        group = opt.param_groups[index]
        with torch.no_grad():
            opt._strategy(group).step_one(opt, group, position, p, p.grad)
        p.grad = None
