"""ampc.GradScaler: dynamic or static loss scaling with torch.amp.GradScaler's contract, on
ampc's kernels.

Loss scaling: the loss is multiplied by a scale S before backward so that small fp16
gradients do not flush to zero; before the optimizer uses them the gradients are
multiplied by inv_scale = float32(1 / double(S)). A step whose gradients hold an inf or
a nan is skipped; dynamic scaling then shrinks S (S *= backoff_factor) and grows it after
growth_interval clean steps in a row (S *= growth_factor); static scaling keeps S.
Checking and unscaling are one pass of ampc.ops.unscale_check, the scale update is
ampc.ops.update_scale.

What differs from torch (https://pytorch.org/docs/stable/amp.html#gradient-scaling):
- with an optimizer that unscales inside its own step (_step_supports_amp_scaling:
  ampc.optim and torch's fused optimizers) nothing here waits for the device;
- with ampc's optimizers, fp16/bf16 gradients and clipping are folded into the step;
- static scaling, skipped steps counted on the device, a per-step record, optional
  hysteresis, min and max scale, all of it in state_dict.
"""
from __future__ import annotations  # "X | None" hints on Python 3.9 too; none evaluated at import

import inspect
import math
import warnings
import weakref
from collections import abc, defaultdict, deque
from enum import Enum
from typing import Any, TypeVar

import torch

from . import _distributed, ops
from ._min_scale_watch import MinScaleWatch
from ._scaler_checkpoint import DEVICE_STATE, ScalerCheckpoint
from ._skip_watch import DEFAULT_AFTER, SkipWatch
from ._step_records import StepRecord, make_record, read_step_records

__all__ = ["GradScaler", "OptState", "StepRecord", "read_step_records"]

_Scaled = TypeVar("_Scaled")    # scale() gives back what it was given, scaled

_KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_GRAD_SCALER_WARNING = (
    "GradScaler is going to stop passing itself as a keyword argument to the passed "
    "optimizer. In the near future GradScaler registers `grad_scale: Tensor` and "
    "`found_inf: Tensor` to the passed optimizer and let the optimizer use them directly.")


class OptState(Enum):
    READY = 0
    UNSCALED = 1
    STEPPED = 2


def _fresh_state():
    # "folded": clip_grad_norm_ left the grads scaled and the optimizer will unscale and
    # clip them in its step (grad_scale and grad_clip_coef); "norm": what clip_grad_norm_
    # returned, for the step record
    # "host_skipped": whether step() skipped, when it read that on the host (else None)
    return {"stage": OptState.READY, "found_inf_per_device": {}, "folded": False,
            "clip_coef": None, "norm": None, "host_skipped": None}


# The losses enabled scalers have scaled, while they live (a backward holds its root): a
# step in the backward (Adam(step_in_backward=True)) refuses to run under one.
_SCALED = {}


def scaling_now() -> bool:
    return any(r() is not None for r in _SCALED.values())


def _note_scaled(t):
    key = id(t)
    _SCALED[key] = weakref.ref(t, lambda _, key=key: _SCALED.pop(key, None))
    return t


def _refuse_freed(optimizer, funcname):
    if getattr(optimizer, "step_in_backward", False):
        raise RuntimeError(f"GradScaler.{funcname}: the optimizer steps in the backward "
                           "(step_in_backward=True) and has freed its gradients there; pass "
                           "step_in_backward=False to unscale or clip them")


_TAKES_GRAD_SCALER = weakref.WeakKeyDictionary()


def _takes_grad_scaler(optimizer):
    """Whether optimizer.step has torch's deprecated grad_scaler keyword. Cached per step
    function: inspecting a signature takes ~8 us of host time per step."""
    step = optimizer.step
    func = getattr(step, "__func__", step)
    try:
        return _TAKES_GRAD_SCALER[func]
    except (KeyError, TypeError):            # TypeError: not weakly referenceable
        pass
    takes = "grad_scaler" in inspect.signature(step).parameters
    try:
        _TAKES_GRAD_SCALER[func] = takes
    except TypeError:
        pass
    return takes


