"""Nothing decided on zeros: a unit whose output, or the gradient at it, is all zero or not
finite on every search batch cannot show a precision's error (every error would read 0). The
search then measures a copy of the model after a few fp32 AdamW steps (by default, or on
request), or keeps the unit fp32, "not measured", and says which in the plan's notes."""
import pytest
import torch
from torch import nn

from ampc.autoprecision import _measure, search
from ampc._numerics.capture import Call
from ampc._numerics.model import default_loss


def zero_head_model():
    """A classifier whose head is zero-initialised: its output is all zero, and so is
    every gradient below it."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
                          nn.Linear(64, 10))
    with torch.no_grad():
        model[4].weight.zero_()
        model[4].bias.zero_()
    return model


def batches(n=2):
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(16, 32, generator=g), torch.randint(0, 10, (16,), generator=g))
            for _ in range(n)]


def units_of(model):
    return {n: m for n, m in model.named_children() if isinstance(m, nn.Linear)}


def silent_units(model, batches, loss_fn, units):
    """{name: why} of the units silent on every batch, as the search's first pass finds them."""
    return _measure.silent_on_all([_measure.silent_in(model, b, loss_fn, units) for b in batches])


def test_a_zero_head_silences_every_unit():
    model = zero_head_model()
    assert silent_units(model, batches(), default_loss, units_of(model)) == {
        "0": "its output gradient is all zero", "2": "its output gradient is all zero",
        "4": "its output is all zero"}
    healthy = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10))
    assert silent_units(healthy, batches(), default_loss, units_of(healthy)) == {}
    # a non-finite output or gradient shows nothing either
    assert _measure.unit_silent(Call((), {}, out=torch.tensor([1.0, float("inf")]))) == \
        "its output is not finite"
    assert _measure.unit_silent(Call((), {}, out=torch.ones(2),
                                     grad=torch.tensor([float("nan"), 0.0]))) == \
        "its output gradient is not finite"


def test_search_warms_up_a_copy_and_measures_real_errors():
    model = zero_head_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    plan = search(model, batches(), candidates=("fp32", "bf16"), objective="memory", repeats=1,
                  max_slowdown=None)
    note = next(n for n in plan.data["notes"] if "cannot show an error" in n)
    assert "3 of 3 modules" in note and "after 3 fp32 AdamW steps" in note, note
    for name in ("0", "2", "4"):
        bf16 = plan.unit(name).options["bf16"]
        assert "not_measured" not in bf16
        assert bf16["loss_err"] > 0 and bf16["wgrad_err"] > 0, (name, bf16)
    assert not any("not measured" in n for n in plan.data["notes"])
    for k, v in model.state_dict().items():          # the model itself is not changed
        assert torch.equal(v, before[k]), k


def test_without_warmup_the_silent_units_stay_fp32_not_measured():
    plan = search(zero_head_model(), batches(), candidates=("fp32", "bf16"), objective="memory",
                  repeats=1, warmup=0, max_slowdown=None)
    for name in ("0", "2", "4"):
        u = plan.unit(name)
        assert u.choice == "fp32", plan.table()
        assert u.rejected["bf16"].startswith("not measured: its output"), u.rejected
    assert any(n.startswith("3 module(s) kept fp32, not measured") for n in plan.data["notes"])
    assert not any("AdamW" in n for n in plan.data["notes"])
    row = next(l for l in plan.table().splitlines() if l.startswith("2 "))
    assert row.endswith("bf16 not measured"), row


def test_the_control_without_the_check_every_error_reads_zero(monkeypatch):
    # what the search did before: at these weights every bf16 error measured 0.0, and the
    # plan lowered every unit on that
    monkeypatch.setattr(_measure, "unit_silent", lambda rec: None)
    plan = search(zero_head_model(), batches(), candidates=("fp32", "bf16"), objective="memory",
                  repeats=1, warmup=0, max_slowdown=None)
    for name in ("0", "2"):
        bf16 = plan.unit(name).options["bf16"]
        assert (bf16["loss_err"], bf16["dgrad_err"], bf16["wgrad_err"]) == (0.0, 0.0, 0.0)
    assert set(plan.choices.values()) == {"bf16"}


def test_warmup_on_request_and_its_argument_checked():
    torch.manual_seed(0)
    healthy = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10))
    plan = search(healthy, batches(), candidates=("fp32", "bf16"), objective="memory",
                  repeats=1, warmup=2, max_slowdown=None)
    assert any(n.startswith("warmup=2: measured after 2 fp32 AdamW steps")
               for n in plan.data["notes"]), plan.data["notes"]
    plain = search(healthy, batches(), candidates=("fp32", "bf16"), objective="memory",
                   repeats=1, max_slowdown=None)
    assert not any("AdamW" in n for n in plain.data["notes"])
    # measured at other weights: other errors
    assert plan.unit("0").options["bf16"]["wgrad_err"] != plain.unit("0").options["bf16"]["wgrad_err"]
    for bad in (-1, 1.5, "always", True):
        with pytest.raises(ValueError, match="warmup must be 'auto' or a number"):
            search(healthy, batches(), warmup=bad)


@pytest.mark.slow
def test_torchvision_vit_zero_initialised_head():
    torchvision = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    model = torchvision.models.VisionTransformer(image_size=32, patch_size=4, num_layers=2,
                                                 num_heads=2, hidden_dim=32, mlp_dim=64,
                                                 num_classes=10)
    assert not model.heads.head.weight.any()            # the premise: a zero head
    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(8, 3, 32, 32, generator=g), torch.randint(0, 10, (8,), generator=g))
            for _ in range(2)]
    plan = search(model, data, candidates=("fp32", "bf16"), objective="memory", repeats=1,
                  max_slowdown=None)
    note = next(n for n in plan.data["notes"] if "cannot show an error" in n)
    assert f"{len(plan.units)} of {len(plan.units)} modules" in note, note
    assert max(map(len, plan.table().splitlines())) <= 120        # its long module names
    for u in plan.units:
        bf16 = u.options["bf16"]
        assert "not_measured" not in bf16, u.module
        assert max(bf16[k] or 0.0 for k in ("loss_err", "dgrad_err", "wgrad_err")) > 0, \
            (u.module, bf16)
