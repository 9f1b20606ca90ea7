"""ampc.amp: the autocast region and what it is made of.

``autocast_mode`` is the public module (``ampc.autocast``, the class, and torch.amp's
functions beside it); the private modules are its parts: ``_policy_casts`` (ampc's casts for
ops whose policy differs from torch's lists), ``_casts`` (the autograd-visible multi-tensor
cast), ``_weight_cache`` (weights cast once per region, in buckets), ``_composites`` (edited
ops seen inside Python composites) and ``_overflow`` (the overflow locator). The class is
re-exported as ``ampc.autocast``; this package keeps a name of its own so that the class
never hides the module it lives in.
"""
from .autocast_mode import (autocast, clear_autocast_cache, custom_bwd, custom_fwd,
                            get_autocast_dtype, is_autocast_available, is_autocast_cache_enabled,
                            is_autocast_enabled, set_autocast_dtype)

__all__ = ["autocast", "clear_autocast_cache", "custom_bwd", "custom_fwd", "get_autocast_dtype",
           "is_autocast_available", "is_autocast_cache_enabled", "is_autocast_enabled",
           "set_autocast_dtype"]
