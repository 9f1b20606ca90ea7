"""What the Lightning and Accelerate integrations share: the forward's region (ampc.autocast,
a policy scope, an FP8 region) and the check of an FP8 argument."""
import contextlib

import ampc


def fp8_recipe(name, fp8):
    """The recipe an ``fp8=`` argument asks for: None, True (``DelayedScaling()``) or a recipe."""
    if fp8 is None or fp8 is False:
        return None
    if fp8 is True:
        return ampc.fp8.DelayedScaling()
    if not isinstance(fp8, (ampc.fp8.DelayedScaling, ampc.fp8.Float8CurrentScaling)):
        raise TypeError(f"{name}: fp8 must be a bool or an ampc.fp8 recipe, "
                        f"got {type(fp8).__name__}")
    return fp8


@contextlib.contextmanager
def region(device, dtype, cache_enabled, policy, fp8, fp8_modules):
    """ampc.autocast, inside it ampc.policy.scope(ops=policy) and ampc.fp8.autocast if asked."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(ampc.autocast(device, dtype=dtype, cache_enabled=cache_enabled))
        if policy:
            stack.enter_context(ampc.policy.scope(ops=policy))
        if fp8 is not None:
            stack.enter_context(ampc.fp8.autocast(recipe=fp8, modules=fp8_modules))
        yield
