"""Spikes of a training signal (the loss, the gradient norm) against its own recent
history, watched on the device.

Each step the value's log is compared with an exponential moving mean and variance of the
earlier steps' logs: a spike is a value above exp(mean + max(k std, log(1 + rise))), after
`warmup` steps. Spikes and non-finite values do not enter the history, so one spike does
not hide the next, unless it is the third in a row: a level the run has moved to. All of it is tensor arithmetic on the value's device; the flag reaches
the host through a (pinned) host buffer copied without blocking and read once the copy has
landed (on a GPU, a step late at most), so the healthy path waits for nothing.
"""
from __future__ import annotations

import math

import torch


class SpikeWatch:
    def __init__(self, k: float = 4.0, rise: float = 0.5, warmup: int = 20,
                 beta: float = 0.95) -> None:
        self.k, self.floor, self.warmup, self.beta = k, math.log1p(rise), warmup, beta
        self.count = 0
        self.mean = self.var = self.streak = None
        self._host = self._event = self._pending = None

    def update(self, value: torch.Tensor) -> torch.Tensor:
        """Takes this step's value (a 0-d or 1-element tensor); returns its spike flag, a
        bool tensor on the value's device."""
        lx = value.detach().float().reshape(()).clamp_min(1e-30).log()
        if self.mean is None:
            self.mean, self.var = lx.clone(), torch.zeros_like(lx)
            self.streak = torch.zeros((), dtype=torch.int32, device=lx.device)
        finite = torch.isfinite(lx)
        dev = torch.where(finite, lx - self.mean, torch.zeros_like(lx))
        limit = torch.clamp_min(self.k * self.var.sqrt(), self.floor)
        spike = finite & (dev > limit) & (self.count >= self.warmup)
        self.streak = torch.where(spike, self.streak + 1, torch.zeros_like(self.streak))
        keep = finite & (~spike | (self.streak >= 3))
        a = 1.0 - self.beta
        self.mean = torch.where(keep, self.mean + a * dev, self.mean)
        self.var = torch.where(keep, self.beta * (self.var + a * dev * dev), self.var)
        self.count += 1
        return spike

    def seen(self, flag: torch.Tensor) -> bool:
        """Sends `flag` towards the host and returns whether a spike has arrived there since
        the last call (this step's on the CPU, where the copy is done at once)."""
        if flag.device.type != "cuda":
            return bool(flag.to(torch.uint8).untyped_storage()[0])
        self._pending = flag if self._pending is None else self._pending | flag
        if self._event is not None and not self._event.query():
            return False            # the last copy is still on its way: keep gathering
        was = self._event is not None and bool(self._host.untyped_storage()[0])  # no wait
        if self._host is None:
            self._host = torch.zeros((), dtype=torch.uint8, pin_memory=True)
            self._event = torch.cuda.Event()
        self._host.copy_(self._pending.to(torch.uint8), non_blocking=True)
        self._event.record()
        self._pending = None
        return was
