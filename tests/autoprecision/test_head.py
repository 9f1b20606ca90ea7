"""The output projection is found by measurement, not by name: a model whose head is called
something else gets the same plan, and an fp8 plan puts no layer into fp8 whose measured
fp8 error is over the budget."""
import pytest
import torch
from torch import nn

from ampc.autoprecision import search
from ampc.autoprecision._solve import fits_alone

from autoprecision_models import Known, target_batches

CANDS = ("fp32", "bf16", "fp16", "fp8")
RENAME = {"norm": "ln_in", "inp": "fc_a", "hot": "fc_b", "tiny": "fc_c", "mid": "fc_d",
          "head": "decoder.proj"}


class Renamed(nn.Module):
    """Known's layers and forward, every one under another name, the head one level down."""

    def __init__(self, known):
        super().__init__()
        self.ln_in, self.fc_a, self.fc_b = known.norm, known.inp, known.hot
        self.fc_c, self.fc_d = known.tiny, known.mid
        self.decoder = nn.Module()
        self.decoder.proj = known.head

    def forward(self, x):
        h = torch.relu(self.fc_a(self.ln_in(x + 1000.0)))
        h = self.fc_b(h) * 1e-5
        h = h + self.fc_c(h) * 1e-12
        h = torch.relu(self.fc_d(h))
        return self.decoder.proj(h)


@pytest.fixture(scope="module")
def plans():
    torch.manual_seed(0)
    known = Known()
    batches = target_batches(known, n=2)
    renamed = Renamed(known)
    with torch.no_grad():
        assert torch.equal(known(batches[0][0]), renamed(batches[0][0]))
    a = search(known, batches, candidates=CANDS, objective="memory", max_slowdown=None, repeats=1)
    b = search(renamed, batches, candidates=CANDS, objective="memory", max_slowdown=None, repeats=1)
    return a, b


def test_renamed_head_same_plan(plans):
    a, b = plans
    assert {RENAME[n]: c for n, c in a.choices.items()} == b.choices
    # the head is held up by its measured loss error, whatever it is called
    assert b.choices["decoder.proj"] in ("fp32", "fp16")
    assert "bf16" in b.unit("decoder.proj").rejected


def test_fp8_only_where_measured_error_allows(plans):
    for plan in plans:
        assert "fp8" in plan.data["candidates"]
        fp8_units = [u for u in plan if "fp8" in u.options]
        assert fp8_units, "no unit measured at fp8"
        for u in fp8_units:
            if u.choice == "fp8":
                assert fits_alone(u.options["fp8"], plan.budget) is None, u.module
        head = plan.unit("head" if "head" in plan.choices else "decoder.proj")
        assert head.choice != "fp8" and "fp8" in head.rejected
