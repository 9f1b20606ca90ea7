"""Thin Python wrappers around torch.ops.ampc.*, and the fake (meta) kernels that let
torch.compile trace them.

The ops work on lists of tensors in one call (one parallel region on the CPU, a few
kernel launches on CUDA) and check every argument before touching any memory: bad
input raises an error that names the op and the argument.
"""
import ctypes
import math
from collections.abc import Sequence
from itertools import repeat
from operator import attrgetter

import torch
from torch import Tensor

from ._lib import lib as _clib

__all__ = ["cast", "cast_", "unscale_check", "check_norm", "update_scale", "adam_master",
           "adam_packed", "adam_lean", "adam_lean_packed", "QBLOCK", "encode_q8", "decode_q8", "cast_fp8", "fp8_amax", "cast_from_fp8", "fp8_update_scales",
           "FP8_MAX", "step_seed", "cpu_isa", "stream_bytes"]

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_TENSOR = repeat(torch.Tensor)
_PLAIN = frozenset((torch.Tensor, torch.nn.Parameter))     # tensor types with no dispatch of their own


def _check_list(op, name, tensors):
    if not isinstance(tensors, (list, tuple)):
        raise TypeError(f"ampc.{op}: {name} must be a list or tuple of tensors, "
                        f"got {type(tensors).__name__}")
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"ampc.{op}: {name}[{i}] must be a Tensor, got {type(t).__name__}")


def _check_list_fast(op, name, tensors):
    """_check_list with the per-tensor loop in C; the one that names the culprit runs only
    on failure (and when torch.compile traces, which follows the plain loop). Plain tensors
    are told by their type first: isinstance() on a Tensor costs 4x more (torch's
    metaclass checks it in Python)."""
    if torch.compiler.is_compiling() or not isinstance(tensors, (list, tuple)):
        _check_list(op, name, tensors)
    elif not _PLAIN.issuperset(map(type, tensors)) and not all(map(isinstance, tensors, _TENSOR)):
        _check_list(op, name, tensors)


def _check_tensor(op, name, t):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"ampc.{op}: {name} must be a Tensor, got {type(t).__name__}")


def _call(op, lists, call):
    """``call(*lists)``, no per-tensor Python work on the way in; when it is refused, a
    list entry that is not a tensor is named in a TypeError (the schema's own message
    does not name it), else the kernel's error stands. Lists that mix dtypes are the
    kernels' business: they run one group of positions per dtype pair, after checking
    the whole call."""
    try:
        return call(*lists.values())
    except (TypeError, RuntimeError):
        for name, tensors in lists.items():
            _check_list(op, name, tensors)
        raise


def cast(tensors: Sequence[Tensor], dtype: torch.dtype, *, stochastic: bool = False,
         seed: int | Tensor = 0) -> list[Tensor]:
    """Returns a copy of each tensor converted to ``dtype``, in one fused call.

    Converts between torch.float32, torch.float16 and torch.bfloat16 in any
    direction. By default rounds to nearest even, bit-identical to ``t.to(dtype)``.
    With ``stochastic=True`` a value rounds up or down at random with probabilities
    that make the result unbiased; the random bits depend only on ``seed`` and on the
    element's position, counted across the tensors of the call (across those that
    share their dtype, when the inputs mix dtypes), so a call is reproducible on any
    thread count and on CPU and CUDA alike. A seed given as a 1-element int64 tensor
    is read on the device when the cast runs: a captured CUDA graph that advances it
    (``seed.add_(1)``) draws new bits on every replay, which a Python int cannot do.

    Args:
        tensors (list of Tensor): the inputs; non-contiguous ones are read through
            a contiguous copy.
        dtype (torch.dtype): the output dtype.
        stochastic (bool): stochastic rounding instead of round to nearest. Default: False.
        seed (int or Tensor): the seed of the stochastic rounding, or a 1-element int64
            tensor on the inputs' device holding it. Default: 0.

    Example::

        >>> w16 = ampc.ops.cast([torch.randn(4, 4)], torch.bfloat16)[0]
    """
    _check_list_fast("cast", "tensors", tensors)
    if dtype not in _FLOAT_DTYPES:
        raise TypeError(f"ampc.cast: dtype must be torch.float32, torch.float16 or "
                        f"torch.bfloat16, got {dtype}")
    src = [t if t.is_contiguous() else t.contiguous() for t in tensors]
    dst = [torch.empty(t.shape, dtype=dtype, device=t.device) for t in src]
    cast_(dst, src, stochastic=stochastic, seed=seed)
    return dst


