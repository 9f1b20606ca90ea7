"""ampc._numerics.noise: the batch-to-batch spread of a gradient, against a float64
reference computed directly, and the Budget's limit built on it."""
import math

import pytest
import torch

from ampc._numerics.noise import Spread, spread
from ampc.autoprecision import Budget


def reference(batches):
    flat = torch.stack([torch.cat([g.double().flatten() for g in b]) for b in batches])
    dev = ((flat - flat.mean(0)) ** 2).sum() / (len(batches) - 1)
    return float(dev.sqrt() / flat.norm(dim=1).mean())


@pytest.mark.parametrize("n", [2, 3, 5])
def test_matches_float64_reference(n):
    g = torch.Generator().manual_seed(n)
    base = [torch.randn(7, 5, generator=g), torch.randn(3, generator=g)]
    batches = [[b + 0.3 * torch.randn(b.shape, generator=g) for b in base] for _ in range(n)]
    assert spread(batches) == pytest.approx(reference(batches), rel=1e-9)


def test_known_values():
    g = torch.ones(10)
    assert spread([[g], [g], [g]]) == pytest.approx(0.0, abs=1e-12)   # no noise at all
    assert spread([[g], [-g]]) == pytest.approx(math.sqrt(2))          # shares nothing
    assert spread([[g]]) is None                                        # one batch says nothing
    assert spread([[torch.zeros(3)], [torch.zeros(3)]]) is None         # no gradient
    assert spread([[g, None], [g, None]]) == pytest.approx(0.0, abs=1e-12)


def test_mismatched_lists_refused():
    s = Spread()
    s.add([torch.ones(2)])
    with pytest.raises(ValueError, match="2 gradients, 1 at the first batch"):
        s.add([torch.ones(2), torch.ones(2)])


def test_budget_limit():
    b = Budget()
    assert b.limit("wgrad_err", None) == b.wgrad
    assert b.limit("wgrad_err", 1.0) == pytest.approx(0.5)              # half the spread
    assert b.limit("wgrad_err", 0.01) == b.wgrad                        # never under the fixed figure
    assert b.limit("grad_err", 1.0) == pytest.approx(0.5)
    assert b.limit("loss_err", 1.0) == b.loss                           # the loss: fixed figure
    assert b.limit("wgrad_err", float("nan")) == b.wgrad
    assert Budget(noise_fraction=0).limit("grad_err", 1.0) == b.grad    # the zero-tolerance control
    with pytest.raises(ValueError, match="noise_fraction must be a positive number or 0"):
        Budget(noise_fraction=-1)
    with pytest.raises(ValueError, match="wgrad must be a positive number, got 0"):
        Budget(wgrad=0)
