"""How much a gradient varies from batch to batch: the yardstick a rounding error is held to.

SGD follows a different gradient at every batch. An error added by lower precision that is
small against that batch-to-batch spread cannot change where training goes; one that is
large against it can. The spread of a gradient g over n batches is

    sqrt(sum_k ||g_k - mean g||^2 / (n - 1)) / mean_k ||g_k||

(the standard deviation of one batch's gradient, as a vector, relative to a batch's
gradient norm): 0 when every batch gives the same gradient, about 1.4 for gradients that
share nothing. Sums in float64, so that the measurement is far more exact than what it
measures.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import torch


class Spread:
    """Accumulates one gradient (a list of tensors, in a fixed order) over batches, by
    Welford's update (a running mean and sum of squared deviations), which does not lose
    the spread to cancellation when the batches agree closely."""

    def __init__(self) -> None:
        self.n = 0
        self.mean: list[torch.Tensor | None] = []
        self.m2 = 0.0          # sum over batches of ||g_k - mean||^2
        self.norms = 0.0       # sum over batches of ||g_k||

    def add(self, grads: Sequence[torch.Tensor | None]) -> None:
        grads = list(grads)
        if self.n == 0:
            self.mean = [None if g is None else torch.zeros(g.shape, dtype=torch.float64,
                                                            device=g.device) for g in grads]
        if len(grads) != len(self.mean):
            raise ValueError(f"ampc noise spread: {len(grads)} gradients, "
                             f"{len(self.mean)} at the first batch")
        self.n += 1
        sq = 0.0
        for mean, g in zip(self.mean, grads):
            if mean is None or g is None:
                continue
            g = g.double()
            before = g - mean
            mean += before / self.n
            self.m2 += float((before * (g - mean)).sum())
            sq += float(torch.linalg.vector_norm(g)) ** 2
        self.norms += math.sqrt(sq)

    def value(self) -> float | None:
        """The relative spread; None under two batches or for a gradient that is all zero."""
        if self.n < 2 or self.norms == 0.0:
            return None
        return math.sqrt(max(0.0, self.m2) / (self.n - 1)) / (self.norms / self.n)


def spread(batches: Sequence[Sequence[torch.Tensor | None]]) -> float | None:
    """The relative spread of a gradient given as one list of tensors per batch."""
    s = Spread()
    for grads in batches:
        s.add(grads)
    return s.value()
