"""Where a training step's memory goes, and modules that recompute instead of saving.

``report(model, optimizer, batch, loss_fn)`` runs a step and measures its peak and what the
peak is made of (weights, grads, optimizer state, saved activations by module);
``forward_floor(...)`` (the same arguments) measures the step's forward alone, a lower bound
of that peak for about half the time;
``recompute(model, modules)`` makes modules recompute in the backward;
``compress(model, modules, "8bit")`` makes them keep what they save in 8 bits (or bf16);
``micro_batches(batch, k)`` splits a batch into k whose gradients add up to its own
(``micro_batch_backward`` runs them; ``why_not_split(model)`` says why a model is not the same
split, ``batch_size(batch)`` counts its examples);
``linear_cross_entropy(hidden, weight, target)`` is the head and the loss without the whole
logits, and ``sliced_head(model, "lm_head")`` makes a model's head and its loss so, unchanged. ``python -m
ampc.memory`` reports on a GPT-2-shaped model. ``ampc.memory.peak`` is the peak of live tensors
over any stretch of code, on the CPU too. See docs/memory.md.
"""
from ._compress import Compress, compress, compressed
from ._head_loss import linear_cross_entropy
from ._micro_batches import batch_size, micro_batch_backward, micro_batches, why_not_split
from ._recompute import Recompute, recompute, recomputed
from ._sliced_head import DeferredLogits, SlicedHead, sliced_head, sliced_heads
from ._report import MemoryReport, forward_floor, report
from . import peak

__all__ = ["Compress", "DeferredLogits", "MemoryReport", "Recompute", "SlicedHead", "batch_size",
           "compress", "compressed", "forward_floor", "linear_cross_entropy", "micro_batch_backward",
           "micro_batches", "peak", "recompute", "recomputed", "report", "sliced_head",
           "sliced_heads", "why_not_split"]
