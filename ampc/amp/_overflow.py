"""The overflow locator of ``ampc.autocast(check_finite=True)``.

Each op the region sees is run, then its floating outputs are checked; the first op that
turns finite inputs into inf or nan raises, naming the op and the module path where it ran
(``linear ... in module Net.blocks.3.fc2``). Module paths come from global forward hooks,
installed while at least one checking region is open in any thread and removed after.
Checking syncs with the device at every op: a debugging tool, off by default.

ampc.GradScaler arms the locator for one step after a streak of skipped steps (``arm``): the
next region then records instead of raising, and hooks the autograd nodes of each op it runs
(the op's own internal nodes included), so that the backward pass names the first op whose
gradient turned finite values into inf or nan. The scaler reads the :class:`Recorder`.
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
    """``run(func, name, args, kwargs, st)``, raising if it made finite inputs non-finite
    (recording it instead in an armed region)."""
    out = run(func, name, args, kwargs, st)
    rec = st.recorder
    if rec is not None and rec.found is not None:      # found already: run on, unchecked
        return out
    outs = _float_tensors(out)
    label = name or getattr(func, "__qualname__", None) or repr(func)
    ins = _float_tensors((args, kwargs))
    if outs and not _finite(outs) and _finite(ins):
        bad = next(t for t in outs if not _finite([t]))
        if rec is not None:
            rec.note("forward", _short(func, name), module_path(st.modules),
                     f"its inputs were finite (largest magnitude {_largest(ins):.3g}) and its "
                     f"{bad.dtype} output holds {_kinds(bad)}{_range_note(bad.dtype)}")
            return out
        raise FloatingPointError(
            f"ampc.autocast(check_finite=True): {label} returned a non-finite {bad.dtype} value "
            f"from finite inputs, in module {module_path(st.modules)}. In float16 this is "
            "usually an overflow past 65504: keep this op or module in float32 "
            "(ampc.policy.set_policy / module_scope) or switch to bfloat16.")
    if rec is not None:
        rec.watch_backward(outs, _short(func, name), module_path(st.modules))
    return out


def _short(func, name):
    """'sqrt' rather than '_VariableFunctionsClass.sqrt', for the scaler's report."""
    return name or getattr(func, "__name__", None) or repr(func)


def _largest(ts):
    return max((float(t.detach().abs().max()) for t in ts if t.numel()), default=0.0)


def _kinds(t):
    t = t.detach()
    return " and ".join(k for k, hit in (("inf", torch.isinf(t).any()), ("nan", torch.isnan(t).any()))
                        if bool(hit))


def _range_note(dtype):
    if dtype in (torch.float16, torch.bfloat16):
        return f" ({str(dtype)[6:]}'s largest finite value is {torch.finfo(dtype).max:.5g})"
    return ""


class Recorder:
    """The first op of an armed step that turned finite values into inf or nan, forward
    or backward: ``found`` is (pass, op, module path, what its tensors held), or None."""

    def __init__(self):
        self.regions = 0          # ampc.autocast regions opened while armed
        self.found = None
        self._nodes = set()       # autograd nodes hooked already (kept alive: ids stay unique)

    def note(self, phase, label, where, detail):
        if self.found is None:
            self.found = (phase, label, where, detail)

    def watch_backward(self, outs, label, where):
        """Hooks the autograd nodes that produced ``outs`` and were not hooked yet: the op's
        own (earlier ops' nodes are hooked already, ops run in order)."""
        todo = [t.grad_fn for t in outs if t.grad_fn is not None]
        while todo:
            node = todo.pop()
            if node is None or node in self._nodes or type(node).__name__ == "AccumulateGrad":
                continue
            self._nodes.add(node)
            node.register_hook(self._hook(label, where))
            todo.extend(n for n, _ in node.next_functions)

    def _hook(self, label, where):
        def check(grad_inputs, grad_outputs):
            if self.found is not None:
                return
            made = [g for g in grad_inputs if g is not None and g.is_floating_point()]
            came = [g for g in grad_outputs if g is not None and g.is_floating_point()]
            if made and not _finite(made) and _finite(came):
                bad = next(g for g in made if not _finite([g]))
                self.note("backward", label, where,
                          f"the gradient it received was finite (largest magnitude "
                          f"{_largest(came):.3g}) and the {bad.dtype} gradient it produced "
                          f"holds {_kinds(bad)}{_range_note(bad.dtype)}")
        return check


armed = None        # the Recorder the next ampc.autocast region records into, or None


def arm(recorder):
    global armed
    armed = recorder


def disarm():
    global armed
    armed = None


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
