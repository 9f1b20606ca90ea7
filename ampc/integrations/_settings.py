"""The settings every integration takes, checked here once (the low dtype, the scaler, the
forward's cast policy, FP8, autocast's weight cache, master weights) with the same messages in
every framework, and the forward's region they describe."""
from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

import ampc

Recipe = ampc.fp8.DelayedScaling | ampc.fp8.Float8CurrentScaling

_LOW = (torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class Settings:
    """What an integration does differently from the framework's own mixed precision."""
    device: str
    dtype: torch.dtype
    scaler: ampc.GradScaler | None
    policy: dict[str, str]
    fp8: Recipe | None
    fp8_modules: tuple[type[nn.Module], ...]
    cache_enabled: bool | None
    master_weights: bool
    compress: tuple[str, ...] = ()     # modules whose saved activations are kept in 8 bits
    recompute: tuple[str, ...] = ()    # modules recomputed in the backward
    sliced_head: tuple[str, ...] = ()  # heads whose logits the loss makes a slice at a time
    plan: ampc.autoprecision.Plan | None = None    # chooses all of the above instead

    @contextlib.contextmanager
    def region(self) -> Iterator[None]:
        """ampc.autocast, inside it ampc.policy.scope(ops=policy) and ampc.fp8.autocast if asked;
        with a plan, the plan's region."""
        if self.plan is not None:
            with self.plan.autocast():
                yield
            return
        with contextlib.ExitStack() as stack:
            stack.enter_context(ampc.autocast(self.device, dtype=self.dtype,
                                              cache_enabled=self.cache_enabled))
            if self.policy:
                stack.enter_context(ampc.policy.scope(ops=self.policy))
            if self.fp8 is not None:
                stack.enter_context(ampc.fp8.autocast(recipe=self.fp8, modules=self.fp8_modules))
            yield

    def convert_fp8(self, module: nn.Module) -> nn.Module:
        """``module`` with its ``fp8_modules`` as ``ampc.fp8.Linear`` when FP8 is asked."""
        if self.fp8 is not None:
            ampc.fp8.convert(module, self.fp8_modules)
        return module

    def convert(self, module: nn.Module) -> nn.Module:
        """``module`` with its FP8 modules converted (:meth:`convert_fp8`), then the modules
        named in ``compress`` keeping their saved activations in 8 bits
        (``ampc.memory.compress``) and those in ``recompute`` recomputed in the backward
        (``ampc.memory.recompute``), and the heads in ``sliced_head`` deferring their logits to
        the loss (``ampc.memory.sliced_head``); the names are ``module``'s own (patterns
        allowed)."""
        self.convert_fp8(module)
        if self.compress:
            ampc.memory.compress(module, list(self.compress), "8bit")
        if self.recompute:
            ampc.memory.recompute(module, list(self.recompute))
        if self.sliced_head:
            ampc.memory.sliced_head(module, list(self.sliced_head))
        return module

    def make_master_weights(self, name: str, which: str, model: nn.Module,
                            optimizer: torch.optim.Optimizer) -> None:
        """``ampc.prepare``: ``model``'s weights in ``dtype``, fp32 masters in ``optimizer``."""
        if not isinstance(optimizer, ampc.optim.Adam):
            raise TypeError(f"{name}(master_weights=True): {which} is "
                            f"{type(optimizer).__name__}; master weights need ampc.optim.Adam "
                            "or ampc.optim.AdamW")
        ampc.prepare(model, optimizer, self.dtype)

    def set_up_plan(self, name: str, model: nn.Module,
                    optimizer: torch.optim.Optimizer | None = None) -> None:
        """The plan on the module of ``model`` it was searched on (``model`` itself or the
        outermost module inside it holding every module the plan names): with ``optimizer``
        (made by the framework over the model's parameters, before its first step) the
        weights and the optimizer's state as the plan chose, then each module's precision,
        saved activations, recompute and sliced heads (``Plan.prepare``)."""
        target = plan_target(name, self.plan, model)
        if optimizer is not None:
            self.plan.prepare_state(target, optimizer)
        else:
            _state_made(name, self.plan, target)
        self.plan.apply(target)


def _state_made(name: str, plan: ampc.autoprecision.Plan, model: nn.Module) -> None:
    """Refuses, by name, a model whose weights and optimizer the plan's step has not been
    made on (``plan.prepare_state``) where the framework hands over the model alone."""
    step = plan.step
    params = [p for p in model.parameters() if p.is_floating_point()]
    low = step.state != "fp32" and not any(p.dtype == torch.bfloat16 for p in params)
    hooked = step.grads_freed and not any(getattr(p, "_post_accumulate_grad_hooks", None)
                                          for p in params)
    if low or hooked:
        what = ([f"keeps the {step.state} state (bf16 weights)"] if low else []) + \
            (["frees each gradient in the backward"] if hooked else [])
        raise ValueError(f"{name}: the plan {' and '.join(what)}, which takes the optimizer, and "
                         "the framework hands its precision plugin the model alone: call "
                         "model, optimizer = plan.prepare_state(model, optimizer) before "
                         "fabric.setup(model, optimizer)")


def plan_target(name: str, plan: ampc.autoprecision.Plan, model: nn.Module) -> nn.Module:
    """The module of ``model`` (itself first, then the outermost inside) whose names are the
    plan's: a framework wraps the searched model (a LightningModule holding it)."""
    wanted = [u.module for u in plan]
    for m in model.modules():
        names = dict(m.named_modules())
        if all(w in names for w in wanted):
            return m
    names = dict(model.named_modules())
    missing = next(w for w in wanted if w not in names)
    raise ValueError(f"{name}: the plan names module {missing!r}, which neither the model "
                     f"({type(model).__name__}) nor any module inside it has")


def check(name: str, device: str, dtype: torch.dtype, *, scaler: ampc.GradScaler | None = None,
          dynamic: bool = True, init_scale: float = 2.0 ** 16,
          policy: Mapping[str, str] | None = None, fp8: bool | Recipe | None = None,
          fp8_modules: tuple[type[nn.Module], ...] = (nn.Linear,),
          cache_enabled: bool | None = None, master_weights: bool = False,
          compress: str | Sequence[str] | None = None,
          recompute: str | Sequence[str] | None = None,
          sliced_head: str | Sequence[str] | None = None,
          plan: ampc.autoprecision.Plan | str | os.PathLike | None = None) -> Settings:
    """The integration ``name``'s settings, checked before anything is changed; fp16 gets a new
    ``ampc.GradScaler(device, init_scale=init_scale, dynamic=dynamic)`` unless given one. A
    ``plan`` (or the path of its file) chooses the dtype (``dtype`` None, or the plan's),
    the precision of each module, master weights and the optimizer's state, and the memory
    moves: given with any of those it is refused."""
    if plan is not None:
        plan = _plan(name, plan)
        chosen = {"policy": policy, "fp8": fp8, "cache_enabled": cache_enabled,
                  "master_weights": master_weights, "compress": compress,
                  "recompute": recompute, "sliced_head": sliced_head}
        clash = [k for k, v in chosen.items() if v not in (None, False)]
        if clash:
            raise ValueError(f"{name}: the plan chooses {', '.join(clash)}; pass the plan alone")
        k = plan.step.micro_batches
        if k > 1:
            raise ValueError(
                f"{name}: the plan runs each batch as {k} micro-batches, which the framework's "
                f"loop does not do: give it batches {k} times smaller with its gradient "
                f"accumulation over {k} (Lightning: accumulate_grad_batches={k}; Accelerate: "
                f"gradient_accumulation_steps={k})")
        region = torch.float16 if plan.dtype == "fp16" else torch.bfloat16
        if dtype is not None and plan.dtype != "fp32" and dtype != region:
            raise ValueError(f"{name}: the plan trains in a {plan.dtype} region; dtype is {dtype} "
                             "(leave it unset)")
        dtype = region
        if scaler is None and plan.needs_scaler():
            scaler = ampc.GradScaler(device, init_scale=init_scale, dynamic=dynamic)
    if dtype not in _LOW:
        raise ValueError(f"{name}: dtype must be torch.bfloat16 or torch.float16, got {dtype}")
    if scaler is not None and dtype != torch.float16 and not (plan is not None and plan.needs_scaler()):
        raise ValueError(f"{name}: bfloat16 needs no loss scaling; got scaler={scaler!r}")
    if scaler is not None and not isinstance(scaler, ampc.GradScaler):
        raise TypeError(f"{name}: scaler must be an ampc.GradScaler, got {type(scaler).__name__}")
    if scaler is None and dtype == torch.float16:
        scaler = ampc.GradScaler(device, init_scale=init_scale, dynamic=dynamic)
    return Settings(device, dtype, scaler, dict(policy or {}), fp8_recipe(name, fp8),
                    tuple(fp8_modules), cache_enabled, bool(master_weights),
                    module_names(name, "compress", compress),
                    module_names(name, "recompute", recompute),
                    module_names(name, "sliced_head", sliced_head), plan)


def _plan(name: str, plan: Any) -> ampc.autoprecision.Plan:
    if isinstance(plan, (str, os.PathLike)):
        return ampc.autoprecision.Plan.load(os.fspath(plan))
    if not isinstance(plan, ampc.autoprecision.Plan):
        raise TypeError(f"{name}: plan must be an ampc.autoprecision.Plan or the path of its "
                        f"file, got {type(plan).__name__}")
    return plan


def module_names(name: str, arg: str, value: str | Sequence[str] | None) -> tuple[str, ...]:
    """The module names (or patterns) an argument like ``compress=`` gives, as a tuple."""
    if value is None:
        return ()
    names = (value,) if isinstance(value, str) else value
    if not isinstance(names, (list, tuple)) or not names or \
            not all(isinstance(n, str) and n for n in names):
        raise TypeError(f"{name}: {arg} must be a module name (or pattern) or a non-empty list "
                        f"of them, got {value!r}")
    return tuple(names)


def fp8_recipe(name: str, fp8: bool | Recipe | None) -> Recipe | None:
    """The recipe an ``fp8=`` argument asks for: None, True (``DelayedScaling()``) or a recipe."""
    if fp8 is None or fp8 is False:
        return None
    if fp8 is True:
        return ampc.fp8.DelayedScaling()
    if not isinstance(fp8, (ampc.fp8.DelayedScaling, ampc.fp8.Float8CurrentScaling)):
        raise TypeError(f"{name}: fp8 must be a bool or an ampc.fp8 recipe, "
                        f"got {type(fp8).__name__}")
    return fp8


def recipe_named(name: str, recipe: str) -> Recipe:
    """The recipe a configuration names: ``"delayed"`` or ``"current"``."""
    if recipe == "delayed":
        return ampc.fp8.DelayedScaling()
    if recipe == "current":
        return ampc.fp8.Float8CurrentScaling()
    raise ValueError(f"{name}: recipe must be 'delayed' or 'current', got {recipe!r}")
