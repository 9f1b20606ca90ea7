"""The overflow locator of ``ampc.autocast(check_finite=True)``.

Each op the region sees is run, then its floating outputs are checked; the first op that
turns finite inputs into inf or nan raises, naming the op and the module path where it ran
(``linear ... in module Net.blocks.3.fc2``). Module paths come from global forward hooks,
installed while at least one checking region is open in any thread and removed after.
Checking syncs with the device at every op: a debugging tool, off by default.
"""
import threading

import torch

from .._walk import tensors


def _float_tensors(x):
    return [t for t in tensors(x) if t.is_floating_point()]


def _finite(ts):
    return all(bool(torch.isfinite(t).all()) for t in ts if t.numel())


def module_path(mods):
    """'Net.blocks.2.attn' for a stack of nested modules, outermost first."""
    if not mods:
        return "<no module>"
    parts = [type(mods[0]).__name__]
    for parent, child in zip(mods, mods[1:]):
        parts.append(next((n for n, m in parent._modules.items() if m is child), type(child).__name__))
    return ".".join(parts)


def checked(run, func, name, args, kwargs, st):
    """``run(func, name, args, kwargs, st)``, raising if it made finite inputs non-finite."""
    out = run(func, name, args, kwargs, st)
    outs = _float_tensors(out)
    if outs and not _finite(outs) and _finite(_float_tensors((args, kwargs))):
        label = name or getattr(func, "__qualname__", None) or repr(func)
        bad = next(t for t in outs if not _finite([t]))
        raise FloatingPointError(
            f"ampc.autocast(check_finite=True): {label} returned a non-finite {bad.dtype} value "
            f"from finite inputs, in module {module_path(st.modules)}. In float16 this is "
            "usually an overflow past 65504: keep this op or module in float32 "
            "(ampc.policy.set_policy / module_scope) or switch to bfloat16.")
    return out


# ---- module tracking: where an op ran ----

_hooks_lock = threading.Lock()
_hooks = []
_hook_users = 0
_state = None       # the autocast module's per-thread state (set by install)


def _module_enter(module, args):
    if _state.depth:
        _state.modules.append(module)


def _module_exit(module, args, out):
    mods = _state.modules
    if mods and mods[-1] is module:
        mods.pop()


def install_hooks(state):
    global _hook_users, _state
    with _hooks_lock:
        _state = state
        _hook_users += 1
        if _hook_users == 1:
            nn = torch.nn.modules.module
            _hooks.append(nn.register_module_forward_pre_hook(_module_enter))
            _hooks.append(nn.register_module_forward_hook(_module_exit, always_call=True))


def remove_hooks():
    global _hook_users
    with _hooks_lock:
        _hook_users -= 1
        if _hook_users == 0:
            while _hooks:
                _hooks.pop().remove()
