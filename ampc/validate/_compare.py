"""compare(): train the same model on the same batches under fp32 and under each
mixed-precision setup, and measure how far each one drifts from fp32.

The setups (each in float16 or bfloat16) are the records of _setups.py.

Every run builds its model with ``make_model()`` right after ``torch.manual_seed(seed)``,
so all runs of one seed start from the same weights (checked before any training), and
every run sees the same batches. fp32 and each setup train from every seed: a setup is
judged by its loss difference to fp32 of the same seed over the last quarter of the steps,
against the same difference between fp32's seeds (see ``Comparison``).
"""
from __future__ import annotations  # "X | None" hints on Python 3.9 too; none evaluated at import

import contextlib
import gc
import math
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

import torch

import ampc      # its fp8 attribute loads ampc.fp8 (and torch._dynamo) on first use only
from .._numerics import failures
from .._numerics.model import call_model, default_loss, to_device
from ..memory.peak import allocated_peak, start_profiler, stop_profiler
from ..memory import micro_batch_backward as micro_backward
from . import _setups
from ._report import Comparison
from ._run import Run

FN = "ampc.validate.compare"
SETUPS = tuple(n for n, s in _setups.REGISTRY.items() if s.default)
PLAN_SETUP = "ampc.auto"      # an ampc.autoprecision.Plan given as a setup
MEMORY_PLAN_SETUP = "ampc.memory"    # one searched with objective="memory"
CONTRAST_SETUPS = ("torch.amp.noscale", "pure")     # what mixed precision guards against
LEAN_SETUP = "ampc.lean"
ALL_SETUPS = tuple(n for n in _setups.REGISTRY if n != "fp32")
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
DEFAULT_DTYPE = {"cpu": torch.bfloat16, "cuda": torch.float16}


def parse_setup(spec, dtype):
    """'ampc' or 'ampc@fp16' -> ('ampc', torch.float16); ``dtype`` when no suffix. An
    ampc.autoprecision.Plan is its own setup: (plan, dtype)."""
    if _is_plan(spec):
        return spec, dtype
    if not isinstance(spec, str):
        raise TypeError(f"ampc.validate: a setup must be a string like 'ampc' or 'ampc@fp16', "
                        f"got {type(spec).__name__}")
    kind, _, suffix = spec.partition("@")
    if kind not in _setups.REGISTRY or kind == "fp32":
        known = [n for n in _setups.REGISTRY if n != "fp32"]
        raise ValueError(f"ampc.validate: unknown setup {kind!r}; choose from {', '.join(known)} "
                         f"(optionally with @fp16 or @bf16)")
    if suffix:
        if suffix not in DTYPES:
            raise ValueError(f"ampc.validate: setup {spec!r}: dtype must be fp16 or bf16, "
                             f"got {suffix!r}")
        dtype = DTYPES[suffix]
    return kind, dtype


@runtime_checkable
class PlanSetup(Protocol):
    """What a setup given as an object (an ampc.autoprecision.Plan) offers: a region dtype
    name, whether it needs a GradScaler, ``apply(model)``, its ``autocast()`` region and
    ``loss(loss_fn)``, the loss at the precision the plan chose for it."""
    dtype: str

    def loss(self, loss_fn: Any) -> Any: ...

    def apply(self, model: torch.nn.Module) -> Any: ...

    def autocast(self) -> Any: ...

    def needs_scaler(self) -> bool: ...


def _is_plan(spec):
    return not isinstance(spec, str) and isinstance(spec, PlanSetup)


# ---- memory ----