def cast_(dst: Sequence[Tensor], src: Sequence[Tensor], *, stochastic: bool = False,
          seed: int | Tensor = 0) -> None:
    """Copies each ``src[i]`` into ``dst[i]``, converting to ``dst[i]``'s dtype, in place.

    The fast path of :func:`cast` for preallocated outputs: all tensors are on one
    device and contiguous, ``dst[i]`` has ``src[i]``'s shape, and no output overlaps an
    input or another output. One kernel call when each list has one dtype; lists that
    mix dtypes are split by dtype pair.

    Args:
        dst (list of Tensor): the outputs, written in place.
        src (list of Tensor): the inputs.
        stochastic (bool): stochastic rounding instead of round to nearest. Default: False.
        seed (int or Tensor): as for :func:`cast`. Default: 0.
    """
    if isinstance(src, (list, tuple)) and isinstance(dst, (list, tuple)) and not src and not dst:
        return      # nothing to do, and no tensor for the dispatcher to pick a device from
    seed_tensor = []
    if isinstance(seed, torch.Tensor):
        seed_tensor, seed = [seed], 0
    _call("cast", {"dst": dst, "src": src},
          lambda d, s: _run("cast", d, s, seed_tensor, bool(stochastic), _int64(seed)))


def unscale_check(grads: Sequence[Tensor], found_inf: Tensor, inv_scale: Tensor, *,
                  check_only: bool = False) -> Tensor | None:
    """Multiplies each grad by ``inv_scale`` in place and flags any inf or nan.

    Equivalent to ``torch._amp_foreach_non_finite_check_and_unscale_`` (bit for bit)
    and also accepts bfloat16 grads: one pass over memory, ``found_inf`` set to 1 when
    any input element is inf or nan (never cleared, so the caller zeroes it).

    With ``check_only=True`` this is :func:`check_norm`: the grads are only read, and
    the global L2 norm of the unscaled grads is returned.

    Args:
        grads (list of Tensor): float32, float16 or bfloat16 gradients, contiguous, on
            the device of ``found_inf``.
        found_inf (Tensor): 1-element float32 flag.
        inv_scale (Tensor): 1-element float32 factor.
        check_only (bool): check and measure, do not unscale. Default: False.

    Example::

        >>> found_inf = torch.zeros(1); inv_scale = torch.full((1,), 2.0 ** -16)
        >>> ampc.ops.unscale_check([p.grad for p in model.parameters()], found_inf, inv_scale)
    """
    if check_only:
        return check_norm(grads, found_inf, inv_scale)
    _check_tensor("unscale_check", "found_inf", found_inf)
    _check_tensor("unscale_check", "inv_scale", inv_scale)
    _call("unscale_check", {"grads": grads},
          lambda g: _run("unscale_check", g, found_inf, inv_scale))


def check_norm(grads: Sequence[Tensor], found_inf: Tensor, inv_scale: Tensor) -> Tensor:
    """The read-only twin of :func:`unscale_check`: flags any inf or nan in ``found_inf``
    (never cleared) and returns the global L2 norm of the unscaled grads,
    ``|inv_scale| * ||grads||``, as a 0-dim float32 tensor on the grads' device, in one
    pass that leaves the grads as they are (what gradient clipping of scaled grads needs).

    Args:
        grads (list of Tensor): float32, float16 or bfloat16 gradients (they may mix
            dtypes), contiguous, on the device of ``found_inf``.
        found_inf (Tensor): 1-element float32 flag.
        inv_scale (Tensor): 1-element float32 factor.
    """
    _check_tensor("check_norm", "found_inf", found_inf)
    _check_tensor("check_norm", "inv_scale", inv_scale)
    return _call("check_norm", {"grads": grads},
                 lambda g: _run("check_norm", g, found_inf, inv_scale))


def update_scale(scale: Tensor, growth_tracker: Tensor, found_inf: Tensor,
                 growth_factor: float, backoff_factor: float, growth_interval: int, *,
                 hysteresis: int = 1, hysteresis_tracker: Tensor | None = None,
                 min_scale: float = 0.0, max_scale: float = math.inf) -> None:
    """One step of dynamic loss scaling, in place, on the scale's device (no host sync).

    With the default keyword arguments this is exactly ``torch._amp_update_scale_``:
    on a step with ``found_inf != 0`` the scale is multiplied by ``backoff_factor``
    and ``growth_tracker`` reset; otherwise ``growth_tracker`` counts up and every
    ``growth_interval`` clean steps the scale is multiplied by ``growth_factor``
    (unless that would overflow to inf).

    Args:
        scale (Tensor): 1-element float32 loss scale, updated in place.
        growth_tracker (Tensor): 1-element int32 count of clean steps, updated in place.
        found_inf (Tensor): 1-element float32, nonzero when the step had inf/nan grads.
        growth_factor (float), backoff_factor (float), growth_interval (int): as torch.
        hysteresis (int): back off only after this many non-finite steps in a row.
            Default: 1 (back off at once, as torch).
        hysteresis_tracker (Tensor): 1-element int32 countdown, needed when
            ``hysteresis > 1``; start it at ``hysteresis``.
        min_scale (float), max_scale (float): bounds of the scale. Default: 0, inf.
    """
    _check_tensor("update_scale", "scale", scale)
    _check_tensor("update_scale", "growth_tracker", growth_tracker)
    _check_tensor("update_scale", "found_inf", found_inf)
    if hysteresis_tracker is None:      # the kernel says when it needs one
        hysteresis_tracker = torch.empty(0, dtype=torch.int32, device=scale.device)
    _check_tensor("update_scale", "hysteresis_tracker", hysteresis_tracker)
    _run("update_scale", scale, growth_tracker, hysteresis_tracker, found_inf,
         float(growth_factor), float(backoff_factor), int(growth_interval), int(hysteresis),
         float(min_scale), float(max_scale))


