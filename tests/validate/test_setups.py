"""validate's setups are records (_setups.py): each builds what its name says, and a new
setup is one record there, trained by compare() with nothing else told of it."""
import pytest
import torch
from torch import nn

import ampc
from ampc import validate
from ampc.validate import _setups
from ampc.validate._setups import Setup

def make_model():
    return nn.Sequential(nn.Linear(12, 24), nn.GELU(), nn.LayerNorm(24), nn.Linear(24, 3))


def make_batch(step):
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn(10, 12, generator=g)
    return x, (x[:, :3].sum(1) > 0).long() + (x[:, 3] > 1).long()


def test_the_setup_lists_come_from_the_records():
    assert validate.SETUPS == ("torch.amp", "ampc", "ampc.master")
    assert validate.ALL_SETUPS == tuple(n for n in _setups.REGISTRY if n != "fp32")
    assert validate.LEAN_SETUP in validate.ALL_SETUPS
    assert set(validate.CONTRAST_SETUPS) <= set(validate.ALL_SETUPS)


@pytest.mark.parametrize("name, opt_type, scaler", [
    ("fp32", torch.optim.AdamW, type(None)), ("torch.amp", torch.optim.AdamW, torch.amp.GradScaler),
    ("ampc", ampc.optim.AdamW, ampc.GradScaler), ("ampc.master", ampc.optim.AdamW, ampc.GradScaler),
    ("ampc.lean", ampc.optim.AdamW, ampc.GradScaler),
    ("torch.amp.noscale", torch.optim.AdamW, type(None)), ("pure", torch.optim.AdamW, type(None))])
def test_each_record_builds_its_optimizer_and_fp16_scaler(name, opt_type, scaler):
    setup = _setups.REGISTRY[name]
    model, opt = setup.build(make_model(), torch.float16, 1e-3)
    assert type(opt) is opt_type
    assert isinstance(_setups.scaler(setup.scaler, "cpu"), scaler)
    low = {p.dtype for p in model.parameters()} - {torch.float32}
    assert low == ({torch.float16} if name in ("ampc.master", "ampc.lean", "pure") else set())
    if name == "ampc.lean":
        assert opt.param_groups[0]["moments"] == "8bit"


def test_a_new_setup_is_one_record(monkeypatch):
    """A setup registered as a record (ampc's optimizer with Kahan-compensated bf16 weights,
    under ampc.autocast) is trained by compare() beside fp32 and reported."""
    monkeypatch.setitem(_setups.REGISTRY, "ampc.kahan", Setup(
        "ampc.kahan", _setups._prepared(master_weights=False, kahan_summation=True), "ampc",
        _setups._ampc_region))
    report = validate.compare(make_model, make_batch, steps=4, setups=("ampc.kahan",),
                              seeds=(0,), dtype=torch.bfloat16, progress=False)
    assert [r["setup"] for r in report.rows] == ["ampc.kahan bf16"]
    run = report.runs[0]
    assert run.kind == "ampc.kahan" and len(run.losses) == 4
    with pytest.raises(ValueError, match="unknown setup 'ampc.nope'; choose from torch.amp"):
        validate.compare(make_model, make_batch, steps=2, setups=("ampc.nope",), seeds=(0,))
