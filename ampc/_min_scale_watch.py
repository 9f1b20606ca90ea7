"""GradScaler's watch on a scale stuck at min_scale: steps that overflow with the scale
already at its minimum cannot be helped by a smaller scale, and skipping them forever is
training that does not progress.

The count of overflowing steps in a row taken at min_scale stays on the device. The host
reads a copy of it without waiting: on CUDA only once an event says the copy landed, so the
check runs a step or two late. Two in a row arm the skip watch (``_skip_watch.py``), which
names the overflowing op in the next step; ``patience`` in a row raise.
"""
import struct

import torch


def _f32(x):
    return struct.unpack("<f", struct.pack("<f", x))[0]


class MinScaleWatch:
    def __init__(self, min_scale, patience, count, device):
        """``count``: overflowing steps in a row at min_scale so far (from a checkpoint)."""
        self.min_scale, self.patience = min_scale, patience
        self.count = torch.full((), count, dtype=torch.int32, device=device)
        self.host = torch.zeros((), dtype=torch.int32, pin_memory=device.type == "cuda")
        self.view = self.host.numpy()          # read as plain host memory
        self.event = None                      # the pending copy's, on CUDA

    def note(self, scale, found_inf):
        """Counts, on the device, this update's overflow if ``scale`` (before the update)
        is at min_scale; a clean step starts the count again."""
        overflow = found_inf != 0
        at_min = scale <= _f32(self.min_scale)
        self.count.add_(overflow & at_min).mul_(overflow)

    def check(self, skip_watch):
        """Reads the host copy of the count once it has landed, and copies it again."""
        if self.event is not None:
            if not self.event.query():
                return
            self._judge(int(self.view), skip_watch)
        self.host.copy_(self.count, non_blocking=True)
        if self.count.is_cuda:
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self._judge(int(self.view), skip_watch)

    def _judge(self, count, skip_watch):
        if count >= 2:
            skip_watch.floor_reached()
        if count >= self.patience:
            raise RuntimeError(
                f"ampc.GradScaler: {count} steps in a row had inf or nan gradients with the "
                f"loss scale already at min_scale={self.min_scale}, and were skipped: "
                f"training is not progressing. Look for the op that overflows in float16 "
                f"(often a loss, a softmax or an attention mask), or train in bfloat16.")
