"""Which module keeps which tensor for the backward.

Autograd's saved-tensor hooks see every tensor saved inside the region; forward hooks on the
model's modules say which module is running (the innermost one). A module that recomputes in
the backward (``_recompute.py``) saves nothing inside itself; the inputs it keeps for the
recomputation are noted here as its own (``note_held``).
"""
from __future__ import annotations

import sys
import weakref

import torch

from .._walk import tensors

_ACTIVE: list["SavedTracker"] = []     # the tracker of the step being measured, if any


def storage_key(t: torch.Tensor) -> tuple[int, int] | None:
    """(address, bytes) of the storage under ``t``; None for a tensor without one (a
    subclass, a sparse or meta tensor), which is not counted."""
    plain = type(t) is torch.Tensor or type(t) is torch.nn.Parameter
    if not plain or t.layout != torch.strided or t.device.type == "meta":
        return None
    s = t.untyped_storage()
    return (s.data_ptr(), s.nbytes()) if s.nbytes() else None


def note_held(module: torch.nn.Module, values) -> None:
    """Counts the tensors in ``values`` as kept by ``module`` (for its recomputation, or its
    saved tensors in fewer bits)."""
    # inside a compiled graph the tracker is not consulted: tracing it would put a
    # measurement into the graph (what such a module keeps is counted as the graph's)
    if _ACTIVE and not torch.compiler.is_compiling():
        _ACTIVE[-1].keep(module, tensors(values))


def _eager_modules(model: torch.nn.Module) -> dict[torch.nn.Module, str]:
    """{module: name} of the modules whose hooks run eagerly. Inside a compiled module
    (``torch.compile(m)`` or ``m.compile()``) one graph saves its tensors at once: hooks
    there would be traced into it (and Dynamo refuses some), so what it saves is counted as
    the compiled module's (``torch.compile(m)``'s wrapper runs its own hooks eagerly) or as
    the module around it."""
    frame = sys.modules.get("torch._dynamo.eval_frame")    # not loaded: nothing is compiled
    optimized = frame.OptimizedModule if frame else ()
    names, inside = {}, []
    for n, m in model.named_modules():
        if any(n.startswith(p) for p in inside):
            continue
        if isinstance(m, optimized):
            names[m] = (n or "(model)") + " (compiled)"
            inside.append(n + "." if n else "")
        elif getattr(m, "_compiled_call_impl", None) is not None:
            inside.append(n + "." if n else "")
        else:
            names[m] = n or "(model)"
    return names


def module_names(model: torch.nn.Module) -> dict[torch.nn.Module, str]:
    """{module: its name in ``model``}, without the ``_orig_mod`` that ``torch.compile``'s
    wrapper adds."""
    return {m: ".".join(p for p in n.split(".") if p != "_orig_mod") or "(model)"
            for n, m in model.named_modules()}


class SavedTracker:
    """While entered: records each tensor autograd saves and the module running then.
    ``live()`` then says which of them autograd still holds, each storage once."""

    def __init__(self, model: torch.nn.Module):
        self.names = _eager_modules(model)
        self.all_names = module_names(model)     # for what a module keeps itself
        self.stack: list[str] = []
        self.records: list[tuple[weakref.ref, str]] = []
        self._handles: list = []
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, t):
        # kept as is, so the weak reference says whether autograd still holds it (an output
        # comes as a detached alias: no reference cycle); with its version, since autograd
        # checks no version of what a hook packed
        self.records.append((weakref.ref(t), self.stack[-1] if self.stack else "(loss)"))
        return t, t._version

    @staticmethod
    def _unpack(packed):
        t, version = packed
        if t._version != version:
            raise RuntimeError(
                "one of the variables needed for gradient computation has been modified by an "
                f"inplace operation: [{t.type()} {list(t.shape)}] is at version {t._version}; expected "
                f"version {version} instead (seen by ampc.memory's saved-tensor hooks)")
        return t

    def keep(self, module, ts):
        name = self.all_names.get(module, "(model)")
        self.records.extend((weakref.ref(t), name) for t in ts)

    def __enter__(self):
        def enter(module, args):
            self.stack.append(self.names[module])

        def leave(module, args, out):      # returns None: the output stays as it is
            self.stack.pop()
        for module in self.names:
            self._handles.append(module.register_forward_pre_hook(enter))
            self._handles.append(module.register_forward_hook(leave, always_call=True))
        self._hooks.__enter__()
        _ACTIVE.append(self)
        return self

    def __exit__(self, *exc):
        _ACTIVE.remove(self)
        self._hooks.__exit__(*exc)
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def live(self, exclude: set[int]) -> dict[int, tuple[int, str]]:
        """{storage address: (bytes, module)} of the recorded tensors that are still alive,
        each storage once (the first module to save it), leaving out the storages at the
        addresses in ``exclude`` (the parameters, buffers, optimizer state and batch)."""
        out: dict[int, tuple[int, str]] = {}
        for ref, name in self.records:
            t = ref()
            key = None if t is None else storage_key(t)
            if key is not None and key[0] not in exclude and key[0] not in out:
                out[key[0]] = (key[1], name)
        return out
