"""ampc.memory.peak: the peak of live tensors over a stretch of code, from torch's profiler."""
import torch

import ampc

MiB = 2**20


def _peak(fn):
    prof = ampc.memory.peak.start_profiler()
    try:
        fn()
    finally:
        ampc.memory.peak.stop_profiler(prof)
    return ampc.memory.peak.allocated_peak(prof, torch.device("cpu"))


def test_counts_what_is_alive_at_once_not_what_was_allocated_in_all():
    def two_at_a_time():
        a = torch.empty(MiB, dtype=torch.uint8)
        for _ in range(3):
            b = torch.empty(MiB, dtype=torch.uint8)
            del b
        del a
    assert _peak(two_at_a_time) == 2 * MiB


def test_leaves_out_what_was_alive_before():
    before = torch.empty(4 * MiB, dtype=torch.uint8)

    def free_it_and_allocate_one():
        nonlocal before
        before = None
        torch.empty(MiB, dtype=torch.uint8)
    assert _peak(free_it_and_allocate_one) == MiB
