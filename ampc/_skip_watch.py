"""GradScaler's skip watch: after a streak of skipped steps, name the op that overflowed.

When N steps in a row are skipped for inf/nan gradients (or a step overflows with the scale
at min_scale), the watch arms ampc.autocast's overflow locator for the next step; that step's
region records the first op, forward or backward, that turned finite values into inf or nan,
and the next update() reports it once, as a warning (or an error) with the fixes to try.

Seeing the streak without a host sync. The skip decision and the scale update stay on the
device, so the host does not know whether a step skipped. Two cases:
- with an optimizer that cannot skip by itself, step() already reads the skip flag on the
  host (the one sync of such a step): the watch counts the streak from those flags, exactly;
- with a fused optimizer nothing is read: every N updates the watch copies the scaler's
  device count of skipped updates into pinned host memory (non-blocking, one event), and
  reads that copy at a later boundary once the event says it landed, so it never waits.
  Two snapshots N or more updates apart whose counts differ by the updates between them
  mean that every one of those steps skipped. A collapse (a skip every step from some step
  on) is seen within about 3N updates; a steady streak of exactly N may go unseen, which
  is the price of reading once every N steps. A step that does not fall on a boundary costs
  one integer increment and one modulo on the host.
The armed step itself checks every op (a sync per op): it runs once per collapse.
"""
import warnings

import torch

from .amp import _overflow

DEFAULT_AFTER = 10


class SkipWatch:
    def __init__(self, after, raises):
        self.after, self.raises = after, raises
        self.done = False            # explained once: never again
        self.recorder = None         # armed: the Recorder of the step being watched
        self.why = None
        self.restart()

    def restart(self, skipped=None):
        """Counts from scratch (the scaler's device counters were made anew); ``skipped``,
        the device count of skipped updates, sets up the pinned host copy of it."""
        self.streak = 0              # skips in a row, from flags read on the host
        self.updates = 0             # update() calls watched
        self.snap = self.view = self.event = None
        if skipped is not None and self.after is not None:
            self.snap = torch.zeros((), dtype=skipped.dtype, pin_memory=skipped.is_cuda)
            self.view = self.snap.numpy()       # read as plain host memory
        self.snap_at = None          # ``updates`` when the pending snapshot was taken
        self.prev = None             # (updates, skipped count) of the last snapshot read

    def __getstate__(self):
        state = self.__dict__.copy()
        state.update(recorder=None, why=None, streak=0, updates=0, snap=None, view=None,
                     event=None, snap_at=None, prev=None)
        return state

    # ---- seeing the streak ----

    def after_update(self, scaler, skipped, flags):
        """Called at the end of update(): ``skipped`` is the scaler's device count of skipped
        updates, ``flags`` whether this iteration skipped as the host knows it (None: not
        read on the host). Returns the report to deliver, or None."""
        if self.after is None or self.done:
            return None
        if self.recorder is not None:
            return self._report(scaler)
        self.updates += 1
        if flags is not None:
            self.streak = self.streak + 1 if flags else 0
            if self.streak >= self.after:
                self._arm(f"{self.streak} steps in a row were skipped")
        elif self.updates % self.after == 0:
            self._snapshot(skipped)
        return None

    def floor_reached(self):
        """Two steps in a row overflowed at min_scale: the scale cannot fall further."""
        if self.after is not None and not self.done and self.recorder is None:
            self._arm("steps overflowed with the loss scale at min_scale and were skipped")

    def _snapshot(self, skipped):
        if self.snap is None:
            self.restart(skipped)
            self.updates = self.after
        if self.snap_at is not None:
            if self.event is not None and not self.event.query():
                return                          # not landed yet: look again at the next boundary
            self._read()
        if self.recorder is not None:
            return
        self.snap.copy_(skipped, non_blocking=True)
        self.snap_at = self.updates
        self.event = None
        if skipped.is_cuda:
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self._read()                        # a CPU copy has landed already

    def _read(self):
        now = (self.snap_at, int(self.view))
        self.snap_at = None
        if self.prev is not None and now[1] - self.prev[1] == now[0] - self.prev[0]:
            self._arm(f"at least {now[0] - self.prev[0]} steps in a row were skipped")
        self.prev = now

    # ---- the armed step and its report ----

    def _arm(self, why):
        self.why = why
        self.recorder = _overflow.Recorder()
        _overflow.arm(self.recorder)

    def _report(self, scaler):
        rec, self.recorder = self.recorder, None
        if _overflow.armed is rec:
            _overflow.disarm()
        # the armed step may not have skipped (the streak ended): then there is nothing to say
        if rec.found is None and not bool(scaler.last_step_skipped()):
            self.restart(scaler._skipped)
            return None
        self.done = True
        return message(self.why, scaler.get_scale(), rec)

    def deliver(self, text):
        if text is None:
            return
        if self.raises:
            raise RuntimeError(text)
        warnings.warn(text, RuntimeWarning, stacklevel=3)


def module_expression(path):
    """'model.blocks[3].fc2' for the module path 'Net.blocks.3.fc2'."""
    out = "model"
    for part in path.split(".")[1:]:
        out += f"[{part}]" if part.isdigit() else f".{part}"
    return out


def message(why, scale, rec):
    head = f"ampc.GradScaler: {why} for inf/nan gradients; the loss scale is now {scale:.3g}. "
    bf16 = ("train in bfloat16 (ampc.autocast(dtype=torch.bfloat16): fp32's range, no loss "
            "scaling needed)")
    if rec.regions == 0:
        return (head + "The step after ran no ampc.autocast region, so the op was not "
                "located: run the forward under ampc.autocast to have it named. To try: keep "
                f"the overflowing module in float32, lower the learning rate, or {bf16}.")
    if rec.found is None:
        return (head + "In the step after, no op inside the ampc.autocast region turned "
                "finite values into inf or nan: they came from outside it (a loss computed "
                "outside the region, the inputs, or weights already non-finite). To try: "
                f"lower the learning rate, or {bf16}.")
    phase, label, where, detail = rec.found
    keep = (f"keep that module in float32 (ampc.policy.module_scope({module_expression(where)}, "
            f"dtype=torch.float32))" if where != "<no module>" else
            f"keep that op in float32 (ampc.policy.set_policy({label!r}, 'fp32'))")
    return (head + f"In the step after, the first op to turn finite values into inf or nan was "
            f"{label} in module {where}, in the {phase} pass: {detail}. To try: {keep}, "
            f"lower the learning rate, or {bf16}.")