def _takes_scale_bounds(min_scale, max_scale):
    """Whether update_scale's kernel takes these bounds (the rule is its own), asked with
    one step on throwaway CPU scalars."""
    try:
        _run("update_scale", torch.ones(1), torch.zeros(1, dtype=torch.int32),
             torch.empty(0, dtype=torch.int32), torch.zeros(1), 2.0, 0.5, 1, 1,
             float(min_scale), float(max_scale))
    except RuntimeError:
        return False
    return True


def _optional(op, name, t):
    """A device value as the kernel takes it: a list of zero or one tensor."""
    if t is None:
        return []
    _check_tensor(op, name, t)
    return [t]


def _lr_args(lr):
    """(lr_tensor, lr) of an Adam op: a tensor lr goes in the list, read on the device."""
    if isinstance(lr, torch.Tensor):
        return [lr if lr.dtype == torch.float32 else lr.to(torch.float32)], 0.0
    return [], lr


def adam_master(params: Sequence[Tensor], grads: Sequence[Tensor], exp_avgs: Sequence[Tensor],
                exp_avg_sqs: Sequence[Tensor], steps: Sequence[Tensor], *, lr: float | Tensor,
                masters: Sequence[Tensor] | None = None,
                max_exp_avg_sqs: Sequence[Tensor] | None = None, beta1: float = 0.9,
                beta2: float = 0.999, eps: float = 1e-8, weight_decay: float = 0.0,
                decoupled: bool = True, maximize: bool = False, inv_scale: Tensor | None = None,
                clip_coef: Tensor | None = None, found_inf: Tensor | None = None,
                stochastic: bool = False, seed: int = 0) -> None:
    """One Adam (``decoupled=False``) or AdamW step over many parameters, in one pass.

    Computes torch.optim.AdamW's update in fp32, in the order of torch's fused kernel:
    on fp32 params without masters the result is bit-identical to
    ``torch.optim.AdamW(fused=True)`` (or ``Adam``). With ``masters`` (fp32 copies of
    fp16/bf16 params) the master weights are updated and the params receive them rounded
    to their dtype (to nearest even, or stochastically with ``stochastic=True``), in the
    same pass: 28 bytes of memory traffic per parameter. Grads are only read, in any
    float dtype; a 16-bit grad is widened in registers, never in memory.

    Everything the step depends on at run time may live on the device, so a training
    step needs no host sync: ``lr`` (a float or a 1-element tensor), ``inv_scale`` (the
    grads are multiplied by it: the loss-scale unscale), ``clip_coef`` (then by it:
    gradient clipping) and ``found_inf`` (any nonzero value skips the whole step, moments
    and step counts included). Each param's step count is a 1-element float32 tensor
    that advances by one on a step that is not skipped.

    Args:
        params (list of Tensor): the weights, updated in place (fp32, fp16 or bf16).
        grads (list of Tensor): their gradients (fp32, fp16 or bf16), read only.
        exp_avgs, exp_avg_sqs (list of Tensor): fp32 first and second moments.
        steps (list of Tensor): 1-element float32 step counts, one per param.
        lr (float or Tensor): learning rate.
        masters (list of Tensor, optional): fp32 master weights of the params.
        max_exp_avg_sqs (list of Tensor, optional): fp32 state of amsgrad; amsgrad is on
            when given.
        beta1, beta2, eps, weight_decay (float): as torch.optim.AdamW.
        decoupled (bool): AdamW's weight decay (True) or Adam's L2 term (False).
        maximize (bool): ascend instead of descend.
        inv_scale, clip_coef, found_inf (Tensor, optional): 1-element float32 tensors.
        stochastic (bool): stochastic rounding of 16-bit params.
        seed (int): its seed; the bits of each step also depend on the param's step
            count, read on the device (see :func:`step_seed`), so successive steps and
            replays of a captured CUDA graph round differently with one seed.
    """
    op = "adam_master"
    for name, value in (("params", params), ("grads", grads), ("exp_avgs", exp_avgs),
                        ("exp_avg_sqs", exp_avg_sqs), ("steps", steps)):
        _check_list_fast(op, name, value)
    if len(params) == 0 and not any((grads, exp_avgs, exp_avg_sqs, steps, masters,
                                     max_exp_avg_sqs)):
        return
    lr_tensor, lr = _lr_args(lr)
    _run(
        "adam_master", params, grads, masters or [], exp_avgs, exp_avg_sqs,
        max_exp_avg_sqs or [], steps, lr_tensor, _optional(op, "inv_scale", inv_scale),
        _optional(op, "clip_coef", clip_coef), _optional(op, "found_inf", found_inf),
        float(lr), float(beta1), float(beta2), float(eps), float(weight_decay),
        bool(decoupled), bool(maximize), bool(stochastic), _int64(seed))


