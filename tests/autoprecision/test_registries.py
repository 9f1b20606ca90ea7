"""One place per idea: a candidate precision and a search objective are each one record
(_candidates.py, _objectives.py). The records agree with torch's dtypes, and a record
added there, and nowhere else, is searched, saved, loaded, applied and printed."""
import pytest
import torch
from torch import nn

from ampc.autoprecision import Plan, _candidates, _objectives, search
from ampc.autoprecision._candidates import Candidate
from ampc.autoprecision._objectives import Objective


def test_candidate_records_match_torch():
    for name, c in _candidates.REGISTRY.items():
        assert c.name == name
        if not c.fp8_linear:
            assert c.bytes == torch.tensor([], dtype=c.dtype).element_size(), name
        # raising one step at a time ends at the reference, never in a loop
        seen, at = [], name
        while at != _candidates.REFERENCE:
            assert at not in seen, f"{name}: raise_to loops through {seen}"
            seen.append(at)
            at = _candidates.get(at).raise_to
    assert _candidates.loss_scaled("fp16") and not _candidates.loss_scaled("bf16")
    assert _candidates.loss_names() == ("fp32", "bf16", "fp16")


@pytest.mark.parametrize("choices, region", [
    ((), "fp32"), (("fp32",), "fp32"), (("fp32", "fp16"), "fp16"), (("fp16", "bf16"), "bf16"),
    (("fp8",), "bf16"), (("fp8", "fp16"), "bf16")])
def test_region_dtype(choices, region):
    assert _candidates.region_dtype(choices) == region


def test_fp8_fits_linear_layers_of_16s_only():
    fp8 = _candidates.get("fp8")
    assert fp8.fits(nn.Linear(32, 16))
    assert not fp8.fits(nn.Linear(30, 16)) and not fp8.fits(nn.Conv1d(16, 16, 1))
    assert _candidates.get("bf16").fits(nn.Conv1d(16, 16, 1))


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(),
                         nn.Linear(32, 4))


def batches():
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g))
            for _ in range(2)]


def test_a_new_candidate_is_one_record(monkeypatch):
    """A half-precision candidate registered under a new name (bf16's dtype, its own
    name): the search measures and chooses it, the plan round-trips through JSON, applies,
    and trains under its region, with no other file told of it."""
    monkeypatch.setitem(_candidates.REGISTRY, "half_b",
                        Candidate("half_b", torch.bfloat16, 2, "fp32"))
    model = mlp()
    # no ceiling on the slowdown: on modules this small a 16-bit step's overhead makes the
    # ceiling a coin toss (0.12 against 0.16 ms), and this is about the registry
    plan = search(model, batches(), candidates=("fp32", "half_b"), objective="memory",
                  check=False, max_slowdown=None)
    assert set(plan.choices.values()) <= {"fp32", "half_b"}
    assert "half_b" in plan.choices.values(), plan.table()
    assert all(set(u.options) == {"fp32", "half_b"} for u in plan)
    assert plan.dtype == "bf16"
    again = Plan.from_json(plan.to_json())
    assert again.choices == plan.choices
    again.apply(model)
    low = next(n for n, c in again.choices.items() if c == "half_b")
    seen = {}

    def record(module, args, out):
        seen["dtype"] = out.dtype

    h = dict(model.named_modules())[low].register_forward_hook(record)
    x, y = batches()[0]
    with again.autocast():
        loss = nn.functional.cross_entropy(model(x).float(), y)
    loss.backward()
    h.remove()
    assert seen["dtype"] == torch.bfloat16
    assert "half_b" in plan.table()


def test_a_new_objective_is_one_record(monkeypatch):
    """An objective registered as a record (bytes ranked, judged by time too) is accepted
    by search and by a saved plan, and ranks like its cost says."""
    monkeypatch.setitem(_objectives.REGISTRY, "bytes_timed",
                        Objective("bytes_timed", cost="bytes", by_speed=True,
                                  has_ceiling=False))
    plan = search(mlp(), batches(), candidates=("fp32", "bf16"), objective="bytes_timed",
                  check=False)
    assert plan.data["objective"] == "bytes_timed"
    assert Plan.from_json(plan.to_json()).choices == plan.choices
    with pytest.raises(ValueError, match="objective must be one of time, memory, bytes_timed"):
        search(mlp(), batches(), objective="speed")
