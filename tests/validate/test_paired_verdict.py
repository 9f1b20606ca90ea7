"""compare()'s verdict: make_model is checked before any training, and the verdict comes
from the loss difference paired per seed over the last part of the curve."""
import itertools

import pytest
import torch
from torch import nn

from ampc import validate

VOCAB = 16


def make_model():
    return nn.Sequential(nn.Embedding(VOCAB, 16), nn.Linear(16, 32), nn.GELU(),
                         nn.Linear(32, VOCAB))


def make_batch(step):
    g = torch.Generator().manual_seed(step)
    x = torch.randint(0, VOCAB, (8, 6), generator=g)
    return x, (3 * x + 1) % VOCAB


def refused(make, match):
    batches = []

    def counting_batch(step):          # nothing trains: not even a batch is made
        batches.append(step)
        return make_batch(step)
    with pytest.raises(ValueError, match=match):
        validate.compare(make, counting_batch, steps=2, setups=("torch.amp",), progress=False)
    assert batches == []


def test_a_different_architecture_on_another_call_is_refused():
    widths = itertools.cycle([32, 48])

    def make():
        return nn.Sequential(nn.Embedding(VOCAB, 16), nn.Linear(16, next(widths)))
    refused(make, r"^ampc\.validate\.compare: make_model\(\) built a different architecture"
                  r".*parameter 1\.weight is \[48, 16\], was \[32, 16\]")


def test_different_parameter_names_on_another_call_are_refused():
    calls = itertools.count()

    def make():
        extra = [nn.Linear(VOCAB, VOCAB)] if next(calls) % 2 else []
        return nn.Sequential(nn.Embedding(VOCAB, 16), nn.Linear(16, VOCAB), *extra)
    refused(make, r"^ampc\.validate\.compare: make_model\(\) built a different architecture"
                  r".*\['2\.bias', '2\.weight'\]")


def test_different_weights_for_the_same_seed_are_refused():
    g = torch.Generator().manual_seed(123)      # its own generator: compare's seed is ignored

    def make():
        model = make_model()
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(torch.randn(p.shape, generator=g))
        return model
    refused(make, r"^ampc\.validate\.compare: make_model\(\) gave different weights for the "
                  r"same seed 0 \(parameter 0\.weight\)")


def test_loaded_weights_and_seeded_weights_are_accepted():
    state = make_model().state_dict()

    def loaded():                        # the same weights whatever the seed
        model = make_model()
        model.load_state_dict(state)
        return model
    for make in (make_model, loaded):
        report = validate.compare(make, make_batch, steps=2, setups=(), progress=False)
        assert len(report.base.losses) == 2