def _lean_layout():
    """lean.h's layout of 8-bit moments, from the C library: elements a scale, and the
    largest value of exp_avg's and of sqrt(exp_avg_sq)'s codes."""
    qblock, m_max, v_max = ctypes.c_int64(), ctypes.c_float(), ctypes.c_float()
    _clib.ampc_lean_layout(ctypes.byref(qblock), ctypes.byref(m_max), ctypes.byref(v_max))
    return qblock.value, m_max.value, v_max.value


QBLOCK, Q8M_MAX, Q8V_MAX = _lean_layout()   # QBLOCK: elements a scale of 8-bit moments


def blocks(numel: int) -> int:
    """The 8-bit blocks (scales) of a tensor of ``numel`` elements: ceil(numel / QBLOCK)."""
    return -(-numel // QBLOCK)


def adam_lean(params: Sequence[Tensor], grads: Sequence[Tensor], exp_avgs: Sequence[Tensor],
              exp_avg_sqs: Sequence[Tensor], steps: Sequence[Tensor], *, lr: float | Tensor,
              masters: Sequence[Tensor] | None = None,
              compensations: Sequence[Tensor] | None = None,
              exp_avg_scales: Sequence[Tensor] | None = None,
              exp_avg_sq_scales: Sequence[Tensor] | None = None, beta1: float = 0.9,
              beta2: float = 0.999, eps: float = 1e-8, weight_decay: float = 0.0,
              decoupled: bool = True, maximize: bool = False, inv_scale: Tensor | None = None,
              clip_coef: Tensor | None = None, found_inf: Tensor | None = None,
              stochastic: bool = False, seed: int = 0) -> None:
    """:func:`adam_master`'s step (no amsgrad) with the lean state, in one pass: the
    moments are dequantized, the grad unscaled and clipped, the step skipped on
    ``found_inf``, AdamW taken in fp32 exactly as ``adam_master`` takes it, the moments
    stored back, and the weight written.

    Moments, by the dtype of ``exp_avgs`` (both lists share it):
      - torch.float32: as ``adam_master``;
      - torch.bfloat16: stored with stochastic rounding (random bits of their own streams:
        round to nearest would stall ``exp_avg_sq`` at beta2 = 0.999);
      - torch.uint8: 8-bit codes, with one float32 scale a block of ``QBLOCK`` elements of
        each param in ``exp_avg_scales`` and ``exp_avg_sq_scales`` (``ceil(numel / QBLOCK)``
        values each), rewritten each step from the block's new absmax. exp_avg is a signed
        float-like code (3 mantissa bits, 16 binades), exp_avg_sq is coded as its square
        root (4 mantissa bits) and never rounds a nonzero value to 0: see lean.h.

    The weight: with ``masters`` (fp32) as ``adam_master``; with ``compensations`` (bf16
    params and bf16 compensations) the pair ``param + compensation`` is the weight, stepped
    in fp32 and split back (Kahan summation); with neither the param is the weight, and a
    16-bit param is written to nearest even or, with ``stochastic``, by stochastic
    rounding. Random bits are those of ``adam_master`` (see :func:`step_seed`): keyed by
    seed, step and element, the same on the CPU and CUDA.
    """
    op = "adam_lean"
    for name, value in (("params", params), ("grads", grads), ("exp_avgs", exp_avgs),
                        ("exp_avg_sqs", exp_avg_sqs), ("steps", steps)):
        _check_list_fast(op, name, value)
    if len(params) == 0 and not any((grads, exp_avgs, exp_avg_sqs, steps, masters,
                                     compensations, exp_avg_scales, exp_avg_sq_scales)):
        return
    lr_tensor, lr = _lr_args(lr)
    _run(
        "adam_lean", params, grads, masters or [], compensations or [], exp_avgs, exp_avg_sqs,
        exp_avg_scales or [], exp_avg_sq_scales or [], steps, lr_tensor,
        _optional(op, "inv_scale", inv_scale), _optional(op, "clip_coef", clip_coef),
        _optional(op, "found_inf", found_inf), float(lr), float(beta1), float(beta2),
        float(eps), float(weight_decay), bool(decoupled), bool(maximize), bool(stochastic),
        _int64(seed))


def encode_q8(src: Sequence[Tensor]) -> tuple[list[Tensor], list[Tensor]]:
    """Each tensor of ``src`` (contiguous fp32, fp16 or bf16) kept in 8 bits, in one call:
    returns (codes, scales), codes[i] one uint8 an element of src[i] (its shape) and
    scales[i] one float32 a block of ``QBLOCK`` elements, the block's largest |x|. A code
    is a sign and a small float (4 exponent, 3 mantissa bits) relative to the block's
    largest value: about 3% relative error down to 2^-9 of it, smaller values in steps of
    2^-9 of it (the lean state's exp_avg codes). A block holding an inf or a nan decodes to
    nan throughout. The same bits on the CPU and CUDA."""
    op = "encode_q8"
    _check_list_fast(op, "src", src)
    codes = [torch.empty(t.shape, dtype=torch.uint8, device=t.device) for t in src]
    scales = [torch.empty(blocks(t.numel()), device=t.device) for t in src]
    _run(op, codes, scales, list(src))
    return codes, scales


def decode_q8(codes: Sequence[Tensor], scales: Sequence[Tensor],
              dtype: torch.dtype = torch.float32) -> list[Tensor]:
    """The values of :func:`encode_q8`'s codes and scales, as new tensors of ``dtype``
    (float32, float16 or bfloat16; the value rounded to it to nearest even)."""
    op = "decode_q8"
    _check_list_fast(op, "codes", codes)
    _check_list_fast(op, "scales", scales)
    dst = [torch.empty(c.shape, dtype=dtype, device=c.device) for c in codes]
    _run(op, dst, list(codes), list(scales))
    return dst


def adam_packed(params: Sequence[Tensor], grads: Sequence[Tensor], state: Tensor,
                steps: Tensor, layout: Tensor, *, lr: float | Tensor, amsgrad: bool = False,
                master: bool = False, beta1: float = 0.9, beta2: float = 0.999,
                eps: float = 1e-8, weight_decay: float = 0.0, decoupled: bool = True,
                maximize: bool = False, inv_scale: Tensor | None = None,
                clip_coef: Tensor | None = None, found_inf: Tensor | None = None,
                stochastic: bool = False, seed: int = 0) -> bool:
    """:func:`adam_master` with the state of all params in one buffer: two tensor lists
    cross into C instead of seven, and no per-param step tensor.

    ``state`` (fp32) holds equal sections one after the other: exp_avg, exp_avg_sq, then
    max_exp_avg_sq with ``amsgrad``, then the master weights with ``master``. ``steps``
    (fp32) holds step counts. ``layout`` (int64, on the CPU, 3 values a param) says for
    params[i] its offset in every section, its numel and the index of its step count,
    offsets and indices increasing. Returns False, having done nothing, when the params
    and grads do not fit the packing (mixed dtypes in a list, not contiguous, on another
    device than ``state``, or a numel that is not the layout's); True after the step.
    """
    op = "adam_packed"
    for name, value in (("params", params), ("grads", grads)):
        _check_list_fast(op, name, value)
    lr_tensor, lr = _lr_args(lr)
    return not _run(
        "adam_packed", params, grads, state, steps, layout, lr_tensor,
        _optional(op, "inv_scale", inv_scale),
        _optional(op, "clip_coef", clip_coef), _optional(op, "found_inf", found_inf),
        float(lr), float(beta1), float(beta2), float(eps), float(weight_decay),
        bool(decoupled), bool(maximize), bool(amsgrad), bool(master), bool(stochastic),
        _int64(seed))


def adam_lean_packed(params: Sequence[Tensor], grads: Sequence[Tensor], moments: Tensor,
                     scales: Tensor, steps: Tensor, layout: Tensor, *, lr: float | Tensor,
                     beta1: float = 0.9, beta2: float = 0.999, eps: float = 1e-8,
                     weight_decay: float = 0.0, decoupled: bool = True, maximize: bool = False,
                     inv_scale: Tensor | None = None, clip_coef: Tensor | None = None,
                     found_inf: Tensor | None = None, stochastic: bool = False,
                     seed: int = 0) -> bool:
    """:func:`adam_lean`'s step, each param its own weight (no masters or compensations),
    with the state of all params in three tensors: two tensor lists cross into C instead
    of eight.

    ``moments`` holds two sections of equal size, exp_avg then exp_avg_sq, of the kind its
    dtype says (float32, bfloat16, or uint8 8-bit codes); with codes, ``scales`` (float32)
    holds two sections of one scale a block of ``QBLOCK`` elements, and every offset is a
    multiple of ``QBLOCK`` (a param's scales start at its offset / QBLOCK); without codes
    ``scales`` is empty. ``steps`` and ``layout`` are :func:`adam_packed`'s. Returns False,
    having done nothing, where :func:`adam_packed` does; True after the step.
    """
    op = "adam_lean_packed"
    for name, value in (("params", params), ("grads", grads)):
        _check_list_fast(op, name, value)
    lr_tensor, lr = _lr_args(lr)
    return not _run(
        op, params, grads, moments, scales, steps, layout, lr_tensor,
        _optional(op, "inv_scale", inv_scale),
        _optional(op, "clip_coef", clip_coef), _optional(op, "found_inf", found_inf),
        float(lr), float(beta1), float(beta2), float(eps), float(weight_decay),
        bool(decoupled), bool(maximize), bool(stochastic), _int64(seed))


_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}


