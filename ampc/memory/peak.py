"""The peak of live tensors over a stretch of code, from torch's profiler: the highest running
sum of the device's tensor allocations and frees that it records, in time order. It counts
tensors, not the allocator's cache, and works on the CPU, where no allocator keeps a peak;
``ampc.memory.report`` reads a step so, and ``ampc.validate`` each run's peak on the CPU.

    prof = ampc.memory.peak.start_profiler()
    ...                                       # the code measured
    ampc.memory.peak.stop_profiler(prof)
    ampc.memory.peak.allocated_peak(prof, torch.device("cpu"))    # bytes
"""
from __future__ import annotations

import contextlib
import os
import sys

import torch
from torch.profiler import ProfilerActivity, profile

__all__ = ["allocated_peak", "start_profiler", "stop_profiler"]


def start_profiler(cuda: bool = False):
    """torch's profiler recording allocations (and CUDA's with ``cuda``), started."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    prof = profile(activities=activities, profile_memory=True)
    with _stderr_off():
        prof.start()
    return prof


def stop_profiler(prof) -> None:
    """Stops ``prof``; its allocations are read by ``allocated_peak``."""
    with _stderr_off():
        prof.stop()
        prof.profiler.kineto_results       # (its results are made here, with their messages)


def allocated_peak(prof, device) -> int:
    """The highest running sum of the device's tensor allocations and frees that ``prof`` (a
    finished ``torch.profiler.profile(profile_memory=True)``) recorded: the bytes of live
    tensors at their peak over what was alive when it started (a free of a block allocated
    before is left out)."""
    return _lifetimes(_events(prof, device)[0])[1]


def _events(prof, device, mark=None):
    """([(address, signed bytes)] of the device's allocations and frees in time order,
    {name: (start ns, end ns)} of the ``record_function`` regions named ``mark`` + name,
    [time ns of each allocation event])."""
    allocs, marks = [], {}
    todo = list(prof.profiler.kineto_results.experimental_event_tree())[::-1]
    while todo:                        # depth first, in the order the events were recorded
        e = todo.pop()
        todo.extend(e.children[::-1])
        f = e.extra_fields
        if isinstance(f, torch._C._profiler._ExtraFields_Allocation):
            if f.device.type == device.type and device.index in (None, f.device.index):
                allocs.append((e.start_time_ns, f.ptr, f.alloc_size))
        elif mark and e.name.startswith(mark):
            marks[e.name[len(mark):]] = (e.start_time_ns, e.end_time_ns)
    allocs.sort(key=lambda a: a[0])    # stable: ties keep the recorded order
    return [(p, n) for _, p, n in allocs], marks, [t for t, _, _ in allocs]


def _lifetimes(events):
    """(each block seen allocated: [address, first event, event that frees it or
    len(events), bytes], the running sum's peak, the event at it) of ``events`` in time
    order. A free of a block allocated before the events is left out: it was not counted
    in either."""
    blocks, open_, run, top, at = [], {}, 0, 0, -1
    for i, (ptr, n) in enumerate(events):
        if n > 0:
            open_[ptr] = len(blocks)
            blocks.append([ptr, i, len(events), n])
        elif ptr in open_:
            blocks[open_.pop(ptr)][2] = i
        else:
            continue
        run += n
        if run > top:
            top, at = run, i
    return blocks, top, at


@contextlib.contextmanager
def _stderr_off():
    """Kineto, under torch's profiler, prints a line to the process's stderr each time it
    starts and stops (and, in a CUDA build without a GPU, an error it then ignores): not
    ampc's to show. Python's own stderr is flushed first and kept."""
    sys.stderr.flush()
    try:
        kept = os.dup(2)
    except OSError:
        yield
        return
    try:
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, 2)
        os.close(null)
        yield
    finally:
        os.dup2(kept, 2)
        os.close(kept)
