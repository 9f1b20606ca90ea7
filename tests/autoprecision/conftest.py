"""search() measures whole batches in these tests unless a test asks for a slice: "auto"
decides from a timed step, which a loaded machine moves, and these tests hold plans to exact
choices (tests/autoprecision/test_examples.py sets the line itself)."""
import math

import pytest

import ampc.autoprecision._examples as examples_mod


@pytest.fixture(autouse=True)
def whole_batches(monkeypatch):
    monkeypatch.setattr(examples_mod, "AUTO_ABOVE_S", math.inf)