def cast_fp8(dst: Sequence[Tensor], src: Sequence[Tensor], scale: Tensor, amax: Tensor) -> None:
    """Scaled casts to fp8 with the amax of each input, in one pass over memory.

    ``dst[i] = (src[i].float() * scale[i]).clamp(-fmax, fmax).to(dst[i].dtype)`` and
    ``amax[i] = src[i].abs().amax()``, bit-identical to torch on every input (NaN, inf,
    zeros and subnormals included; fmax = 448 for torch.float8_e4m3fn, 57344 for
    torch.float8_e5m2), with the amax taken from the same read as the cast. An empty tensor
    gets amax 0, a tensor holding a NaN gets NaN. ``scale`` is read and ``amax`` written on
    the device: no host sync.

    Args:
        dst (list of Tensor): torch.float8_e4m3fn or torch.float8_e5m2 outputs, written.
        src (list of Tensor): float32, float16 or bfloat16 inputs of the same shapes,
            contiguous, on one device.
        scale (Tensor): float32 of shape [len(src)], the factor of each tensor.
        amax (Tensor): float32 of shape [len(src)], written.

    Example::

        >>> x = torch.randn(64, 64); q = torch.empty_like(x, dtype=torch.float8_e4m3fn)
        >>> scale = torch.ones(1); amax = torch.empty(1)
        >>> ampc.ops.cast_fp8([q], [x], scale, amax)
    """
    _check_tensor("cast_fp8", "scale", scale)
    _check_tensor("cast_fp8", "amax", amax)
    _call("cast_fp8", {"dst": dst, "src": src},
          lambda d, s: _run("cast_fp8", d, s, scale, amax))