class _PeakMemory:
    """Peak memory of live tensors a run adds over what was alive when it started (before its
    model is built), over its first steps.

    CUDA: torch.cuda.max_memory_allocated. CPU: the highest running sum of the tensor
    allocations and frees torch's profiler records meanwhile, as ``ampc.memory.report``
    counts them: not the allocator's cache, nor a library's own scratch (a process's resident
    set mixes those in, and at small sizes they were most of it). None elsewhere, and on the
    CPU when the caller is profiling already.
    """

    def __init__(self, device):
        self.device = device
        self.base = self.prof = self.peak = None

    def start(self):
        gc.collect()
        if self.device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
        elif self.device == "cpu" and not torch.autograd._profiler_enabled():
            # (under the caller's own profiler: not measured, which would end theirs)
            self.prof = start_profiler()

    def peak_mib(self):
        """The peak so far, in MiB; the first call ends the measurement (the same figure
        after)."""
        if self.peak is None:
            if self.device == "cuda":
                self.peak = (torch.cuda.max_memory_allocated() - self.base) / 2**20
            elif self.prof is not None:
                stop_profiler(self.prof)
                self.peak = allocated_peak(self.prof, torch.device("cpu")) / 2**20
                self.prof = None
        return self.peak


# ---- one run ----

def _progress(total, label, enabled, position=None):
    """A tqdm bar when tqdm is installed, else a line every 10% of the run."""
    if not enabled:
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:
        tqdm = None
    if tqdm is not None:
        return tqdm(total=total, desc=f"{label:<18}", unit="step", leave=True, dynamic_ncols=True,
                    position=position)

    class Lines:
        n = 0

        def update(self, k=1):
            self.n += k
            if self.n == self.total or self.n % max(1, self.total // 10) == 0:
                print(f"{label}: step {self.n}/{self.total}", flush=True)

        def set_postfix_str(self, s):
            pass

        def refresh(self):
            pass

        def close(self):
            pass
    bar = Lines()
    bar.total = total
    return bar


def _grad_norm(model):
    """The global L2 norm of the gradients; NaN where none is left to read (a plan that frees
    each gradient in the backward), which the report shows as "-", not as a zero norm."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    if not grads:
        return float("nan")
    norms = torch.stack([torch.linalg.vector_norm(g, dtype=torch.float32) for g in grads])
    return torch.linalg.vector_norm(norms).item()


class Trainer:
    """One setup being trained: its model, optimizer, scaler, autocast region and Run.

    Keeps its own random state (dropout draws), so that runs trained in lockstep draw
    the same numbers as runs trained one after another.
    """

    def __init__(self, kind, dtype, make_model, *, loss_fn=None, lr=1e-3, seed=0,
                 device="cpu", name=None, monitor=None, memory_steps=3):
        plan = kind if _is_plan(kind) else None
        if plan is not None and monitor is not None:
            plan = type(plan).from_json(plan.to_json())  # its monitor may raise modules: this run's own
        if plan is not None:
            memory = (getattr(plan, "data", None) or {}).get("objective") == "memory"
            kind = MEMORY_PLAN_SETUP if memory else PLAN_SETUP
            dtype = {"fp16": torch.float16}.get(plan.dtype, torch.bfloat16)
        self.loss_fn = plan.loss(loss_fn) if plan is not None else loss_fn or default_loss
        step = getattr(plan, "step", None)
        self.micro_batches = getattr(step, "micro_batches", 1)
        self.device = device
        dname = "fp32" if kind == "fp32" else DTYPE_NAMES[dtype]
        if plan is not None:
            name, dname = name or kind.replace(".", " "), plan.dtype
        self.run = Run(name or (kind if kind == "fp32" else f"{kind} {dname}"), kind, dname, seed)
        self.memory_steps = memory_steps        # the peak is that of the first steps
        self.memory = _PeakMemory(device)
        self.memory.start()
        try:
            model = _build(make_model, seed).to(device)
            for pname, p in model.named_parameters():
                if p.is_floating_point() and p.dtype != torch.float32:
                    raise ValueError(f"ampc.validate: make_model() must return an fp32 model; "
                                     f"parameter {pname} is {p.dtype}")
            model.train()
            fp16 = dtype == torch.float16 and kind != "fp32"
            self.monitor = None
            if plan is not None:
                # the weights, optimizer state and gradient release the plan chose, if any
                prepare = getattr(plan, "prepare_state", None)
                model, self.opt = (prepare(model, ampc.optim.AdamW, lr=lr) if prepare else
                                   (model, ampc.optim.AdamW(model.parameters(), lr=lr)))
                applied = plan.apply(model)
                if monitor is not None:
                    self.monitor = applied.monitor(loss_fn, **monitor)
                self.scaler = _setups.scaler("ampc" if plan.needs_scaler() else None, device)
                self.region = plan.autocast
            else:
                setup = _setups.REGISTRY[kind]
                model, self.opt = setup.build(model, dtype, lr)
                self.scaler = _setups.scaler(setup.scaler if fp16 else None, device)
                self.region = lambda: setup.region(device, dtype)     # noqa: E731
        except BaseException:
            self.memory.peak_mib()      # ends the measurement (the profiler) first
            raise
        self.model = model
        self.sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
        torch.manual_seed(seed)                 # the same dropout draws in every setup
        self.rng = self._get_rng()
        self.bar = None

    def _get_rng(self):
        return (torch.get_rng_state(),
                torch.cuda.get_rng_state() if self.device == "cuda" else None)

    def _set_rng(self, state):
        torch.set_rng_state(state[0])
        if state[1] is not None:
            torch.cuda.set_rng_state(state[1])

    def step(self, batch):
        """:meth:`timed_step`; a failure is raised as an ampc error naming the run, the
        step and, where ampc can tell, the cause and what to do."""
        try:
            self.timed_step(batch)
            if len(self.run.losses) == self.memory_steps:
                self.run.peak_mib = self.memory.peak_mib()
        except Exception as e:
            self.memory.peak_mib()      # ends the measurement (the profiler) first
            if str(e).startswith("ampc"):
                raise
            k = len(self.run.losses)
            err = failures.batch_error(FN, e, batch, k) if self.run.kind == "fp32" else None
            if err is not None:
                raise err from e
            hint = failures.explain(FN, e, self.model, batch[0], self.device)
            raise RuntimeError(f"{FN}: {self.run.name} failed at step {k}: {type(e).__name__}: "
                               f"{str(e).splitlines()[0][:200]}" + (f"; {hint}" if hint else "")
                               ) from e

    def timed_step(self, batch):
        """One timed training step (forward, backward, optimizer); loss, grad norm and
        scale are read outside the timed part (each syncs the device)."""
        run, opt, scaler = self.run, self.opt, self.scaler
        self._set_rng(self.rng)
        self.sync()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)

        def loss_of(piece):
            with self.region():
                out = call_model(self.model, piece[0])
            return self.loss_fn(out, piece[1])
        # a plan's batch may run as micro-batches (their gradients summed)
        loss = micro_backward(opt, batch, self.micro_batches, loss_of, scaler)
        self.sync()
        t1 = time.perf_counter()
        scale = scaler.get_scale() if scaler else 1.0
        run.losses.append(loss.item())
        run.grad_norms.append(_grad_norm(self.model) / scale)
        run.scales.append(scale)
        self.sync()
        t2 = time.perf_counter()
        if scaler:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        self.sync()
        run.step_ms.append((t1 - t0 + time.perf_counter() - t2) * 1e3)
        if self.monitor is not None:     # after the timed part: its checks are not the step's
            norm = run.grad_norms[-1]
            self.monitor.step(batch, loss=loss.detach().float(),
                              grad_norm=torch.tensor(norm) if math.isfinite(norm) else None)
        if scaler and scaler.get_scale() < scale:
            run.skipped.append(len(run.losses) - 1)
        self.rng = self._get_rng()
        if self.bar:
            self.bar.update(1)
            if len(run.losses) % 10 == 1:
                self.bar.set_postfix_str(f"loss {run.losses[-1]:.3f}")

    def finish(self, val_batches=()):
        """Closes the progress bar, evaluates, and returns the Run (with model, optimizer)."""
        if self.bar:
            self.bar.set_postfix_str(f"loss {self.run.losses[-1]:.3f}")
            self.bar.close()
        if self.run.peak_mib is None:
            self.run.peak_mib = self.memory.peak_mib()
        if val_batches:
            self.run.val_loss = evaluate(self.model, val_batches, self.loss_fn, self.region)
        self.run.model, self.run.optimizer = self.model, self.opt
        if self.monitor is not None:
            self.run.monitor = {"spikes": self.monitor.spikes,
                                "decisions": self.monitor.decisions}
        return self.run


def _build(make_model, seed):
    """``make_model()`` right after ``torch.manual_seed(seed)``, checked to be a module."""
    torch.manual_seed(seed)
    model = make_model()
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"ampc.validate: make_model() must return an nn.Module, "
                        f"got {type(model).__name__}")
    return model


def check_make_model(make_model, seeds):
    """Refuses, before any training, a ``make_model`` whose runs could not be compared:
    one that builds a different architecture (parameter names and shapes) on some call,
    or different weights for the same seed. Builds the model twice for the first seed
    and once for each other seed."""
    ref = {k: p.detach().clone() for k, p in _build(make_model, seeds[0]).named_parameters()}
    for i, seed in enumerate(seeds):
        got = dict(_build(make_model, seed).named_parameters())
        if got.keys() != ref.keys():
            diff = sorted(ref.keys() ^ got.keys())[:3]
            raise ValueError(f"{FN}: make_model() built a different architecture on another call "
                             f"(seed {seed} against seed {seeds[0]}: parameters {diff} are in "
                             "one and not the other); it must build the same model every call")
        for k, p in got.items():
            if p.shape != ref[k].shape:
                raise ValueError(f"{FN}: make_model() built a different architecture on another "
                                 f"call (seed {seed} against seed {seeds[0]}: parameter {k} is "
                                 f"{list(p.shape)}, was {list(ref[k].shape)}); it must build the "
                                 "same model every call")
            if i > 0:
                continue
            # the first seed's second build must start from the same weights as its first
            p, r = p.detach().cpu(), ref[k].cpu()
            if not (p.dtype == r.dtype and torch.allclose(p, r, rtol=0, atol=0, equal_nan=True)):
                raise ValueError(f"{FN}: make_model() gave different weights for the same seed "
                                 f"{seed} (parameter {k}): it must draw them from torch's "
                                 "global generator, which compare seeds before each call, or "
                                 "load them, so that every run of a seed starts from the same "
                                 "weights")


def train_one(kind, dtype, make_model, batches, *, val_batches=(), progress=False, **kwargs):
    """Trains one setup over ``batches`` (a list of (inputs, target) already on the device)
    and returns its :class:`Run` (the trained model and optimizer in ``run.model`` and
    ``run.optimizer``)."""
    t = Trainer(kind, dtype, make_model, **kwargs)
    t.bar = _progress(len(batches), t.run.name, progress)
    for batch in batches:
        t.step(batch)
    return t.finish(val_batches)


def train_lockstep(specs, make_model, batches, *, time_limit, val_batches=(), progress=False,
                   memory_steps=3, **kwargs):
    """Trains every (kind, dtype, seed, name) in ``specs`` step by step in turn and stops
    all of them at the same step once the next round would pass ``time_limit`` seconds
    (evaluation included). Each run's memory is measured over its first ``memory_steps``
    steps, taken before the next run is built. Returns the Runs."""
    t0 = time.perf_counter()
    trainers = []
    first = min(memory_steps, len(batches))
    for i, (kind, dtype, seed, name) in enumerate(specs):
        t = Trainer(kind, dtype, make_model, seed=seed, name=name, memory_steps=first,
                    **kwargs)
        t.bar = _progress(len(batches), t.run.name, progress, position=i)
        for batch in batches[:first]:       # its peak: measured alone, before the next is built
            t.step(batch)
        trainers.append(t)
    eval_rounds = len(val_batches) / 3          # a forward pass is about a third of a step
    rounds = []
    for k in range(first, len(batches)):
        r0 = time.perf_counter()
        for t in trainers:
            t.step(batches[k])
        rounds.append(time.perf_counter() - r0)
        round_s = statistics.mean(rounds[-5:])
        left = time_limit - (time.perf_counter() - t0) - round_s * eval_rounds
        if left < round_s:
            break
        if progress and math.isfinite(left):    # the step all runs are now expected to stop at
            for t in trainers:
                t.bar.total = min(len(batches), k + 1 + int(left / round_s))
                t.bar.refresh()
    return [t.finish(val_batches) for t in trainers]


def evaluate(model: torch.nn.Module, batches: Sequence[tuple], loss_fn: Callable | None = None,
             region: Callable[[], Any] = contextlib.nullcontext) -> float:
    """Mean loss of ``model`` over ``batches`` without gradients, inside ``region()``."""
    loss_fn = loss_fn or default_loss
    was_training = model.training
    model.eval()
    total = 0.0
    with torch.no_grad():
        for inputs, target in batches:
            with region():
                out = call_model(model, inputs)
            total += loss_fn(out, target).item()
    model.train(was_training)
    return total / len(batches)


# ---- compare ----

def compare(make_model: Callable[[], torch.nn.Module], make_batch: Callable[[int], tuple],
            loss_fn: Callable | None = None, steps: int = 100, setups: Sequence[str] = SETUPS, *,
            dtype: torch.dtype | None = None, device: str | None = None, lr: float = 1e-3,
            seeds: Sequence[int] = (0, 1), val_batches: Sequence[tuple] | None = None,
            progress: bool = True, time_limit: float | None = None,
            paired: bool = True, monitor: dict | None = None) -> "Comparison":
    """Trains fp32 and each mixed-precision setup on the same batches from the same weights.

    Args:
        make_model: callable returning a fresh fp32 ``nn.Module``; called once per run
            right after ``torch.manual_seed(seed)``, so it must draw its weights from
            torch's global generator (or load them) to give the same weights each time.
        make_batch: callable ``make_batch(step) -> (inputs, target)``; ``inputs`` is a
            tensor or a tuple of the model's positional arguments. Called once per step,
            and the batches are reused by every run.
        loss_fn: ``loss_fn(output, target) -> scalar``. Default: cross-entropy over the
            output's last dimension, in fp32.
        steps (int): optimizer steps per run.
        setups: names from ``ampc.validate.SETUPS`` (the default), ``"ampc.fp8"`` (its
            nn.Linear layers need in and out features that are multiples of 16),
            ``"ampc.lean"`` (ampc master weights' setup with ``state="lean"``: no master
            copy, stochastic rounding, 8-bit moments), or the
            contrasts ``"torch.amp.noscale"`` (torch.amp without loss scaling) and ``"pure"``
            (16-bit weights and a plain optimizer, no master weights), each
            optionally suffixed ``@fp16`` or ``@bf16`` (``"ampc.master@fp16"``).
        dtype: the default 16-bit dtype: torch.bfloat16 on the CPU, torch.float16 on CUDA.
        device (str): "cpu" or "cuda"; default: cuda when available.
        lr (float): AdamW learning rate (the same for every run).
        seeds: every seed trains fp32 and (with ``paired``) every setup: each setup is
            judged by its loss difference to fp32 of the same seed, averaged over the seeds,
            against fp32's run-to-run spread between seeds. ``(0,)`` skips the spread.
        val_batches: optional list of (inputs, target): each run's final validation loss.
        progress (bool): a progress bar per run (tqdm if installed).
        time_limit (float): seconds. When given, the runs are trained in lockstep (step k
            of every run before step k + 1 of any; all models are held at once) and all
            stop at the same step once the next would pass the limit; each run's memory
            is then measured over its first steps. Default: one run after another.
        paired (bool): train each setup from every seed (default); False trains the setups
            from the first seed only (fewer runs, a verdict from one paired gap).
        monitor (dict): an ``ampc.autoprecision`` plan among the setups trains with
            ``plan.apply(model).monitor(loss_fn, **monitor)`` watching it (each run on its
            own copy of the plan): every step hands it the batch, the loss and the gradient
            norm (its spikes), outside the step's time. What it saw and did is each run's
            ``monitor`` record and a line under the table. None (default): no monitor.

    Returns:
        :class:`ampc.validate.Comparison`: ``.table()``, ``.as_dict()``, ``.save(dir)``.
    """
    device = _resolve_device("compare", device)
    if not callable(make_model) or not callable(make_batch):
        raise TypeError("ampc.validate.compare: make_model and make_batch must be callables")
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
        raise ValueError(f"ampc.validate.compare: steps must be a positive int, got {steps!r}")
    if isinstance(setups, str):
        setups = (setups,)
    seeds = tuple(seeds)
    if not seeds or not all(isinstance(s, int) for s in seeds):
        raise ValueError(f"ampc.validate.compare: seeds must be a non-empty list of ints, "
                         f"got {seeds!r}")
    dtype = dtype or DEFAULT_DTYPE[device]
    if dtype not in DTYPE_NAMES:
        raise ValueError(f"ampc.validate.compare: dtype must be torch.float16 or "
                         f"torch.bfloat16, got {dtype}")
    parsed = [parse_setup(s, dtype) for s in setups]
    loss_fn = failures.checked_loss(FN, loss_fn)
    check_make_model(make_model, seeds)
    batches = [to_device(make_batch(k), device) for k in range(steps)]
    val = [to_device(b, device) for b in val_batches] if val_batches else []
    others = seeds[1:] if paired else ()
    specs = ([("fp32", None, seeds[0], None)]
             + [("fp32", None, s, f"fp32 seed {s}") for s in seeds[1:]]
             + [(kind, dt, s, None) for s in (seeds[0],) + others for kind, dt in parsed])
    if monitor is not None and not isinstance(monitor, dict):
        raise TypeError(f"ampc.validate.compare: monitor must be a dict of Monitor arguments "
                        f"or None, got {type(monitor).__name__}")
    common = dict(loss_fn=loss_fn, lr=lr, device=device, val_batches=val, progress=progress,
                  monitor=monitor)
    if time_limit is None:
        done = [train_one(kind, dt, make_model, batches, seed=seed, name=name, **common)
                for kind, dt, seed, name in specs]
    else:
        done = train_lockstep(specs, make_model, batches, time_limit=time_limit, **common)
    config = {"steps": len(done[0].losses), "steps_planned": steps, "device": device,
              "dtype": DTYPE_NAMES[dtype], "lr": lr, "seeds": list(seeds),
              "lockstep": time_limit is not None, "paired": bool(others),
              "torch": torch.__version__,
              "cpu_capability": torch.backends.cpu.get_cpu_capability()}
    setups_at = [done[len(seeds) + i * len(parsed):][:len(parsed)] for i in range(1 + len(others))]
    for runs, s in zip(setups_at[1:], others):
        for r in runs:
            r.name += f" seed {s}"
    return Comparison(done[0], setups_at[0], done[1:len(seeds)], config,
                      [list(p) for p in zip(*setups_at[1:])] if others else None)


def _resolve_device(fn, device):
    """The device to run on: the one asked for, checked, or the GPU when there is one."""
    if device is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device not in ("cpu", "cuda"):
        raise ValueError(f"ampc.validate.{fn}: device must be 'cpu' or 'cuda', got {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"ampc.validate.{fn}: device 'cuda' asked for, but torch sees no GPU")
    return device
