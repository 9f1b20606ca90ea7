"""The search measured on a slice of each batch: which batches are cut and to what, the
bytes scaled back to the whole batch, the peak measured on whole batches, what the plan and
its table say, and the refusals."""
import pytest
import torch
from torch import nn

import ampc.autoprecision._examples as examples_mod
import ampc.autoprecision._peak as peak_mod
import ampc.autoprecision._search as search_mod
from ampc.autoprecision import search
from ampc.autoprecision._units import Reason


def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.GELU(), nn.Linear(32, 4))


def batches(n=16):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(n, 16, generator=g), torch.randint(0, 4, (n,), generator=g))
            for _ in range(2)]


def no_probe(monkeypatch):
    # timing ties must not decide these tests: no candidate is ruled out by the probe
    monkeypatch.setattr(search_mod, "probe", lambda candidates, device: {})


def test_leading_size_and_first_walk_nested_batches():
    batch = ({"ids": torch.zeros(6, 3), "mask": torch.ones(6, 3)}, torch.zeros(6))
    assert examples_mod.leading_size(batch) == 6
    cut = examples_mod.first(batch, 2)
    assert cut[0]["ids"].shape == (2, 3) and cut[1].shape == (2,)
    assert examples_mod.leading_size((torch.zeros(6, 3), torch.zeros(5))) is None
    assert examples_mod.leading_size((torch.zeros(6, 3), torch.tensor(1.0))) is None


def test_auto_leaves_a_fast_step_whole(monkeypatch):
    monkeypatch.setattr(examples_mod, "AUTO_ABOVE_S", 1.0)   # the module's line (conftest lifts it)
    b = batches()
    got, sliced, note = examples_mod.choose(model(), b, nn.functional.cross_entropy, "auto")
    assert got is b and sliced is None and note is None


def test_auto_cuts_a_slow_step_to_a_quarter(monkeypatch):
    monkeypatch.setattr(examples_mod, "AUTO_ABOVE_S", 0.0)
    got, sliced, note = examples_mod.choose(model(), batches(32), nn.functional.cross_entropy,
                                            "auto")
    assert sliced == (8, 32) and all(x.shape[0] == 8 and y.shape[0] == 8 for x, y in got)
    assert "first 8 of each batch's 32 examples" in note
    # never fewer than AUTO_LEAST examples; a batch that small stays whole
    assert examples_mod.choose(model(), batches(8), nn.functional.cross_entropy,
                               "auto")[1] == (4, 8)
    assert examples_mod.choose(model(), batches(4), nn.functional.cross_entropy,
                               "auto")[1] is None


class SeqFirst(nn.Module):
    def __init__(self):
        super().__init__()
        self.rnn = nn.LSTM(16, 16)           # batch_first=False: dim 0 is time
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        return self.head(self.rnn(x)[0])


