"""ampc.GradScaler's checkpoint: ``state_dict`` and ``load_state_dict`` with torch's keys and
ampc's own (its settings, and its device counters as host values), a state dict checked whole
before anything changes, and pickling, which carries the device state as those host values.
A mixin of GradScaler (grad_scaler.py), which holds the scaling itself."""
from __future__ import annotations  # "X | None" hints on Python 3.9 too; none evaluated at import

from collections import deque
from typing import Any

from ._skip_watch import DEFAULT_AFTER, SkipWatch

# Created on the first scale(), dropped when pickling (their values travel as _init_*):
# _skipped counts update()s whose steps found an inf/nan; _min_scale_watch counts overflowing
# steps in a row at min_scale (_min_scale_watch.py).
DEVICE_STATE = ("_scale", "_growth_tracker", "_hysteresis_tracker", "_skipped",
                "_last_found_inf", "_min_scale_watch")


def _extras_attributes(extras):
    """GradScaler attributes from _extras_state()'s dict: the settings, and the counters'
    host values that the device counters start from."""
    return {"_hysteresis": extras["hysteresis"], "_min_scale": extras["min_scale"],
            "_max_scale": extras["max_scale"], "_patience": extras["min_scale_patience"],
            "_init_hysteresis_tracker": extras["_hysteresis_tracker"],
            "_init_skipped": extras["_skipped_steps"],
            "_init_last_skipped": extras["_last_step_skipped"],
            "_init_skips_at_min": extras["_skips_at_min"]}


class ScalerCheckpoint:
    """GradScaler's saving and loading (see the module's docstring)."""

    def _extras_state(self):
        """The state beyond torch's keys: ampc's settings, and its device counters as host
        values (reading them waits for the device)."""
        if self._scale is None:
            skipped, last, at_min = (self._init_skipped, self._init_last_skipped,
                                     self._init_skips_at_min)
        else:
            skipped = int(self._skipped)
            last = None if self._last_found_inf is None else bool(self._last_found_inf)
            at_min = 0 if self._min_scale_watch is None else int(self._min_scale_watch.count)
        return {"hysteresis": self._hysteresis,
                "_hysteresis_tracker": self._get_hysteresis_tracker(),
                "min_scale": self._min_scale, "max_scale": self._max_scale,
                "min_scale_patience": self._patience, "_skipped_steps": skipped,
                "_last_step_skipped": last, "_skips_at_min": at_min}

    def state_dict(self) -> dict[str, Any]:
        """torch's keys (scale, growth_factor, backoff_factor, growth_interval,
        _growth_tracker), then the rest of the state under keys of its own: hysteresis,
        min_scale, max_scale, min_scale_patience and the counters _hysteresis_tracker,
        _skipped_steps, _last_step_skipped, _skips_at_min. Static scaling is growth_factor
        and backoff_factor 1.0. {} when disabled. Take it after update()."""
        if not self._enabled:
            return {}
        sd = {"scale": self.get_scale(), "growth_factor": self._growth_factor,
              "backoff_factor": self._backoff_factor, "growth_interval": self._growth_interval,
              "_growth_tracker": self._get_growth_tracker()}
        sd.update(self._extras_state())
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Loads a state dict of this class or of torch.amp.GradScaler. Checks it whole
        before changing anything. A torch checkpoint keeps this scaler's own settings of
        hysteresis and the bounds, and starts its counters again."""
        if not self._enabled:
            return
        if len(state_dict) == 0:
            raise RuntimeError("The source state dict is empty, possibly because it was saved "
                               "from a disabled instance of GradScaler.")
        extras = {"hysteresis": self._hysteresis, "min_scale": self._min_scale,
                  "max_scale": self._max_scale, "min_scale_patience": self._patience,
                  "_hysteresis_tracker": None, "_skipped_steps": 0,
                  "_last_step_skipped": None, "_skips_at_min": 0}
        extras.update((k, state_dict[k]) for k in extras if k in state_dict)
        if extras["_hysteresis_tracker"] is None:
            extras["_hysteresis_tracker"] = extras["hysteresis"]
        self._check_extras(extras["hysteresis"], extras["min_scale"], extras["max_scale"],
                           extras["min_scale_patience"])
        self._check_counters(extras)
        self._init_scale = state_dict["scale"]
        self._growth_factor = state_dict["growth_factor"]
        self._backoff_factor = state_dict["backoff_factor"]
        self._growth_interval = state_dict["growth_interval"]
        self._init_growth_tracker = state_dict["_growth_tracker"]
        self.__dict__.update(_extras_attributes(extras))
        if self._scale is not None:
            self._scale.fill_(self._init_scale)
            self._growth_tracker.fill_(self._init_growth_tracker)
            self._init_extras()

    @staticmethod
    def _check_counters(extras):
        for key, least in (("_hysteresis_tracker", -2 ** 31), ("_skipped_steps", 0),
                           ("_skips_at_min", 0)):
            value = extras[key]
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"ampc.GradScaler.load_state_dict: {key} must be an int "
                                 f">= {least}, got {value!r}")
        if extras["_last_step_skipped"] not in (None, False, True):
            raise ValueError(f"ampc.GradScaler.load_state_dict: _last_step_skipped must be "
                             f"None or a bool, got {extras['_last_step_skipped']!r}")

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        if self._enabled:
            if len(self._per_optimizer_states) != 0:
                raise AssertionError("A GradScaler instance may only be pickled at the "
                                     "beginning of an iteration, or at the end after "
                                     "scaler.update().")
            # device tensors are re-created on the next scale() from the _init_* values
            state["_init_scale"] = self.get_scale()
            state["_init_growth_tracker"] = self._get_growth_tracker()
            state.update(_extras_attributes(self._extras_state()))
            state.update(dict.fromkeys(DEVICE_STATE))
            if self._records is not None:         # a log of device tensors: not carried
                state["_records"] = deque(maxlen=self._records.maxlen)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        # a scaler pickled by an earlier ampc has no skip counters nor records: they start
        self.__dict__.update(_init_skipped=0, _init_last_skipped=None, _init_skips_at_min=0,
                             _records=None, _skip_watch=SkipWatch(DEFAULT_AFTER, False),
                             _min_scale_watch=None)
        self.__dict__.update(state)
