"""What a module computes: a matmul or convolution ("gemm"), a normalisation ("norm"), or
neither (None), told from the ops its forward runs, for the classes no list names.

Class lists miss the models people load: transformers' GPT-2 projects in ``Conv1D`` (an addmm
with the weight stored (in, out)); Llama and T5 normalise in their own ``LlamaRMSNorm`` and
``T5LayerNorm``. ``ampc.prepare`` (norms kept fp32) and ``ampc.autoprecision`` (its units)
both ask :func:`kind`.

How it decides. Only a module that holds tensors of its own (parameters or buffers) while
its children hold none is looked at. Its forward runs on a twin whose tensors are meta tensors
(no memory, no arithmetic, the module itself untouched), on a few inputs guessed from its
tensors' sizes, under a dispatch mode that records the aten ops:

- "gemm": it has a parameter of 2 or more dims, and its forward calls mm, addmm, bmm,
  matmul or a convolution;
- "norm": every tensor it holds has at most one dim larger than 1, it calls no GEMM, its
  output has its input's shape, and it either calls a fused norm (layer_norm, group_norm,
  batch_norm, rms_norm) or reduces a tensor the input's size (mean, var, std, sum, a vector
  norm) and scales by the result (rsqrt, sqrt, div, reciprocal).

A forward that fails on every guessed input (it needs more arguments, reads a value with
``.item()``) is neither. The answer is cached per (type, tensor names, shapes and dtypes).
"""
from __future__ import annotations

import warnings

import torch
from torch import nn

GEMM, NORM = "gemm", "norm"

_GEMM_OPS = frozenset((
    "mm", "addmm", "bmm", "baddbmm", "matmul", "mv", "addmv", "linear", "convolution",
    "_convolution", "conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d",
    "conv_transpose3d"))
_FUSED_NORM_OPS = frozenset((
    "native_layer_norm", "layer_norm", "native_group_norm", "group_norm", "native_batch_norm",
    "batch_norm", "_native_batch_norm_legit", "_native_batch_norm_legit_no_training",
    "_native_batch_norm_legit_functional", "_batch_norm_with_update", "_batch_norm_no_update",
    "instance_norm", "rms_norm", "_fused_rms_norm"))
_REDUCE_OPS = frozenset(("mean", "var", "var_mean", "std", "std_mean", "sum",
                         "linalg_vector_norm", "norm"))
_SCALE_OPS = frozenset(("rsqrt", "sqrt", "div", "reciprocal"))

_cache: dict = {}


def kind(module: nn.Module) -> str | None:
    """"gemm", "norm" or None for ``module``, from what its forward computes (see the
    module's docstring)."""
    own = [(n, t) for n, t in list(module._parameters.items()) + list(module._buffers.items())
           if t is not None]
    if (not own or any(isinstance(t, nn.parameter.UninitializedTensorMixin) for _, t in own)
            or any(_holds_tensors(c) for c in module.children())):
        return None        # nothing of its own, a lazy module not yet built, or a container
    key = (type(module), tuple((n, tuple(t.shape), t.dtype) for n, t in own))
    if key not in _cache:
        try:
            _cache[key] = _trace_kind(module, own)
        except Exception:   # tensors that have no meta twin (a tensor subclass): not known
            _cache[key] = None
    return _cache[key]


def _holds_tensors(module):
    return next(iter(module.parameters()), None) is not None or \
        next(iter(module.buffers()), None) is not None


def _vector_like(t):
    return sum(d > 1 for d in t.shape) <= 1


def _guesses(own):
    """Inputs to try, from the sizes of the module's tensors: features last (a Linear, a
    LayerNorm), or channels second (a convolution, a batch or group norm)."""
    sizes = []
    for _, t in own:
        sizes += [d for d in t.shape if d > 1 and d not in sizes]
    for s in sizes or [8]:
        yield from ((2, 3, s), (2, s), (2, s, 3), (2, s, 3, 3), (2, s, 8), (2, s, 8, 8),
                    (2, s, 8, 8, 8))


def _trace_kind(module, own):
    from torch.utils._python_dispatch import TorchDispatchMode   # loaded on first use only

    class Ops(TorchDispatchMode):
        def __init__(self, numel):
            super().__init__()
            self.numel = numel
            self.gemm = self.fused = self.reduces = self.scales = False

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.overloadpacket.__name__
            first = args[0] if args and isinstance(args[0], torch.Tensor) else None
            on_input = first is not None and first.numel() == self.numel
            self.gemm |= name in _GEMM_OPS
            self.fused |= name in _FUSED_NORM_OPS and on_input
            self.reduces |= name in _REDUCE_OPS and on_input
            self.scales |= name in _SCALE_OPS
            return func(*args, **(kwargs or {}))

    twin = object.__new__(type(module))
    twin.__dict__.update(module.__dict__)
    for slot in ("_parameters", "_buffers"):    # its own dicts: the module keeps its tensors
        twin.__dict__[slot] = {n: None if t is None else torch.empty_like(t, device="meta")
                               for n, t in module.__dict__[slot].items()}
    dtype = next((t.dtype for _, t in own if t.is_floating_point()), torch.float32)
    has_matrix = any(p is not None and p.dim() >= 2 for p in module._parameters.values())
    vector_only = all(_vector_like(t) for _, t in own)
    for shape in _guesses(own):
        x = torch.empty(shape, device="meta", dtype=dtype)
        ops = Ops(x.numel())
        try:
            # forward, not __call__: the module's hooks (a policy scope, prepare's casts)
            # are not the module's computation
            with torch.no_grad(), warnings.catch_warnings(), ops:
                warnings.simplefilter("ignore")
                out = twin.forward(x)
        except Exception:     # this input does not fit the module: try the next one
            continue
        if ops.gemm and has_matrix:
            return GEMM
        if (vector_only and not ops.gemm and isinstance(out, torch.Tensor)
                and out.shape == x.shape and (ops.fused or (ops.reduces and ops.scales))):
            return NORM
    return None
