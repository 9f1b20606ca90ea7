"""Adam and AdamW with a fused C step and optional fp32 master weights.

``ampc.optim.AdamW`` is a drop-in for ``torch.optim.AdamW`` (same arguments, same state
keys, same results: bit-identical to ``AdamW(fused=True)`` on fp32 params). On fp16 or
bf16 params it keeps fp32 master weights in its state and runs the whole update (grad
widening, unscale, clipping, Adam, the cast back to the model's dtype) as one pass over
memory, 28 bytes per parameter.

Master weights and moments live in ``optimizer.state[p]`` (keys ``master``,
``exp_avg``, ``exp_avg_sq``, ``max_exp_avg_sq``, ``step``), so ``state_dict()`` carries
them, and ``load_state_dict()`` keeps them fp32 (torch's default would cast them to the
param's dtype).

Loss scaling: the optimizers take part in torch's fused-scaling protocol
(``_step_supports_amp_scaling``): a GradScaler sets ``grad_scale`` and ``found_inf`` on
the optimizer before ``step()``, the grads are unscaled inside the update and a step
with inf/nan grads is skipped on the device, with no host sync. ``grad_clip_coef`` (a
1-element tensor set the same way) folds gradient clipping into the update too.
"""
from ._adam import Adam, AdamW

__all__ = ["Adam", "AdamW"]

Adam.__module__ = AdamW.__module__ = __name__      # their public home, for reprs and pickles
