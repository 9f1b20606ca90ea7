"""A model's failures said in ampc's words, for both tools: the checks of a model, its
batches and its loss before anything is measured, and the reading of an error a step
raised under mixed precision (which module, which custom autograd.Function, what to do)."""
from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch

from .._walk import tensors
from .model import call_model, default_loss, expression


def _is_compiled(module: torch.nn.Module) -> bool:
    return isinstance(getattr(module, "_orig_mod", None), torch.nn.Module)


def compiled_parts(model: torch.nn.Module) -> list[str]:
    """Qualified names of the torch.compile'd modules of ``model`` ('' for itself)."""
    return [n for n, m in model.named_modules() if _is_compiled(m)]


def _unwrap(module):
    while _is_compiled(module):
        module = module._orig_mod
    for name, child in list(module.named_children()):
        plain = _unwrap(child)
        if plain is not child:
            setattr(module, name, plain)
    return module


def uncompiled(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``model`` with every compiled module replaced by the module it compiles
    (the names are then those of the model before torch.compile)."""
    return _unwrap(copy.deepcopy(model))


def unwrap_hint(name: str) -> str:
    """How to take compiled module ``name`` back to the module it compiles."""
    e = expression(name)
    return f"{e} = {e}._orig_mod"


def checked_loss(fn: str, loss_fn: Callable | None) -> Callable:
    """``loss_fn`` (None: the default loss), refusing a value that is not one number to
    back-propagate: torch's "grad can be implicitly created only for scalar outputs" names
    nothing."""
    loss_fn = loss_fn or default_loss
    name = getattr(loss_fn, "__name__", None) or type(loss_fn).__name__

    def loss(output, target):
        value = loss_fn(output, target)
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{fn}: loss_fn {name} returned a {type(value).__name__}, "
                            "expected a scalar tensor")
        if value.numel() != 1:
            raise ValueError(f"{fn}: loss_fn {name} returned a tensor of shape "
                             f"{tuple(value.shape)}, expected a scalar: reduce it "
                             "(.mean(), or reduction='mean' in torch's losses)")
        return value
    return loss


def _dtypes(inputs):
    """{dtype: first place} of the float64 and integer tensors among ``inputs``."""
    out = {}
    for k, t in enumerate(tensors(inputs)):
        if t.dtype == torch.float64 or not (t.is_floating_point() or t.is_complex()):
            out.setdefault(t.dtype, k)
    return out


def batch_error(fn: str, exc: BaseException, batch: Any, k: int) -> Exception | None:
    """An ampc error naming batch ``k`` when the fp32 model failed on it because of its
    inputs' dtypes (float64, or integers reaching a float layer), else None."""
    text = str(exc)
    if not isinstance(exc, RuntimeError) or not any(
            w in text for w in ("dtype", "scalar type", "Double", "Long", "Int")):
        return None
    found = _dtypes(batch[0])
    if not found:
        return None
    which = ", ".join(f"{str(d).replace('torch.', '')} (tensor {i} of its inputs)"
                      for d, i in found.items())
    return TypeError(f"{fn}: batch {k}'s inputs hold {which}, and the float32 model failed "
                     f"on them ({text.splitlines()[0][:120]}); give it float32 inputs "
                     "(x.float()): only token ids for an embedding stay integer")


def first_run(fn: str, model: torch.nn.Module, batches: list, loss_fn: Callable,
              step: Callable | None = None) -> list:
    """One fp32 forward and backward of a copy of ``model`` on each batch; a failure is
    raised as an ampc error naming the batch (its dtypes) or ``loss_fn``, before any
    measurement. The model itself is not touched. ``step(work, batch)``, when given, is
    that forward and backward (a caller that needs to see inside it: one pass, not two);
    what it returns for each batch is returned."""
    work = copy.deepcopy(model)
    results = []
    for k, batch in enumerate(batches):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            try:
                if step is not None:
                    results.append(step(work, batch))
                else:
                    loss_fn(call_model(work, batch[0]), batch[1]).backward()
            except (RuntimeError, TypeError) as e:
                if str(e).startswith("ampc"):
                    raise
                err = batch_error(fn, e, batch, k) or RuntimeError(
                    f"{fn}: the float32 model fails on batch {k}, before any mixed "
                    f"precision: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
                raise err from e
        work.zero_grad(set_to_none=True)
    return results


# ---- a step that failed under mixed precision ----

def custom_function(exc: BaseException) -> type | None:
    """The custom torch.autograd.Function whose backward (or forward) raised ``exc``, read
    from the traceback (torch's frame that runs it holds the node), or None."""
    tb = exc.__traceback__
    found = None
    while tb is not None:
        node = tb.tb_frame.f_locals.get("self")
        cls = getattr(type(node), "_forward_cls", None)
        if cls is not None:
            found = cls
        elif isinstance(node, type) and issubclass(node, torch.autograd.Function) \
                and node is not torch.autograd.Function:
            found = node
        tb = tb.tb_next
    return found


def module_applying(model: torch.nn.Module, inputs: Any, fn_cls: type) -> str | None:
    """The innermost module of ``model`` whose forward applies ``fn_cls`` (a custom
    autograd.Function): found by one forward whose hooks walk each module's part of the
    autograd graph. Only run to explain a failure."""
    found = []

    def hook(name):
        def post(mod, args, out):
            if found:
                return
            stop = {t.grad_fn for t in tensors(args) if t.grad_fn is not None}
            todo = [t.grad_fn for t in tensors(out) if t.grad_fn is not None]
            seen = set()
            while todo:
                node = todo.pop()
                if node is None or node in seen or node in stop:
                    continue
                seen.add(node)
                if getattr(type(node), "_forward_cls", None) is fn_cls:
                    found.append(name)
                    return
                todo.extend(n for n, _ in node.next_functions)
        return post
    handles = [m.register_forward_hook(hook(n)) for n, m in model.named_modules()]
    try:
        with torch.enable_grad():
            call_model(model, inputs)
    except Exception:       # noqa: BLE001 (a diagnosis: a forward that fails names nothing)
        return None
    finally:
        for h in handles:
            h.remove()
    return found[0] if found else None


def function_hint(fn_cls: type, module: str | None, device: str) -> str:
    """What to do about a custom autograd.Function that fails under autocast."""
    where = f" (applied in {expression(module) if module else 'the model'})" \
        if module is not None else ""
    return (f"the custom autograd.Function {fn_cls.__qualname__}{where} runs its forward "
            "under autocast and its backward outside it, so the dtypes it saved do not "
            f"match: decorate its forward with @torch.amp.custom_fwd(device_type='{device}', "
            f"cast_inputs=torch.float32) and its backward with "
            f"@torch.amp.custom_bwd(device_type='{device}')")


def explain(fn: str, exc: BaseException, model: torch.nn.Module | None = None,
            inputs: Any = None, device: str = "cpu") -> str | None:
    """What to do about ``exc``, raised by a step under mixed precision, where ampc can
    tell (a custom autograd.Function without custom_fwd); else None."""
    fn_cls = custom_function(exc)
    if fn_cls is None:
        return None
    module = None if model is None else module_applying(model, inputs, fn_cls)
    return function_hint(fn_cls, module, device)


def failing_module(exc: BaseException, model: torch.nn.Module) -> str | None:
    """The qualified name of the innermost module of ``model`` running when ``exc`` was
    raised (its forward's frame in the traceback), or None (a backward, say)."""
    names = {id(m): n for n, m in model.named_modules()}
    tb, found = exc.__traceback__, None
    while tb is not None:
        name = names.get(id(tb.tb_frame.f_locals.get("self")))
        if name is not None:
            found = name
        tb = tb.tb_next
    return found