def fp8_amax(src: Sequence[Tensor], amax: Tensor) -> None:
    """``amax[i] = src[i].abs().amax()`` (0 for an empty tensor, NaN when it holds a NaN),
    read-only and exact: the amax of current scaling, whose scale must be known before the
    cast.

    Args:
        src (list of Tensor): float32, float16 or bfloat16 tensors, contiguous.
        amax (Tensor): float32 of shape [len(src)], written.
    """
    _check_tensor("fp8_amax", "amax", amax)
    _call("fp8_amax", {"src": src}, lambda s: _run("fp8_amax", s, amax))


def cast_from_fp8(dst: Sequence[Tensor], src: Sequence[Tensor], scale_inv: Tensor) -> None:
    """``dst[i] = (src[i].float() * scale_inv[i]).to(dst[i].dtype)``, bit-identical to torch.

    Args:
        dst (list of Tensor): float32, float16 or bfloat16 outputs, written.
        src (list of Tensor): torch.float8_e4m3fn or torch.float8_e5m2 inputs of the same
            shapes, contiguous.
        scale_inv (Tensor): float32 of shape [len(src)], the factor of each tensor.
    """
    _check_tensor("cast_from_fp8", "scale_inv", scale_inv)
    _call("cast_from_fp8", {"dst": dst, "src": src},
          lambda d, s: _run("cast_from_fp8", d, s, scale_inv))


_AMAX_ALGOS = ("max", "most_recent")


def fp8_update_scales(amax_history: Tensor, amax: Tensor, scale: Tensor, scale_inv: Tensor, *,
                      fmax: float, margin: float = 0, algo: str = "max") -> None:
    """One step of delayed scaling for n fp8 tensors, in place on the device (no host sync).

    TransformerEngine's rules (the exact sequence is in csrc/math/fp8_scaling.h): when
    ``amax[j]`` is 0 the history and the scale of tensor j are left alone; otherwise column
    j of ``amax_history`` rolls down one row and row 0 receives ``amax[j]``. The amax used
    is the largest value of the column, NaN rows skipped (``algo="max"``), or ``amax[j]``
    itself (``algo="most_recent"``); when it is finite and > 0,
    ``scale[j] = (fmax * 2**-margin) / amax`` in fp32, else the scale is kept; an inf scale
    becomes the largest fp32; ``scale_inv[j] = 1 / scale[j]``. A history of one row with
    ``algo="most_recent"`` is current scaling.

    Args:
        amax_history (Tensor): float32 [H, n], row 0 the newest, updated in place.
        amax (Tensor): float32 [n], this step's amax of each tensor (from :func:`cast_fp8`
            or :func:`fp8_amax`).
        scale, scale_inv (Tensor): float32 [n], updated in place.
        fmax (float): the largest value of the fp8 format (``ampc.ops.FP8_MAX[dtype]``).
        margin (float): scales are 2**margin smaller. Default: 0.
        algo (str): "max" or "most_recent". Default: "max".
    """
    op = "fp8_update_scales"
    for name, t in (("amax_history", amax_history), ("amax", amax), ("scale", scale),
                    ("scale_inv", scale_inv)):
        _check_tensor(op, name, t)
    if algo not in _AMAX_ALGOS:
        raise ValueError(f"ampc.{op}: algo must be 'max' or 'most_recent', got {algo!r}")
    _run(op, amax_history, scale, scale_inv, amax, float(fmax), float(margin),
         algo == "most_recent")


_SEED_STRIDE = 0x9E3779B97F4A7C15       # AMPC_SEED_STRIDE in csrc/math/dtype.h


def step_seed(seed: int, step: int) -> int:
    """The seed of the stochastic rounding of :func:`adam_master`'s step ``step`` (the
    param's step count after the step, 1 on the first): a param's 16-bit values are
    rounded exactly as ``cast(..., stochastic=True, seed=step_seed(seed, step))`` rounds
    the new weights. The step count lives on the device, so replays of a captured CUDA
    graph draw new bits (Note [random bits that advance on the device] in csrc/math/dtype.h)."""
    bits = int(torch.tensor([float(step)], dtype=torch.float32).view(torch.int32).item())
    return _int64(int(seed) + (bits & 0xFFFFFFFF) * _SEED_STRIDE)


