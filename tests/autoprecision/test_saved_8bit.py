"""The memory objective's second axis: a unit may keep its saved activations in 8 bits
("fp32+8b", "bf16+8b": ampc.memory.compress), chosen from the weight-gradient error that adds
against the budget and fp32's spread; the plan applies, prints, saves and loads the choice."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ampc
import ampc.memory
from ampc.autoprecision import Plan, _objectives, search
from autoprecision_models import Block


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), Block(), Block(), nn.Linear(64, 10))


def _batches(n=3):
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(128, 32, generator=g), torch.randint(0, 10, (128,), generator=g))
            for _ in range(n)]


def _search(**kw):
    kw.setdefault("max_slowdown", None)     # times on a shared CPU must not decide the test
    return search(_model(), _batches(), candidates=("fp32", "fp32+8b"), objective="memory",
                  **kw)


def test_the_memory_objective_tries_saved_activations_in_8_bits():
    assert {"fp32+8b", "bf16+8b"} <= set(_objectives.get("memory").candidates)
    assert not any("+8b" in c for c in _objectives.get("time").candidates)


def test_chosen_where_the_error_fits_the_budget():
    plan = _search()
    chosen = {u.module: u for u in plan if u.choice == "fp32+8b"}
    assert chosen, plan.table()
    for u in chosen.values():
        f = u.figures()
        # a Linear's input gradient needs only its weight: unchanged; its weight gradient
        # reads the decoded input: a few % off
        assert f["dgrad_err"] == 0
        assert 0 < f["wgrad_err"] <= plan.budget.wgrad
        assert f["bytes"] < u.options["fp32"]["bytes"]
    assert "saved activations in 8 bits (ampc.memory.compress)" in plan.table()


def test_refused_where_the_budget_is_tighter_than_the_codes():
    plan = _search(budget={"wgrad": 1e-4, "noise_fraction": 0})
    assert all(u.choice == "fp32" for u in plan), plan.table()
    assert any("wgrad err" in why for u in plan for why in u.rejected.values())


def test_the_plan_applies_prints_saves_and_loads_the_choice(tmp_path):
    plan = _search()
    coded = {u.module for u in plan if u.choice == "fp32+8b"}
    model = _model()
    applied = plan.apply(model)
    assert ampc.memory.compressed(model) == {n: "8bit" for n in coded}
    applied.remove()
    assert ampc.memory.compressed(model) == {}
    # the pasted lines do the same
    pasted = _model()
    exec(plan.python(), {"model": pasted, "torch": torch, "ampc": ampc})
    assert ampc.memory.compressed(pasted) == {n: "8bit" for n in coded}
    loaded = Plan.load(plan.save(str(tmp_path / "plan.json")))
    assert loaded == plan and {u.module for u in loaded if u.choice == "fp32+8b"} == coded


def test_the_applied_plan_trains_like_fp32_and_saves_less():
    plan = _search()
    model, plain = _model(), _model()
    plan.apply(model)
    x, y = _batches(1)[0]
    reports = [ampc.memory.report(m, torch.optim.SGD(m.parameters(), lr=0.1), (x, y),
                                  F.cross_entropy) for m in (plain, model)]
    assert sum(reports[1].saved.values()) < 0.8 * sum(reports[0].saved.values())
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (plain, model)]
    for x, y in _batches(3) * 5:
        for m, o in zip((plain, model), opts):
            F.cross_entropy(m(x), y).backward()
            o.step()
            o.zero_grad()
    moved = [(p - q).norm() / q.norm() for p, q in zip(model.parameters(), plain.parameters())]
    assert max(moved) < 0.01


def test_a_switch_through_applied_set():
    plan = _search()
    model = _model()
    applied = plan.apply(model)
    name = next(u.module for u in plan if u.choice == "fp32+8b")
    applied.set(name, "fp32")
    assert name not in ampc.memory.compressed(model)
    applied.set(name, "fp32+8b")
    assert ampc.memory.compressed(model)[name] == "8bit"


def test_a_bf16_unit_with_8bit_saved_runs_under_the_region():
    plan = search(_model(), _batches(), candidates=("fp32", "bf16+8b"), objective="memory",
                  max_slowdown=None, check=False, budget={"wgrad": 1.0, "grad": 1.0})
    assert any(u.choice == "bf16+8b" for u in plan), plan.table()
    assert plan.dtype == "bf16"
    model = _model()
    plan.apply(model)
    x, y = _batches(1)[0]
    with plan.autocast():
        out = model(x)
    F.cross_entropy(out.float(), y).backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
    assert ampc.memory.compressed(model)


@pytest.mark.parametrize("bad", [("fp32", "fp32+9b"), ("int8",)])
def test_unknown_candidates_are_named(bad):
    with pytest.raises(ValueError, match="candidates must be among .*fp32\\+8b"):
        search(_model(), _batches(), candidates=bad)
