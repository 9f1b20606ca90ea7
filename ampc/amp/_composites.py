"""Letting an autocast region see the torch calls inside Python composites.

Inside a TorchFunctionMode, a Python function of torch's that checks ``has_torch_function``
(``F.multi_head_attention_forward``, ``F.pad``) hands itself to the mode whole, and the mode
runs it with itself switched off, so the ops it calls are not seen. torch's own autocast
state sees them anyway (it lives in the dispatcher), so with the default policy nothing is
needed. When the policy has been edited, an edited op called inside such a composite must
still meet the mode: the composite runs as a copy whose globals answer "no torch function"
to its own check, with the mode back on. The copy shares the function's code and closure,
and picks up later patches of its module's globals.
"""
import types

_DISPATCH_CHECKS = ("has_torch_function", "has_torch_function_unary", "has_torch_function_variadic")
_PATCHED_GLOBALS = {}
_LIFTED = {}


def _no_dispatch(*args, **kwargs):
    return False


def _names(code):
    """Every name ``code`` and the code nested in it load (globals among them)."""
    names = set(code.co_names)
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            names |= _names(c)
    return names


def _lift(func):
    """(copy of ``func`` whose torch-function check says no, its module's globals, the copy's
    globals, the global names it uses), or None when ``func`` does not check that way or is
    autograd's (backward runs outside the region, as torch's does)."""
    entry = _LIFTED.get(func, False)
    if entry is not False:
        return entry
    entry = None
    g = getattr(func, "__globals__", None)
    if (isinstance(func, types.FunctionType) and g is not None
            and not func.__module__.startswith("torch.autograd")
            and any(n in g for n in _DISPATCH_CHECKS)):
        patched = _PATCHED_GLOBALS.get(id(g))
        if patched is None:
            patched = _PATCHED_GLOBALS[id(g)] = {**g, **{n: _no_dispatch for n in _DISPATCH_CHECKS}}
        lifted = types.FunctionType(func.__code__, patched, func.__name__, func.__defaults__,
                                    func.__closure__)
        lifted.__kwdefaults__ = func.__kwdefaults__
        used = tuple(n for n in _names(func.__code__) if n in g and n not in _DISPATCH_CHECKS)
        entry = (lifted, g, patched, used)
    _LIFTED[func] = entry
    return entry


def call_lifted(func, args, kwargs, st, push, pop):
    """Runs Python function ``func`` with the mode on for the calls inside it (``push`` and
    ``pop`` put the mode back and take it off); a composite already running is not lifted
    again (its recursive calls run as they are)."""
    entry = _lift(func)
    if entry is None or func in st.lifting:
        return func(*args, **kwargs)
    lifted, g, patched, used = entry
    if any(patched.get(n) is not g.get(n) for n in used):   # the module was patched since
        patched.update(g)
        patched.update({n: _no_dispatch for n in _DISPATCH_CHECKS})
    st.lifting.add(func)
    push()
    try:
        return lifted(*args, **kwargs)
    finally:
        pop()
        st.lifting.discard(func)
