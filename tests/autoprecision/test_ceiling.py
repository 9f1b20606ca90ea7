"""The memory objective's time ceiling: no candidate more than ``max_slowdown`` (1.25) times
slower than the fastest of its unit within the budget, and no whole step more than that
times fp32's; the table says what it ruled out. Timings are injected: nothing here depends
on how fast this machine is."""
import pytest
import torch
from torch import nn

from ampc.autoprecision import _measure, _search, _solve, _whole, search
from ampc.autoprecision._solve import Budget, solve


def _options(**ms):
    zero = {"loss_err": 0.0, "dgrad_err": 0.0, "wgrad_err": 0.0}
    out = {"fp32": dict(zero, ms=ms["fp32"], bytes=400)}
    for c in ("bf16", "fp16"):
        if c in ms:
            out[c] = dict(zero, loss_err=1e-3, ms=ms[c], bytes=200)
    return out


def test_the_solver_rules_out_what_is_over_the_ceiling():
    measured = {"a": _options(fp32=1.0, bf16=1.3, fp16=1.2), "b": _options(fp32=1.0, bf16=5.0)}
    choice, rejected = solve(measured, Budget(), "memory", ceiling=1.25)
    assert choice == {"a": "fp16", "b": "fp32"}
    assert rejected["a"] == {"bf16": "slower than the ceiling 1.25x: 1.3x the fastest "
                                     "(fp32 1.00 ms)"}
    assert rejected["b"]["bf16"].startswith("slower than the ceiling 1.25x: 5.0x")
    # without it, the fewest bytes whatever the time
    assert solve(measured, Budget(), "memory")[0] == {"a": "bf16", "b": "bf16"}
    # the fastest is the fastest the budget allows: an fp16 that is fast but over the
    # budget does not make fp32 "slow"
    over = _options(fp32=1.0, bf16=1.2, fp16=0.5)
    over["fp16"]["loss_err"] = 1.0
    choice, rejected = solve({"c": over}, Budget(), "memory", ceiling=1.25)
    assert choice == {"c": "bf16"} and set(rejected["c"]) == {"fp16"}


def _model_and_batches():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
                          nn.Linear(64, 8))
    g = torch.Generator().manual_seed(0)
    return model, [(torch.randn(16, 32, generator=g), torch.randint(0, 8, (16,), generator=g))
                   for _ in range(2)]


def _unit_times(monkeypatch, ms):
    """Every unit's run at a candidate takes ``ms[candidate]`` milliseconds (and the matmul
    probe passes every candidate: on a CPU without AVX-512 BF16 it would keep bf16 off the
    Linears before any of these times is read)."""
    real_run = _measure.run_at
    monkeypatch.setattr(_search, "probe", lambda candidates, device: {})

    def run_at(module, choice, *args):
        y, dx, dw, _ = real_run(module, choice, *args)
        return y, dx, dw, 1e-3 * ms[choice]
    monkeypatch.setattr(_measure, "run_at", run_at)


def _step_times(monkeypatch, ms):
    """A whole step takes 10 ms in fp32, ``ms(plan)`` under a plan's region."""
    real_step = _whole.whole_step

    def whole_step(model, batch, loss_fn, region, device):
        loss, grads, _ = real_step(model, batch, loss_fn, region, device)
        plan = getattr(region, "__self__", None)
        return loss, grads, 1e-3 * (10.0 if plan is None else ms(plan))
    monkeypatch.setattr(_whole, "whole_step", whole_step)


def memory_search(**kw):
    model, batches = _model_and_batches()
    return search(model, batches, candidates=("fp32", "bf16"), objective="memory", repeats=1,
                  loss_unit=False, **kw)


@pytest.mark.parametrize("ms, why", [
    (1.6, "slower than the ceiling 1.25x: 1.6x"),   # measured, then ruled out by the solver
    (2.0, "too slow here: 2.0x fp32's time"),       # past 1.5x the ceiling: not measured on
])
def test_a_unit_much_slower_in_bf16_stays_fp32(monkeypatch, ms, why):
    _unit_times(monkeypatch, {"fp32": 1.0, "bf16": ms})
    _step_times(monkeypatch, lambda plan: 10.0)
    plan = memory_search()
    assert set(plan.choices.values()) == {"fp32"}
    for u in plan.units:
        assert u.rejected["bf16"].startswith(why), u.rejected
    text = plan.table()
    assert "time ceiling 1.25x" in text and "ruled out bf16 for 3 module(s)" in text
    assert all(l.endswith("bf16 slower") for l in text.splitlines() if l[:2] in ("0 ", "2 ", "4 "))
    # lifted: the fewest bytes, as before the ceiling
    assert set(memory_search(max_slowdown=None).choices.values()) == {"bf16"}
    # raised: 2x is within a 2.5x ceiling
    assert set(memory_search(max_slowdown=2.5).choices.values()) == {"bf16"}


def test_within_the_ceiling_the_fewest_bytes_win(monkeypatch):
    _unit_times(monkeypatch, {"fp32": 1.0, "bf16": 1.2})
    _step_times(monkeypatch, lambda plan: 11.0)
    plan = memory_search()
    assert set(plan.choices.values()) == {"bf16"}
    assert not any("ceiling" in n for n in plan.data["notes"])
    assert plan.data["measured"]["plan_ms"] == pytest.approx(11.0)


def test_a_whole_step_over_the_ceiling_is_raised_until_under(monkeypatch):
    # every unit within the ceiling alone, the whole step twice fp32's until the ops outside
    # the units run fp32
    _unit_times(monkeypatch, {"fp32": 1.0, "bf16": 1.2})
    _step_times(monkeypatch, lambda plan: 10.5 if plan.rest == "fp32" else 20.0)
    plan = memory_search()
    assert set(plan.choices.values()) == {"bf16"} and plan.rest == "fp32"
    note = next(n for n in plan.data["notes"] if "ceiling" in n)
    assert "20.0 ms per step against fp32's 10.0 ms" in note
    assert note.endswith("the ops outside the modules to fp32"), note
    assert plan.data["measured"]["plan_ms"] == pytest.approx(10.5)
    # slower whatever the ops outside: the units slower alone than fp32 go back to fp32
    _step_times(monkeypatch, lambda plan: 20.0 if plan.dtype == "bf16" else 10.0)
    plan = memory_search()
    assert set(plan.choices.values()) == {"fp32"}
    note = next(n for n in plan.data["notes"] if "ceiling" in n)
    assert note.endswith("then 3 modules slower than fp32 alone to fp32"), note
    # the control: without the ceiling the twice-as-slow plan is kept
    plan = memory_search(max_slowdown=None)
    assert set(plan.choices.values()) == {"bf16"} and plan.rest == "bf16"
    assert plan.data["measured"]["plan_ms"] == pytest.approx(20.0)


def test_the_ceiling_is_checked_and_only_for_the_memory_objective(monkeypatch):
    for bad in (0.5, "fast", float("inf")):
        with pytest.raises(ValueError, match="max_slowdown must be None or a number"):
            memory_search(max_slowdown=bad)
    monkeypatch.setattr(_search, "probe", lambda candidates, device: {})
    model, batches = _model_and_batches()
    plan = search(model, batches, candidates=("fp32", "bf16"), objective="time", repeats=1,
                  loss_unit=False, check=False)
    assert plan.data["ceiling"] is None and "time ceiling" not in plan.table()
    assert _solve.CEILING == 1.25