class FixedBatch(nn.Module):
    """Needs exactly 16 examples (a reshape written for one batch size)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 4)

    def forward(self, x):
        return self.lin(x).reshape(16, 4)


def test_a_slice_is_refused_where_it_would_mislead_or_fail(monkeypatch):
    monkeypatch.setattr(examples_mod, "AUTO_ABOVE_S", 0.0)    # "auto" would cut any batch
    loss = nn.functional.cross_entropy
    assert examples_mod.choose(model(), batches(), loss, "auto")[1] == (4, 16)
    seq = [(torch.randn(16, 2, 16), torch.randint(0, 4, (16, 2)))]
    got, sliced, note = examples_mod.choose(SeqFirst(), seq, lambda o, t: loss(
        o.reshape(-1, 4), t.reshape(-1)), 4)
    assert sliced is None and got is seq and "rnn" in note and "sequence-first" in note
    assert examples_mod.choose(SeqFirst(), seq, loss, "auto")[1] is None
    # batch norm computes over the batch: "auto" leaves it whole, a number says so
    bn = nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.Linear(32, 4))
    assert examples_mod.choose(bn, batches(), loss, "auto")[1] is None
    got, sliced, note = examples_mod.choose(bn, batches(), loss, 4)
    assert sliced == (4, 16) and "1: batch norm, its statistics over 4 examples" in note
    mixed = [(torch.randn(16, 16), torch.randint(0, 4, (8,)))]
    got, sliced, note = examples_mod.choose(model(), mixed, loss, 4)
    assert sliced is None and "leading size" in note
    got, sliced, note = examples_mod.choose(FixedBatch(), batches(), loss, 4)
    assert sliced is None and "do not run alone" in note and "RuntimeError" in note


@pytest.mark.parametrize("bad", [0, -2, 2.5, True, "some"])
def test_bad_examples_is_refused_naming_it(bad):
    with pytest.raises(ValueError, match=r"ampc.autoprecision.search: examples must be"):
        search(model(), batches(), examples=bad)


def test_a_sliced_search_scales_activation_bytes_to_the_whole_batch(monkeypatch):
    """Measured on 4 of 16 examples, each unit's bytes at each candidate are those measured
    on the whole batch (activations scale with the examples, weights do not)."""
    no_probe(monkeypatch)
    kw = dict(candidates=("fp32", "bf16", "bf16+8b"), objective="memory", check=False,
              max_slowdown=None)
    whole = search(model(), batches(), examples=None, **kw)
    cut = search(model(), batches(), examples=4, **kw)
    assert whole.data["examples"] is None and cut.data["examples"] == [4, 16]
    for u in whole.every_unit:
        for c, r in u.options.items():
            assert cut.unit(u.module).options[c]["bytes"] == r["bytes"], (u.module, c)
    assert any("first 4 of each batch's 16 examples" in n for n in cut.data["notes"])


def test_a_sliced_search_keeps_the_choices_of_a_whole_one(monkeypatch):
    no_probe(monkeypatch)
    kw = dict(candidates=("fp32", "bf16"), objective="memory", max_slowdown=None)
    whole = search(model(), batches(64), examples=None, **kw)
    cut = search(model(), batches(64), examples=16, **kw)
    assert cut.decisions == whole.decisions
    # the errors are of the same size (a slice's rounding averages over fewer terms)
    for u in whole.every_unit:
        a, b = u.options["bf16"]["dgrad_err"], cut.unit(u.module).options["bf16"]["dgrad_err"]
        if a:
            assert 0.2 < b / a < 5, (u.module, a, b)


def test_the_peak_budget_is_measured_on_whole_batches(monkeypatch):
    no_probe(monkeypatch)
    seen = []
    real = peak_mod.fit

    def fit(plan, model, batches, *args, **kwargs):
        seen.append([x.shape[0] for x, _ in batches])
        return real(plan, model, batches, *args, **kwargs)
    monkeypatch.setattr(peak_mod, "fit", fit)
    search(model(), batches(), candidates=("fp32", "bf16"), objective="memory", examples=4,
           peak_bytes=10 ** 9, check=False)
    assert seen == [[16, 16]]


def test_the_table_scales_the_saving_a_step_to_the_whole_batch(monkeypatch):
    no_probe(monkeypatch)
    plan = search(model(), batches(), candidates=("fp32", "bf16"), examples=4,
                  objective="memory", max_slowdown=None)
    plan.data.update(search_s=10.0, measured=dict(plan.data["measured"], fp32_ms=3.0,
                                                  plan_ms=2.0))
    plan.set_choices(dict.fromkeys(plan.decisions, "bf16"), Reason.SOLVED)
    text = " ".join(plan.table().split())
    # 1 ms a step on 4 examples is 4 ms on 16: 10 s repaid after 2,500 steps
    assert ("repaid after 2,500 steps at the 4.00 ms a step it saves against fp32 (measured "
            "on 4 examples, scaled to 16)") in text, text


def test_auto_never_slices_where_nothing_timed_decides(monkeypatch):
    """The memory objective without a ceiling or a byte budget gives the same plan every time:
    "auto" measures whole batches there, however slow a step; a number is still taken."""
    monkeypatch.setattr(examples_mod, "AUTO_ABOVE_S", 0.0)
    kw = dict(candidates=("fp32", "bf16"), objective="memory", max_slowdown=None, check=False)
    assert search(model(), batches(), **kw).data["examples"] is None
    assert search(model(), batches(), examples=4, **kw).data["examples"] == [4, 16]
    no_probe(monkeypatch)
    timed = search(model(), batches(), candidates=("fp32", "bf16"), objective="memory",
                   check=False)
    assert timed.data["examples"] == [4, 16]
