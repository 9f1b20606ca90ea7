"""What every step kernel takes beside the tensors: a group's hyperparameters, its lr on
the device, and the loss scaler's control tensors (inv_scale, clip_coef, found_inf)."""
import torch


def name(opt) -> str:
    return f"ampc.optim.{type(opt).__name__}"


def hyper(group) -> dict:
    """The kernels' keyword arguments that come from the group, lr aside."""
    beta1, beta2 = (float(b) for b in group["betas"])
    # the seed of every random bit a step draws (stochastic rounding of the weights, bf16
    # moments, the 8-bit second moment's codes); the kernel mixes in each param's step
    # count, on the device
    seed = int(group["seed"])
    return dict(beta1=beta1, beta2=beta2, eps=group["eps"], weight_decay=group["weight_decay"],
                decoupled=group["decoupled_weight_decay"], maximize=group["maximize"],
                stochastic=group["stochastic_rounding"], seed=seed)


def lr_on(group, device):
    lr = group["lr"]
    if isinstance(lr, torch.Tensor) and lr.device != device:
        return lr.to(device, non_blocking=True)
    return lr


def control(opt, device, cache) -> dict:
    """inv_scale, clip_coef and found_inf on `device` (moved without a host sync), as the
    kernels' keyword arguments; `cache` keeps them for the step's other calls."""
    if device not in cache:
        scale = getattr(opt, "grad_scale", None)
        clip = getattr(opt, "grad_clip_coef", None)
        found = getattr(opt, "found_inf", None)
        inv = None
        if scale is not None:
            # torch's unscale_ uses this very value, so folding it in gives the same grads
            inv = scale.double().reciprocal().float()
        cache[device] = dict(zip(("inv_scale", "clip_coef", "found_inf"), (
            None if t is None else t.to(device=device, dtype=torch.float32,
                                        non_blocking=True).reshape(1)
            for t in (inv, clip, found))))
    return cache[device]