def _int64(seed):
    """A seed as the schemas' int (int64) holds it: the same 64 bits, signed."""
    return (int(seed) + (1 << 63)) % (1 << 64) - (1 << 63)


_clib.ampc_cpu_isa_name.restype = ctypes.c_char_p
_clib.ampc_cache_bytes.restype = ctypes.c_int64


def cpu_isa() -> str:
    """The SIMD path the CPU kernels run: "avx512", "avx2" or "scalar" (the best the CPU
    has, capped by the environment variable AMPC_CPU_ISA=avx2 or =scalar)."""
    return _clib.ampc_cpu_isa_name().decode()


def stream_bytes() -> int:
    """Calls that move more bytes than this (the last-level cache, or the environment
    variable AMPC_STREAM_BYTES) write their outputs with streaming stores on the CPU."""
    return int(_clib.ampc_cache_bytes())


# ---- for ampc's own layers: straight to the kernel ----

_CAST = torch.ops.ampc.cast.default
_KERNEL_KEYS = {"cpu": torch._C.DispatchKeySet(torch._C.DispatchKey.CPU),
                "cuda": torch._C.DispatchKeySet(torch._C.DispatchKey.CUDA)}


def cast_new(dst: list[Tensor], src: list[Tensor], device: str) -> None:
    """:func:`cast_` into outputs just made for it, at the kernel of ``device`` ("cpu" or
    "cuda") itself: no Python checks, no autograd guard, no version bumps (a new output has
    no reader yet; the caller's autograd.Function records the cast), round to nearest.
    Autocast's casts take it, where the guard would cost more than the cast of a small
    weight; the C glue still checks every argument."""
    _CAST.redispatch(_KERNEL_KEYS[device], dst, src, [], False, 0)


def fp8_gemm(out: Tensor, a: Tensor, b_t: Tensor, scale_inv_a: Tensor, scale_inv_b: Tensor,
             bias: list[Tensor], amax: list[Tensor], workspace: Tensor) -> int:
    """cuBLASLt's FP8 GEMM into ``out`` (CUDA only; ``ampc.fp8.gemm`` is its public face and
    checks its arguments); 1 when the epilogue wrote ``amax``, else 0. Not guarded: fp8
    tensors never require grad, and ``out`` is new."""
    return torch.ops.ampc.fp8_gemm(out, a, b_t, scale_inv_a, scale_inv_b, bias, amax, workspace)


@torch.library.register_fake("ampc::fp8_gemm")
def _fp8_gemm_fake(out, a, b_t, scale_inv_a, scale_inv_b, bias, amax, workspace):
    # whether the epilogue offers the amax is known only when cuBLASLt is asked: a traced
    # graph takes the path that computes it after the GEMM, which is right either way
    return 0


# ---- version counters ----
# A kernel registered through the stable C ABI writes memory behind autograd's back:
# - the version counters of the tensors it mutates would not move, so a modified tensor
#   saved for backward would go unnoticed, and so would a stale cached cast of a weight;
# - autograd would record nothing, so a tensor that requires grad would silently get
#   wrong (or no) gradients through the op.
# This kernel, one dispatch key above the backends, refuses tensors that require grad
# while grad mode is on (the ops are not differentiable), bumps the versions of the
# tensors the op writes, and passes the call on. Every call takes it, the wrappers' too:
# one guard, whatever way the op is reached (eager, torch.ops, modes, tracing).

_lib = torch.library.Library("ampc", "IMPL")
_OVERLOADS = {}
_REQUIRES_GRAD = attrgetter("requires_grad")


def _guard_autograd(name):
    overload = getattr(torch.ops.ampc, name).default
    tensors = [(i, a.name, isinstance(a.type, torch.ListType), a.alias_info is not None
                and a.alias_info.is_write)
               for i, a in enumerate(overload._schema.arguments)
               if isinstance(a.type, (torch.TensorType, torch.ListType))]
    lists = [i for i, _, is_list, written in tensors if is_list and written]
    singles = [i for i, _, is_list, written in tensors if written and not is_list]
    below = torch._C._after_ADInplaceOrView_keyset
    bump = torch._C._increment_version       # takes a sequence of tensors

    def refuse_grad(args):
        for i, arg, is_list, _ in tensors:
            ts = args[i] if is_list else (args[i],)
            if not any(map(_REQUIRES_GRAD, ts)):    # in C: the usual case
                continue
            k = next(k for k, t in enumerate(ts) if t.requires_grad)
            where = f"{arg}[{k}]" if is_list else arg
            raise RuntimeError(
                f"ampc.{name}: {where} requires grad, and ampc's ops are not "
                f"differentiable; call them under torch.no_grad()")

    def kernel(keyset, *args):
        if torch.is_grad_enabled():
            refuse_grad(args)
        for i in lists:
            bump(args[i])
        if singles:
            bump([args[i] for i in singles])
        return overload.redispatch(keyset & below, *args)

    every_list = [i for i, _, is_list, _ in tensors if is_list]
    every_single = [i for i, _, is_list, _ in tensors if not is_list]

    def call_returning(*args):
        # The dispatcher's way converts every list to C++ and back to Python for this
        # guard, then to C++ again: on a list of 1,000 tensors that is most of a call's
        # host time. Where nothing but the backend would run below the guard anyway (plain
        # tensors, no mode, no tracing, no profiler), the guard's work is done here and
        # the call goes straight to the backend's kernel.
        keys = _direct_keys(args, every_list, every_single)
        return overload(*args) if keys is None else kernel(keys, *args)

    _lib.impl(name, kernel, "ADInplaceOrView", with_keyset=True)
    _OVERLOADS[name] = call_returning


