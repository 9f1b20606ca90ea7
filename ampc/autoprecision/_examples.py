"""How many examples of each batch the search measures on.

A unit's relative errors, its speed against fp32 and fp32's own batch-to-batch spread do not
need a large batch: on a slice of the leading examples the errors come out no smaller (fewer
terms to average rounding over) and the spread larger by about as much, so judging one
against the other changes little, for a fraction of the time. A slice is taken only where
every tensor of every batch shares its leading size (the examples) and no module of the
model reads its input sequence-first (``batch_first=False``: the leading size would be time,
and a shorter sequence hides error that builds up along it). "auto" leaves a model with
batch norm whole too: its statistics are over the batch, and over a few examples they are
another computation (a 1x1 feature map of 4 examples has 4 values a channel).
"""
from __future__ import annotations

import copy
import time

import torch

from .._numerics.model import call_model
from .._walk import map_tensors, tensors

AUTO_ABOVE_S = 1.0   # "auto" slices when a whole batch's fp32 step would take longer than this
AUTO_SHARE = 4       # to this fraction of its examples,
AUTO_LEAST = 4       # and never to fewer than this many


def leading_size(batch):
    """The size every tensor of ``batch`` shares along its first dimension, or None."""
    sizes = {t.shape[0] if t.dim() else None for t in tensors(batch)}
    return next(iter(sizes)) if len(sizes) == 1 and None not in sizes else None


def first(batch, n):
    """``batch`` with every tensor cut to its first ``n`` examples."""
    return map_tensors(lambda t: t[:n], batch)


def sequence_first(model):
    """The modules of ``model`` that read their input sequence-first."""
    return [n for n, m in model.named_modules() if getattr(m, "batch_first", True) is False]


def over_the_batch(model):
    """The modules of ``model`` whose output depends on the other examples (batch norm)."""
    return [n for n, m in model.named_modules()
            if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]


def _step_s(model, batch, loss_fn):
    """Seconds of one fp32 forward and backward of a copy of ``model`` (a first call: it
    errs long, towards a slice)."""
    work = copy.deepcopy(model)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        t0 = time.perf_counter()
        loss_fn(call_model(work, batch[0]), batch[1]).backward()
        return time.perf_counter() - t0


def check(fn, examples):
    if examples not in (None, "auto") and not (isinstance(examples, int)
                                               and not isinstance(examples, bool) and examples >= 1):
        raise ValueError(f"{fn}: examples must be None, 'auto' or a number of examples (1 or "
                         f"more), got {examples!r}")
    return examples


def choose(model, batches, loss_fn, examples):
    """(the batches to measure on, (examples measured, examples a batch) or None, a note or
    None). ``examples``: None, whole batches; a number, that many leading examples of each
    batch; "auto", a quarter of them (at least AUTO_LEAST) where a whole batch's fp32 step,
    timed on the slice, would take over AUTO_ABOVE_S."""
    if examples is None:
        return batches, None, None
    sizes = {leading_size(b) for b in batches}
    size = next(iter(sizes)) if len(sizes) == 1 else None
    if examples == "auto":
        if size is None or sequence_first(model) or over_the_batch(model):
            return batches, None, None
        n = max(AUTO_LEAST, size // AUTO_SHARE)
    else:
        n = examples
        why = ("the batches' tensors do not share one leading size" if size is None else
               f"{', '.join(sequence_first(model)[:3])} read(s) the input sequence-first"
               if sequence_first(model) else None)
        if why:
            return batches, None, f"examples={n} not taken: {why}; measured on whole batches"
    if n >= size:
        return batches, None, None
    cut = [first(b, n) for b in batches]
    try:
        seconds = _step_s(model, cut[0], loss_fn) * size / n
    except (RuntimeError, TypeError, ValueError) as e:   # a model that needs its batch size
        return batches, None, (f"the first {n} examples of a batch do not run alone "
                               f"({type(e).__name__}: {str(e).splitlines()[0][:80]}); measured "
                               f"on whole batches")
    if examples == "auto" and seconds <= AUTO_ABOVE_S:
        return batches, None, None
    coupled = over_the_batch(model)
    return cut, (n, size), (
        f"measured on the first {n} of each batch's {size} examples (an fp32 step of a whole "
        f"batch ~{seconds:.1f} s): errors and times are that slice's, activation bytes "
        f"scaled to the whole batch; examples=None measures whole batches"
        + (f"; {', '.join(coupled[:3])}{' ...' if len(coupled) > 3 else ''}: batch norm, "
           f"its statistics over {n} examples" if coupled else ""))