def _unscale_check(grads, found_inf, inv_scale, check_only):
    """ampc.ops.unscale_check over grads of any layout. float64 grads (which the kernels do
    not take) go through torch's op; the norm is returned only when there are none."""
    ours = [g for g in grads if g.dtype in _KERNEL_DTYPES]
    rest = [g for g in grads if g.dtype not in _KERNEL_DTYPES]
    if rest:
        # check_only comes with inv_scale 1 (a check before a fused step) or without
        # float64 grads (a folded clip): multiplying by 1 leaves the values as they are
        torch._amp_foreach_non_finite_check_and_unscale_(rest, found_inf, inv_scale)
    dense = [g if g.is_contiguous() else g.contiguous() for g in ours]
    norm = ops.unscale_check(dense, found_inf, inv_scale, check_only=check_only)
    if not check_only:
        for g, d in zip(ours, dense):
            if d is not g:
                g.copy_(d)
    return None if rest else norm


class GradScaler(ScalerCheckpoint):
    """Scales the loss and unscales the gradients for fp16 mixed precision: a drop-in for
    ``torch.amp.GradScaler`` (and the older ``torch.cuda.amp.GradScaler``).

    Methods, state machine, errors, ``state_dict`` keys and the optimizer protocol are
    torch's: a checkpoint of either scaler loads into the other, an optimizer that unscales
    in its own step gets what torch's scaler gives it. On top of that:

    - With an optimizer that unscales inside its own step (``ampc.optim.AdamW``/``Adam``,
      torch's ``fused=True`` optimizers), ``step`` and ``update`` never wait for the
      device: the inf check, the skip decision and the scale update stay there. With any
      other optimizer ``step`` reads one flag from the device, as torch does.
    - fp16 and bf16 gradients (fp16/bf16 weights, fp32 master weights in the optimizer)
      work with ampc's optimizers, which unscale in fp32. ``unscale_`` still refuses fp16
      gradients with torch's error: unscaling them in fp16 would flush the small values
      that loss scaling exists to keep.
    - :meth:`clip_grad_norm_` clips without a pass that unscales the gradients.
    - Static loss scaling: ``dynamic=False`` keeps ``init_scale`` for the whole run.
    - :meth:`skipped_steps` and :meth:`last_step_skipped` report skips as device tensors;
      ``step_records=N`` keeps the last N iterations' scale, skip and clip norm as device
      tensors, read to the host in one transfer by :meth:`read_step_records`.
    - Optional ``hysteresis``, ``min_scale`` and ``max_scale``; with ``min_scale`` set, a
      scale stuck at the minimum with overflowing gradients raises instead of skipping
      every step forever.
    - After ``explain_skips`` skipped steps in a row (or two overflows in a row at
      ``min_scale``) it names, once, the first module and op that produced inf/nan in the
      next step (forward or backward) and the values it saw, as a warning with the fixes
      to try (or an error, ``raise_on_skips=True``). Watching costs no host sync: see
      ``ampc/_skip_watch.py``.
    - ``state_dict`` holds the whole state (the extras' settings and counters under keys
      of their own), so a resumed run reports and decides as the uninterrupted one.

    Static scaling is spelled ``dynamic=False`` (Keras's ``LossScaleOptimizer(dynamic=
    False, initial_scale=...)``; DeepSpeed and Megatron speak of static and dynamic loss
    scaling too) rather than torch's own terms, ``growth_factor=1.0, backoff_factor=1.0``:
    those keep raising torch's errors, so code written for torch behaves as it did. In
    the checkpoint a static scaler is exactly that, ``growth_factor`` and
    ``backoff_factor`` 1.0: torch's scaler loads it and keeps the scale fixed as well
    (its update multiplies by 1), and either scaler loading such a checkpoint is static.

    bf16 needs no loss scaling: it has fp32's exponent range, so gradients do not
    underflow. ``enabled="auto"`` turns the scaler on only when ``dtype`` (by default
    ``torch.get_autocast_dtype(device)``: float16 on cuda, bfloat16 on cpu) is float16.

    Args:
        device (str): "cuda" or "cpu". Default: "cuda". A number here is read as
            ``init_scale`` (the legacy ``torch.cuda.amp.GradScaler(init_scale)`` form).
        init_scale (float): the first scale. Default: 2.0**16.
        growth_factor (float): factor (> 1) of a growth. Default: 2.0.
        backoff_factor (float): factor (< 1) of a backoff. Default: 0.5.
        growth_interval (int): clean steps in a row before a growth. Default: 2000.
        enabled (bool or "auto"): False makes every method a pass-through. Default: True.
        dtype (torch.dtype, optional): the low-precision dtype ``enabled="auto"`` decides by.
        dynamic (bool): False: static loss scaling, the scale stays ``init_scale`` (or
            what ``update(new_scale)`` sets) and steps with inf/nan gradients are still
            skipped; leave ``growth_factor`` and ``backoff_factor`` at their defaults.
            Default: True.
        step_records (int): keep a :class:`StepRecord` of the last this many iterations
            (one small copy of the scale per iteration). Default: 0, none.
        hysteresis (int): back off only after this many non-finite steps in a row
            (Megatron's hysteresis). Default: 1 (at once, as torch).
        min_scale (float, optional): the scale never backs off below this.
        max_scale (float, optional): the scale never grows above this.
        min_scale_patience (int, optional): with ``min_scale`` set, ``update`` raises once
            this many steps in a row overflowed at the minimum scale (seen one or two
            steps late on CUDA, to avoid waiting for the device). None never raises.
            Default: 10.
        explain_skips (int, optional): after this many skipped steps in a row, locate the
            op that overflows in the next step (it runs under ampc.autocast's overflow
            locator: slower, once) and warn naming it. None: never. Default: 10. With a
            fused optimizer the streak is read every ``explain_skips`` steps without
            waiting for the device, so a collapse is seen within about 3x that many.
        raise_on_skips (bool): raise a RuntimeError with that message instead of warning.
            Default: False.

    Example::

        >>> scaler = ampc.GradScaler("cpu")
        >>> loss = model(x).square().mean()
        >>> scaler.scale(loss).backward()
        >>> norm = scaler.clip_grad_norm_(optimizer, max_norm=1.0)
        >>> scaler.step(optimizer)
        >>> scaler.update()
    """

    def __init__(self, device: str = "cuda", init_scale: float = 2.0 ** 16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000, enabled: bool = True, *,
                 dtype: torch.dtype | None = None, dynamic: bool = True, hysteresis: int = 1,
                 min_scale: float | None = None, max_scale: float | None = None,
                 min_scale_patience: int = 10, step_records: int = 0,
                 explain_skips: int | None = DEFAULT_AFTER, raise_on_skips: bool = False) -> None:
        if isinstance(device, (int, float)) and not isinstance(device, bool):
            if init_scale != 2.0 ** 16:
                raise TypeError("ampc.GradScaler: in the legacy form without a device, pass "
                                "the arguments after init_scale by keyword")
            device, init_scale = "cuda", device
        self._device = torch.device(device).type
        if isinstance(enabled, str):
            if enabled != "auto":
                raise ValueError(f"ampc.GradScaler: enabled must be a bool or 'auto', "
                                 f"got {enabled!r}")
            dtype = torch.get_autocast_dtype(self._device) if dtype is None else dtype
            enabled = dtype == torch.float16
        self._enabled = bool(enabled)
        if self._device == "cuda" and self._enabled and not torch.cuda.is_available():
            warnings.warn("torch.cuda.amp.GradScaler is enabled, but CUDA is not available.  "
                          "Disabling.", stacklevel=2)
            self._enabled = False
        self._init_scale = init_scale
        self._growth_factor = growth_factor
        self._backoff_factor = backoff_factor
        self._growth_interval = growth_interval
        self._init_growth_tracker = 0
        self._hysteresis = hysteresis
        self._init_hysteresis_tracker = hysteresis
        self._min_scale = min_scale
        self._max_scale = max_scale
        self._patience = min_scale_patience
        self._init_skipped, self._init_last_skipped, self._init_skips_at_min = 0, None, 0
        self.__dict__.update(dict.fromkeys(DEVICE_STATE))
        self._per_optimizer_states = defaultdict(_fresh_state)
        self._records = None
        self._skip_watch = SkipWatch(explain_skips, raise_on_skips)
        if not self._enabled:
            return
        self._check_factors(dynamic, growth_factor, backoff_factor)
        if not dynamic:
            # torch's own form of a fixed scale: update_scale multiplies by 1
            self._growth_factor = self._backoff_factor = 1.0
        self._check_extras(hysteresis, min_scale, max_scale, min_scale_patience)
        if isinstance(step_records, bool) or not isinstance(step_records, int) \
                or step_records < 0:
            raise ValueError(f"ampc.GradScaler: step_records must be an int >= 0, "
                             f"got {step_records!r}")
        self._records = deque(maxlen=step_records) if step_records else None
        if explain_skips is not None and (isinstance(explain_skips, bool)
                                          or not isinstance(explain_skips, int) or explain_skips < 1):
            raise ValueError(f"ampc.GradScaler: explain_skips must be None or an int >= 1, "
                             f"got {explain_skips!r}")
        if not isinstance(raise_on_skips, bool):
            raise ValueError(f"ampc.GradScaler: raise_on_skips must be a bool, got {raise_on_skips!r}")

    @staticmethod
    def _check_factors(dynamic, growth_factor, backoff_factor):
        if not isinstance(dynamic, bool):
            raise ValueError(f"ampc.GradScaler: dynamic must be a bool, got {dynamic!r}")
        if not dynamic:
            if (growth_factor, backoff_factor) != (2.0, 0.5):
                raise ValueError(f"ampc.GradScaler: dynamic=False keeps the scale fixed, so "
                                 f"growth_factor and backoff_factor do not apply; got "
                                 f"growth_factor={growth_factor}, "
                                 f"backoff_factor={backoff_factor}")
            return
        if growth_factor <= 1.0:
            raise AssertionError("The growth factor must be > 1.0.")
        if backoff_factor >= 1.0:
            raise AssertionError("The backoff factor must be < 1.0.")

    @staticmethod
    def _check_extras(hysteresis, min_scale, max_scale, patience):
        if isinstance(hysteresis, bool) or not isinstance(hysteresis, int) or hysteresis < 1:
            raise ValueError(f"ampc.GradScaler: hysteresis must be an int >= 1, "
                             f"got {hysteresis!r}")
        lo = 0.0 if min_scale is None else min_scale
        hi = math.inf if max_scale is None else max_scale
        if not ops._takes_scale_bounds(lo, hi):     # the kernel's rule, asked at construction
            raise ValueError(f"ampc.GradScaler: need 0 <= min_scale <= max_scale and "
                             f"max_scale > 0, got min_scale={min_scale}, max_scale={max_scale}")
        if patience is not None and (not isinstance(patience, int) or patience < 1):
            raise ValueError(f"ampc.GradScaler: min_scale_patience must be None or an int "
                             f">= 1, got {patience!r}")

    # ---- the scale, lazily on the device of the first scale() ----

    def _check_scale_growth_tracker(self, funcname):
        fix = ("This may indicate your script did not use scaler.scale(loss or outputs) "
               "earlier in the iteration.")
        if self._scale is None:
            raise AssertionError(f"Attempted {funcname} but _scale is None.  " + fix)
        return self._scale, self._growth_tracker

    def _lazy_init_scale_growth_tracker(self, dev):
        self._scale = torch.full((), self._init_scale, dtype=torch.float32, device=dev)
        self._growth_tracker = torch.full((), self._init_growth_tracker, dtype=torch.int32,
                                          device=dev)
        self._init_extras()

    def _init_extras(self):
        """The device state beyond torch's (hysteresis, the skip counters, the min_scale
        watch) from the _init_* values, as configured now."""
        dev = self._scale.device
        self._hysteresis_tracker = None
        if self._hysteresis > 1:
            self._hysteresis_tracker = torch.full((), self._init_hysteresis_tracker,
                                                  dtype=torch.int32, device=dev)
        self._skipped = torch.full((), self._init_skipped, dtype=torch.int64, device=dev)
        self._last_found_inf = None
        if self._init_last_skipped is not None:
            self._last_found_inf = torch.full((), self._init_last_skipped, dtype=torch.bool,
                                              device=dev)
        self._min_scale_watch = None
        if self._min_scale is not None and self._patience is not None:
            self._min_scale_watch = MinScaleWatch(self._min_scale, self._patience,
                                                  self._init_skips_at_min, dev)
        self._skip_watch.restart(self._skipped)

    def scale(self, outputs: _Scaled) -> _Scaled:
        """Multiplies a tensor, or each tensor of nested lists/tuples/iterables, by the scale.

        The scale is created on the device of the first tensor it sees.
        """
        if not self._enabled:
            return outputs
        copies = {}

        def scale_on(device):
            if self._scale is None:
                self._lazy_init_scale_growth_tracker(device)
            if device not in copies:
                copies[device] = self._scale.to(device=device, non_blocking=True)
            return copies[device]

        def apply(value):
            if isinstance(value, torch.Tensor):
                return _note_scaled(value * scale_on(value.device))
            if isinstance(value, abc.Iterable) and not isinstance(value, (str, bytes)):
                mapped = map(apply, value)
                if hasattr(value, "_fields"):           # a namedtuple
                    return type(value)(*mapped)
                return type(value)(mapped) if isinstance(value, (list, tuple)) else mapped
            raise ValueError("outputs must be a Tensor or an iterable of Tensors")

        return apply(outputs)

    # ---- checking and unscaling the grads ----

    def _grads_by_device(self, optimizer, allow_fp16):
        grads = defaultdict(list)
        for group in optimizer.param_groups:
            for param in group["params"]:
                if param.grad is None:
                    continue
                if not allow_fp16 and param.grad.dtype == torch.float16:
                    raise ValueError("Attempting to unscale FP16 gradients.")
                grad = param.grad
                if grad.is_sparse:
                    if grad.dtype is torch.float16:
                        # repeated indices sum on coalescing and may overflow fp16: check sums
                        param.grad = grad = grad.coalesce()
                    grad = grad._values()
                grads[grad.device].append(grad)
        return grads

    def _unscale_grads_(self, optimizer, inv_scale, allow_fp16, check_only):
        """found_inf per device after checking (and unless check_only, unscaling) the grads."""
        found = {}
        with torch.no_grad():
            for device, grads in self._grads_by_device(optimizer, allow_fp16).items():
                found[device] = torch.zeros((), dtype=torch.float32, device=device)
                # DTensor grads: the check runs on the local shards, then all ranks agree
                classes = _distributed.split_grads("ampc.GradScaler", grads)
                _unscale_check([g for _, local in classes for g in local], found[device],
                               inv_scale.to(device=device, non_blocking=True), check_only)
                _distributed.agree_found_inf(found[device], classes)
        return found

    def _inv_scale(self):
        # the reciprocal in double, rounded once: exactly torch's inv_scale
        return self._scale.double().reciprocal().float()

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divides the optimizer's gradients by the scale in place and records any inf/nan.

        Optional: call it between backward and step to work on true gradients (clip them
        with :meth:`clip_grad_norm_` instead to save a pass). At most once per optimizer
        per update(). Refuses fp16 gradients, like torch; bf16 ones are unscaled in place
        (exactly, for a power-of-two scale: bf16 has fp32's exponent range).
        """
        if not self._enabled:
            return
        _refuse_freed(optimizer, "unscale_")
        state = self._unstepped_state(optimizer, "unscale_")
        if state["stage"] is OptState.UNSCALED:
            raise RuntimeError("unscale_() has already been called on this optimizer since "
                               "the last update().")
        state["found_inf_per_device"] = self._unscale_grads_(optimizer, self._inv_scale(),
                                                             False, False)
        state["stage"] = OptState.UNSCALED

    def _unstepped_state(self, optimizer, funcname):
        self._check_scale_growth_tracker(funcname)
        state = self._per_optimizer_states[id(optimizer)]
        if state["stage"] is OptState.STEPPED:
            raise RuntimeError(f"{funcname}() is being called after step().")
        if state["folded"]:
            raise RuntimeError(f"{funcname}() cannot follow clip_grad_norm_() on this optimizer "
                               f"since the last update(): its step unscales and clips.")
        return state

    def _check_inf_per_device(self, optimizer):
        """Checks the optimizer's still-scaled gradients for inf/nan, reading them only."""
        self._check_scale_growth_tracker("_check_inf_per_device")
        one = torch.ones((), dtype=torch.float32, device=self._scale.device)
        state = self._per_optimizer_states[id(optimizer)]
        state["found_inf_per_device"] = self._unscale_grads_(optimizer, one, True, True)
        return state["found_inf_per_device"]

    def _found_inf_per_device(self, optimizer):
        return self._per_optimizer_states[id(optimizer)]["found_inf_per_device"]

    def _found_inf_sum(self, found, device):
        flags = [f.to(device=device, non_blocking=True) for f in found]
        if not flags:
            return torch.zeros((), dtype=torch.float32, device=device)
        return flags[0] if len(flags) == 1 else torch.stack(flags).sum()

    # ---- clipping ----

    def clip_grad_norm_(self, optimizer: torch.optim.Optimizer, max_norm: float,
                        norm_type: float = 2.0) -> torch.Tensor:
        """Clips the optimizer's gradients like ``torch.nn.utils.clip_grad_norm_`` after
        ``unscale_``, and returns the total norm of the unscaled gradients.

        With an ampc optimizer (``_ampc_supports_clip_coef``) and the 2-norm, the gradients
        are only read, once: that pass measures the norm and checks for inf/nan, and the
        optimizer applies the unscale and the clip factor in its own fp32 math (so fp16 and
        bf16 gradients are clipped too). Otherwise this is ``unscale_`` followed by
        ``torch.nn.utils.clip_grad_norm_``. Call it where you would call ``unscale_``.

        Args:
            optimizer (torch.optim.Optimizer): whose parameters' gradients to clip.
            max_norm (float): the largest total norm kept.
            norm_type (float): the norm's p. Default: 2.0.
        """
        _refuse_freed(optimizer, "clip_grad_norm_")
        params = [p for group in optimizer.param_groups for p in group["params"]]
        if not self._enabled:
            return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type)
        state = self._unstepped_state(optimizer, "clip_grad_norm_")
        grads = [p.grad for p in params if p.grad is not None]
        if state["stage"] is OptState.READY and self._can_fold_clip(optimizer, grads,
                                                                      norm_type):
            state["norm"] = self._fold_clip(state, grads, float(max_norm))
        else:
            if state["stage"] is OptState.READY:
                self.unscale_(optimizer)
            state["norm"] = torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type)
        return state["norm"]

    @staticmethod
    def _can_fold_clip(optimizer, grads, norm_type):
        return (getattr(optimizer, "_step_supports_amp_scaling", False)
                and getattr(optimizer, "_ampc_supports_clip_coef", False)
                and not _takes_grad_scaler(optimizer)
                and float(norm_type) == 2.0 and len(grads) > 0
                and len({g.device for g in grads}) == 1
                and all(not g.is_sparse and g.dtype in _KERNEL_DTYPES for g in grads))

    def _fold_clip(self, state, grads, max_norm):
        device = grads[0].device
        found = torch.zeros((), dtype=torch.float32, device=device)
        inv_scale = self._inv_scale().to(device=device, non_blocking=True)
        with torch.no_grad():
            # sharded grads: the norm of every rank's shards, found_inf agreed
            classes = _distributed.split_grads("ampc.GradScaler.clip_grad_norm_", grads)
            total_norm = _distributed.global_norm(
                classes, lambda local: _unscale_check(local, found, inv_scale, check_only=True))
            _distributed.agree_found_inf(found, classes)
            # torch.nn.utils.clip_grad_norm_'s factor, in fp32 on the device
            clip_coef = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
        state.update(stage=OptState.UNSCALED, folded=True, clip_coef=clip_coef,
                     found_inf_per_device={device: found})
        return total_norm

    # ---- step and update ----

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        """Runs ``optimizer.step(*args, **kwargs)`` unless the gradients hold an inf or a nan.

        Unscales first if ``unscale_`` was not called. Returns what ``optimizer.step``
        returned, or None when the step is skipped. With an optimizer that supports fused
        scaling (``_step_supports_amp_scaling``) the optimizer gets ``grad_scale`` and
        ``found_inf`` (and ``grad_clip_coef`` for ampc's) and skips on the device, so
        nothing waits; its return value is returned even for a skipped step.
        """
        if not self._enabled:
            return optimizer.step(*args, **kwargs)
        if "closure" in kwargs:
            raise RuntimeError("Closure use is not currently supported if GradScaler is "
                               "enabled.")
        self._check_scale_growth_tracker("step")
        state = self._per_optimizer_states[id(optimizer)]
        if state["stage"] is OptState.STEPPED:
            raise RuntimeError("step() has already been called since the last update().")
        if getattr(optimizer, "_step_supports_amp_scaling", False):
            retval = self._fused_step(optimizer, state, args, kwargs)
        else:
            if state["stage"] is OptState.READY:
                self.unscale_(optimizer)
            found = list(state["found_inf_per_device"].values())
            if not found:
                raise AssertionError("No inf checks were recorded for this optimizer.")
            retval = None
            # the one host sync of a step with an optimizer that cannot skip by itself
            state["host_skipped"] = bool(self._found_inf_sum(found, found[0].device).item())
            if not state["host_skipped"]:
                retval = optimizer.step(*args, **kwargs)
        state["stage"] = OptState.STEPPED
        return retval

    def _fused_step(self, optimizer, state, args, kwargs):
        """torch's protocol with an optimizer that unscales in its own step."""
        if _takes_grad_scaler(optimizer):
            # the deprecated form: the optimizer gets the scaler and asks it what it needs
            warnings.warn(_GRAD_SCALER_WARNING, FutureWarning, stacklevel=3)
            kwargs["grad_scaler"] = self
            return optimizer.step(*args, **kwargs)
        if state["stage"] is OptState.READY:
            self._check_inf_per_device(optimizer)
        optimizer.grad_scale = self._grad_scale_for(optimizer, state)
        optimizer.found_inf = self._found_inf_sum(state["found_inf_per_device"].values(),
                                                  self._scale.device)
        clip = getattr(optimizer, "_ampc_supports_clip_coef", False)
        if clip:
            optimizer.grad_clip_coef = state["clip_coef"]
        try:
            return optimizer.step(*args, **kwargs)
        finally:
            del optimizer.grad_scale
            del optimizer.found_inf
            if clip:
                del optimizer.grad_clip_coef

    def _grad_scale_for(self, optimizer, state):
        """torch's optimizer.grad_scale: after unscale_, what the optimizer holds (None if
        nothing); else a new tensor, scale * the optimizer's own grad_scale (1 if none),
        which later updates of the scale leave as it is."""
        if state["stage"] is OptState.UNSCALED and not state["folded"]:
            return getattr(optimizer, "grad_scale", None)
        return self._scale * getattr(optimizer, "grad_scale", 1)

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        """Updates the scale once per iteration, after every optimizer's step.

        Without ``new_scale``: backs off if any optimizer's step found an inf or a nan,
        otherwise counts towards a growth (a static scaler keeps the scale); on the device,
        no wait. With ``new_scale`` (a number, or a 1-element tensor on the scaler's device
        type): sets the scale to it.
        """
        if not self._enabled:
            return
        scale, tracker = self._check_scale_growth_tracker("update")
        found = [f for st in self._per_optimizer_states.values()
                 for f in st["found_inf_per_device"].values()]
        found_inf = self._found_inf_sum(found, scale.device) if found else None
        used_scale = scale.clone() if self._records is not None and found else None
        if new_scale is not None:
            self._set_scale(new_scale)
        elif found_inf is None:
            raise AssertionError("No inf checks were recorded prior to update.")
        else:
            if self._min_scale_watch is not None:
                self._min_scale_watch.note(self._scale, found_inf)
            self._update_scale(found_inf)
        if found_inf is not None:
            self._last_found_inf = found_inf != 0
            self._skipped += self._last_found_inf
            if used_scale is not None:
                self._records.append(make_record(
                    used_scale, self._last_found_inf,
                    (st["norm"] for st in self._per_optimizer_states.values()
                     if st["norm"] is not None)))
        flags = [st["host_skipped"] for st in self._per_optimizer_states.values()]
        self._per_optimizer_states = defaultdict(_fresh_state)
        report = None
        if found_inf is not None and new_scale is None:
            report = self._skip_watch.after_update(
                self, self._skipped, any(flags) if flags and None not in flags else None)
        self._skip_watch.deliver(report)
        if self._min_scale_watch is not None:
            self._min_scale_watch.check(self._skip_watch)

    def is_dynamic(self) -> bool:
        """False for static loss scaling: growth and backoff factors of 1, as in the
        checkpoint (``dynamic=False``, or a loaded checkpoint that says so)."""
        return not self._growth_factor == self._backoff_factor == 1.0

    def _update_scale(self, found_inf):
        # a static scale is multiplied by 1 (the growth tracker counts as torch's would);
        # the bounds are the dynamic rule's and must not move it
        dynamic = self.is_dynamic()
        lo = (self._min_scale or 0.0) if dynamic else 0.0
        hi = self._max_scale if dynamic and self._max_scale is not None else math.inf
        ops.update_scale(self._scale, self._growth_tracker, found_inf, self._growth_factor,
                         self._backoff_factor, self._growth_interval,
                         hysteresis=self._hysteresis,
                         hysteresis_tracker=self._hysteresis_tracker,
                         min_scale=lo, max_scale=hi)

    def _set_scale(self, new_scale):
        if isinstance(new_scale, (int, float)) and not isinstance(new_scale, bool):
            self._scale.fill_(new_scale)
            return
        reason = ("new_scale should be a float or a 1-element torch.cuda.FloatTensor or "
                  "torch.FloatTensor with requires_grad=False.")
        if not isinstance(new_scale, torch.Tensor):
            raise AssertionError(reason)
        if new_scale.device.type != self._device or new_scale.numel() != 1 \
                or new_scale.requires_grad:
            raise AssertionError(reason)
        self._scale.copy_(new_scale.reshape(()))

    # ---- skipped steps ----

    def skipped_steps(self) -> torch.Tensor:
        """The number of iterations (update() calls) in which a step found an inf or a nan
        and was skipped, as a 0-dim int64 tensor on the scale's device. Reading its value
        (``int(...)``) waits for the device; keeping the tensor does not."""
        if not self._enabled:
            return torch.zeros((), dtype=torch.int64)
        if self._skipped is None:       # before the first scale(): the loaded count
            return torch.tensor(self._init_skipped, dtype=torch.int64)
        return self._skipped.clone()

    def last_step_skipped(self) -> torch.Tensor:
        """Whether a step of the last update()'s iteration was skipped, as a 0-dim bool
        tensor on the scale's device (``bool(...)`` waits for the device)."""
        if not self._enabled:
            return torch.zeros((), dtype=torch.bool)
        if self._last_found_inf is None:
            # before the first scale(): what the checkpoint held (None: no step yet)
            return torch.tensor(bool(self._init_last_skipped))
        return self._last_found_inf

    def step_records(self) -> list[StepRecord]:
        """The kept :class:`StepRecord` s, oldest first, as device tensors (no wait); [] unless
        built with ``step_records=N``. One is added by each update() after a step."""
        return [] if self._records is None else list(self._records)

    def read_step_records(self, clear: bool = True) -> list[dict[str, Any]]:
        """The kept records read to the host in one transfer (see
        :func:`read_step_records`), oldest first; ``clear`` drops them once read, so that
        the next call returns only the iterations since this one."""
        records = self.step_records()
        if clear and self._records is not None:
            self._records.clear()
        return read_step_records(records)

    # ---- getters, setters, persistence ----

    def _get_scale_async(self):
        return self._scale

    def get_scale(self) -> float:
        """The current scale as a float (waits for the device); 1.0 when disabled."""
        if not self._enabled:
            return 1.0
        return self._init_scale if self._scale is None else self._scale.item()

    def get_growth_factor(self) -> float:
        return self._growth_factor

    def set_growth_factor(self, new_factor: float) -> None:
        self._growth_factor = new_factor

    def get_backoff_factor(self) -> float:
        return self._backoff_factor

    def set_backoff_factor(self, new_factor: float) -> None:
        self._backoff_factor = new_factor

    def get_growth_interval(self) -> int:
        return self._growth_interval

    def set_growth_interval(self, new_interval: int) -> None:
        self._growth_interval = new_interval

    def _get_growth_tracker(self):
        if not self._enabled:
            return 0
        if self._growth_tracker is None:
            return self._init_growth_tracker
        return self._growth_tracker.item()

    def _get_hysteresis_tracker(self):
        if self._hysteresis_tracker is None:
            return self._init_hysteresis_tracker
        return self._hysteresis_tracker.item()

    def is_enabled(self) -> bool:
        return self._enabled