_INCLUDED = torch._C._dispatch_tls_local_include_set()     # outside any mode or guard
_K = torch._C.DispatchKey
_MUST_RUN = (_K.ADInplaceOrView, _K.AutogradCPU, _K.AutogradCUDA)
_modes = torch._C._len_torch_dispatch_stack
_function_modes = torch._C._is_torch_function_mode_enabled
_profiling = torch._C._autograd._profiler_enabled
_tracing = torch._C._get_tracing_state
_transforms = torch._C._functorch.peek_interpreter_stack


def _direct_keys(args, lists, singles):
    """The backend's key set (what the guard passes on) when the call may skip the
    dispatcher's way, else None: every tensor of a plain type (no subclass dispatch), on
    the CPU or CUDA, and nothing active that the dispatcher would run on the way (a
    dispatch or function mode, a functorch transform, the JIT tracer, the profiler's
    record of the op, inference mode, a thread-local key guard, torch.compile)."""
    if torch.compiler.is_compiling():       # first: dynamo traces what follows it
        return None
    first = None
    for i in lists:
        ts = args[i]
        if not _PLAIN.issuperset(map(type, ts)):
            return None
        if first is None and ts:
            first = ts[0]
    if not _PLAIN.issuperset(type(args[i]) for i in singles):
        return None
    if first is None:
        if not singles:
            return None
        first = args[singles[0]]
    keys = _KERNEL_KEYS.get(first.device.type)
    if (keys is None or _modes() or _function_modes() or _profiling()
            or _tracing() is not None or _transforms() is not None
            or torch._C._dispatch_tls_local_include_set() != _INCLUDED):
        return None
    excluded = torch._C._dispatch_tls_local_exclude_set()
    if any(map(excluded.has, _MUST_RUN)):
        return None
    return keys


# Every op the C library registered (its list is csrc/api/ampc_ops.h) gets the guard and
# a fake kernel from here, but fp8_gemm: its one caller, ampc.fp8.gemm, calls it through
# fp8_gemm below, without the guard, and its fake kernel is its own.
_UNGUARDED = {"fp8_gemm"}
_OPS = sorted(n.split("::", 1)[1] for n in torch._C._dispatch_get_all_op_names()
              if n.startswith("ampc::") and n.split("::", 1)[1] not in _UNGUARDED)

for _name in _OPS:
    _guard_autograd(_name)


def _run(name, *args):
    """torch.ops.ampc.<name>(*args), through the guard (straight to it where it may)."""
    return _OVERLOADS[name](*args)


# ---- fake kernels: shapes only, for torch.compile and meta tensors ----
# They check devices like the real kernels do: a meta tensor mixed into a call on real
# tensors lands here, and must not pass silently.

def _same_device(op, **args):
    first = None
    for name, value in args.items():
        items = value if isinstance(value, (list, tuple)) else [value]
        for i, t in enumerate(items):
            label = f"{name}[{i}]" if isinstance(value, (list, tuple)) else name
            if first is None:
                first = (label, t.device)
            elif t.device != first[1]:
                raise RuntimeError(f"ampc.{op}: {label} must be on {first[1]} like "
                                   f"{first[0]}, got {t.device}")


# Arguments the kernels read on the host whatever the call's device (the packed steps' layout).
_HOST_ARGS = {"adam_packed": ("layout",), "adam_lean_packed": ("layout",)}


def _is_tensors(t):
    """A Tensor or a Tensor[] in a schema."""
    return isinstance(t, torch.TensorType) or (isinstance(t, torch.ListType)
                                               and isinstance(t.getElementType(), torch.TensorType))


def _register_fake(name):
    """A fake kernel for torch.ops.ampc.<name> from its schema: the devices of its tensor
    arguments checked, and what it returns: a 0-dim float32 tensor on their device, 0 for
    an int, nothing for ()."""
    schema = getattr(torch.ops.ampc, name).default._schema
    names = [a.name for a in schema.arguments]
    tensors = [a.name for a in schema.arguments if _is_tensors(a.type)
               and a.name not in _HOST_ARGS.get(name, ())]
    returns = [r.type for r in schema.returns]

    def fake(*args, **kwargs):
        given = dict(zip(names, args), **kwargs)
        _same_device(name, **{t: given[t] for t in tensors})
        if returns == [torch.TensorType.get()]:
            first = next(t for t in (given[a] for a in tensors)
                         for t in (t if isinstance(t, (list, tuple)) else [t]))
            return first.new_empty((), dtype=torch.float32)
        if returns == [torch.IntType.get()]:
            return 0
        return None

    torch.library.register_fake(f"ampc::{name}", fake)


for _name in _OPS:
    _register_fake(_name)
