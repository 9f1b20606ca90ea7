"""Timing in ampc.autoprecision: the "too slow here" cut compares warm times (a
candidate's first call, with its kernel selection, allocation and fp8's first amax, is not
its cost), and timing noise within the margin cannot flip a choice: within it, the choice
that needs less memory wins."""
import random
import time

import pytest
import torch
from torch import nn

from ampc.autoprecision import _measure, _search, _solve, _whole, search
from ampc.autoprecision._units import Reason
from ampc.autoprecision._solve import order


class SlowFirstCall(nn.Linear):
    """A Linear whose first forward, in every copy, takes 50 ms longer."""

    def __init__(self, n):
        super().__init__(n, n)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        if self.calls == 1:
            time.sleep(0.05)
        return super().forward(x)


def test_first_call_is_not_timed():
    torch.manual_seed(0)
    model = nn.Sequential(SlowFirstCall(32))
    batches = [(torch.randn(8, 32), torch.randint(0, 32, (8,))) for _ in range(2)]
    units = {"0": model[0]}
    measured, _ = _measure.measure(model, batches, _measure_loss, units, {"0": ["fp32", "bf16"]},
                                   "cpu", None, repeats=1, slow=4.0)
    bf16 = measured["0"]["bf16"]
    assert "too_slow" not in bf16 and bf16["wgrad_err"] is not None


def _measure_loss(out, target):
    return nn.functional.cross_entropy(out.float(), target)


def test_three_identical_linears_same_verdict():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(),
                          nn.Linear(128, 128))
    batches = [(torch.randn(64, 128), torch.randint(0, 128, (64,))) for _ in range(2)]
    plan = search(model, batches, candidates=("fp32", "bf16", "fp16"), objective="time",
                  repeats=2)
    tried = [c for c in ("bf16", "fp16") if c in plan.unit("0").options]
    if not tried:
        pytest.skip("neither bf16 nor fp16 is tried on this CPU (its matmul probe is too slow)")
    for c in tried:
        verdicts = {n: "too_slow" in plan.unit(n).options[c] for n in ("0", "2", "4")}
        assert len(set(verdicts.values())) == 1, (c, verdicts, plan.table())


# ---- the margin: timing noise cannot flip a choice ----

def _options(fp32_ms, bf16_ms):
    zero = {"loss_err": 0.0, "dgrad_err": 0.0, "wgrad_err": 0.0}
    return {"fp32": dict(zero, ms=fp32_ms, bytes=400),
            "bf16": dict(zero, loss_err=1e-3, ms=bf16_ms, bytes=200)}


def test_less_memory_wins_unless_clearly_slower():
    assert _solve.MARGIN == 0.10
    m = _solve.MARGIN
    # bf16 needs half the memory: it goes first until it is more than MARGIN slower
    assert order(_options(1.0, 1.0), "time")[0] == "bf16"
    assert order(_options(1.0, 1.0 + 0.99 * m), "time")[0] == "bf16"
    assert order(_options(1.0, 1.0 + 1.01 * m), "time")[0] == "fp32"
    assert order(_options(1.0 + 5 * m, 1.0), "time")[0] == "bf16"
    assert order(_options(1.0, 1.0 + 1.01 * m), "memory")[0] == "bf16"
    assert _solve.clearly_faster(1.0, 1.0 + 1.01 * m)
    assert not _solve.clearly_faster(1.0, 1.0 + 0.99 * m)


def _search_with_jitter(monkeypatch, jitter, seed):
    """search (time objective) on a small model with every timing replaced: each unit at
    fp32 and at bf16 takes 1 ms, the whole model 10 ms whatever its plan, each time times
    a random factor in [1 - jitter, 1 + jitter] (seeded)."""
    rng = random.Random(seed)
    real_run, real_step = _measure.run_at, _whole.whole_step

    def run_at(*args):
        y, dx, dw, _ = real_run(*args)
        return y, dx, dw, 1e-3 * rng.uniform(1 - jitter, 1 + jitter)

    def whole_step(*args):
        loss, grads, _ = real_step(*args)
        return loss, grads, 1e-2 * rng.uniform(1 - jitter, 1 + jitter)
    monkeypatch.setattr(_measure, "run_at", run_at)
    monkeypatch.setattr(_whole, "whole_step", whole_step)
    monkeypatch.setattr(_search, "probe", lambda candidates, device: {})
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
                          nn.Linear(64, 8))
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(16, 32, generator=g), torch.randint(0, 8, (16,), generator=g))
               for _ in range(2)]
    plan = search(model, batches, candidates=("fp32", "bf16"), objective="time", repeats=2)
    return plan.choices, plan.rest


def test_same_plan_whatever_the_timing_noise(monkeypatch):
    # every comparison is between equal true times: noise of +-4% moves a ratio by at most
    # about 8%, under the 10% margin, so the choice needing less memory (bf16, and bf16 for
    # the ops outside the units) wins in every draw
    plans = {str(_search_with_jitter(monkeypatch, 0.4 * _solve.MARGIN, seed)) for seed in range(6)}
    assert plans == {str(({"0": "bf16", "2": "bf16", "4": "bf16"}, "bf16"))}, plans


def test_without_the_margin_noise_flips_choices(monkeypatch):
    # the control: with no margin (the faster time always wins) the same noise decides
    strict = lambda ms, than, margin=None: ms < than        # noqa: E731
    monkeypatch.setattr(_solve, "clearly_faster", strict)
    monkeypatch.setattr(_whole, "clearly_faster", strict)
    plans = {str(_search_with_jitter(monkeypatch, 0.4 * _solve.MARGIN, seed)) for seed in range(6)}
    assert len(plans) > 1, plans


def test_units_timed_alike_share_the_fastest_time(monkeypatch):
    # three identical Linears and one of another shape; each run's time is drawn at
    # random (a busy machine): the identical ones get the fastest timed run of all three
    rng = random.Random(0)
    real_run = _measure.run_at
    drawn = {}      # (copy of a unit, candidate) -> its times, the first an untimed warm-up

    def run_at(module, choice, *args):
        y, dx, dw, _ = real_run(module, choice, *args)
        t = rng.uniform(1e-3, 2e-3)
        drawn.setdefault((id(module), choice), (module, []))[1].append(t)
        return y, dx, dw, t
    monkeypatch.setattr(_measure, "run_at", run_at)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32), nn.Linear(32, 32), nn.Linear(32, 8))
    batches = [(torch.randn(8, 32), torch.randint(0, 8, (8,))) for _ in range(2)]
    units = dict(model.named_children())
    measured, _ = _measure.measure(model, batches, _measure_loss, units,
                                   dict.fromkeys(units, ["fp32", "bf16"]), "cpu", None, repeats=2)
    for c in ("fp32", "bf16"):
        timed = {m.out_features: [] for (_, cc), (m, _) in drawn.items() if cc == c}
        for (_, cc), (m, ts) in drawn.items():
            if cc == c:
                timed[m.out_features].append(min(ts[1:]))
        assert {measured[n][c]["ms"] for n in ("0", "1", "2")} == {1e3 * min(timed[32])}
        assert len(timed[32]) == 3 and len(set(timed[32])) == 3      # they did differ
        assert measured["3"][c]["ms"] == 1e3 * min(timed[8])


def test_only_the_first_unit_timed_alike_repeats_its_runs(monkeypatch):
    """The errors need one run a candidate and batch; the time is pooled over the units
    timed alike, so the second and third identical Linear run once where the first runs
    ``repeats`` times (after one untimed first call each)."""
    real_run = _measure.run_at
    runs = {}

    def run_at(module, choice, *args):
        runs[(id(module), choice)] = runs.get((id(module), choice), 0) + 1
        return real_run(module, choice, *args)
    monkeypatch.setattr(_measure, "run_at", run_at)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32), nn.Linear(32, 32), nn.Linear(32, 8))
    batches = [(torch.randn(8, 32), torch.randint(0, 8, (8,))) for _ in range(2)]
    units = dict(model.named_children())
    copies = {}
    real_copies = _measure._copies

    def keep_copies(units, options):
        copies.update(real_copies(units, options))
        return copies
    monkeypatch.setattr(_measure, "_copies", keep_copies)
    measured, _ = _measure.measure(model, batches, _measure_loss, units,
                                   dict.fromkeys(units, ["fp32", "bf16"]), "cpu", None, repeats=3)
    for name, want in (("0", 1 + 2 * 3), ("1", 1 + 2), ("2", 1 + 2), ("3", 1 + 2 * 3)):
        for c in ("fp32", "bf16"):
            assert runs[(id(copies[name][c]), c)] == want, (name, c)
            assert measured[name][c]["wgrad_err"] is not None


def _search_under_late_load(monkeypatch):
    """search (time objective) where the plan truly takes 0.8 of fp32's step, and the
    machine gets twice as slow for everything after fp32's reference was timed (its
    first five whole steps: a warm-up and two runs over the two batches)."""
    calls = {"n": 0}
    real_step = _whole.whole_step

    def whole_step(model, batch, loss_fn, region, device):
        loss, grads, _ = real_step(model, batch, loss_fn, region, device)
        calls["n"] += 1
        load = 1.0 if calls["n"] <= 5 else 2.0
        return loss, grads, load * (1e-2 if region is _whole.null else 8e-3)
    monkeypatch.setattr(_whole, "whole_step", whole_step)
    monkeypatch.setattr(_search, "probe", lambda candidates, device: {})
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8))
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(16, 32, generator=g), torch.randint(0, 8, (16,), generator=g))
               for _ in range(2)]
    return search(model, batches, candidates=("fp32", "bf16"), objective="time", repeats=1)


def test_plan_against_fp32_timed_turn_about(monkeypatch):
    # turn about, both steps see the doubled load: the plan (0.8 of fp32) is kept
    plan = _search_under_late_load(monkeypatch)
    m = plan.data["measured"]
    assert plan.dtype != "fp32" and m["plan_ms"] == pytest.approx(16.0)
    assert m["fp32_ms"] == pytest.approx(20.0)
    assert not any("every module kept in fp32" in n for n in plan.data["notes"])


def test_timed_apart_the_late_load_flips_the_plan(monkeypatch):
    # the control: fp32's time taken from its reference (before the load came) against the
    # plan's under load: 10 ms against 16, and the whole plan goes to fp32
    real_race = _whole.race

    def apart(entrants, batches, device, rounds=3):
        if set(entrants) != {"fp32", "plan"}:
            return real_race(entrants, batches, device, rounds)
        model, region, fn = entrants["plan"]()
        return {"fp32": 1e3 * 1e-2,
                "plan": 1e3 * min(_whole.whole_step(model, b, fn, region, "cpu")[2]
                                  for b in batches)}
    monkeypatch.setattr(_whole, "race", apart)
    plan = _search_under_late_load(monkeypatch)
    assert plan.dtype == "fp32"
    assert any("every module kept in fp32" in n for n in plan.data["notes"])


class Burst:
    """Fake step times for the whole-model decisions: ``ms(plan)`` for a plan's step, 10 ms
    for fp32's; twice as slow while ``on`` (a burst of load). The losses and gradients are
    the real step's."""

    def __init__(self, monkeypatch, ms):
        self.on, self.ms = False, ms
        real_step = _whole.whole_step

        def whole_step(model, batch, loss_fn, region, device):
            loss, grads, _ = real_step(model, batch, loss_fn, region, device)
            plan = getattr(region, "__self__", None)
            base = 10.0 if plan is None else self.ms(plan)
            return loss, grads, 1e-3 * base * (2.0 if self.on else 1.0)
        monkeypatch.setattr(_whole, "whole_step", whole_step)

    def during(self, fn, *args):
        self.on = True
        try:
            return fn(*args)
        finally:
            self.on = False


def _decision_setup():
    """A model's per-unit plan (search without the whole-model check) and the whole-model
    check over it (fp32's reference measured, a working copy): what the decisions take."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8))
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(16, 32, generator=g), torch.randint(0, 8, (16,), generator=g))
               for _ in range(2)]
    plan = search(model, batches, candidates=("fp32", "bf16"), objective="memory",
                  max_slowdown=None, repeats=1, check=False, loss_unit=False)
    measured = {u.module: u.options for u in plan}
    return plan, _whole.Check(model, batches, _search.default_loss, plan, measured,
                              _solve.Budget(), "cpu")


def test_the_ops_outside_the_units_are_decided_turn_about(monkeypatch):
    # the plan's step takes 8 ms with the ops outside the units at the region dtype, 7.6 ms
    # with them in fp32: not clearly faster, so the region dtype stays. A burst of load
    # while the plan was first checked (16 ms) must not make fp32 look 2x faster
    plan, check = _decision_setup()
    assert plan.dtype == "bf16"
    burst = Burst(monkeypatch, lambda p: 7.6 if p.data.get("rest") == "fp32" else 8.0)
    result = burst.during(check.run)
    assert result["plan_ms"] == pytest.approx(16.0)
    result, fp32_ms = check.fastest(result)
    assert plan.rest == "bf16" and plan.data["rest"] == "bf16"
    assert result["plan_ms"] == pytest.approx(8.0) and fp32_ms == pytest.approx(10.0)
    # and where fp32 outside the units is clearly faster (6 ms), it is taken
    plan, check = _decision_setup()
    burst.ms = lambda p: 6.0 if p.data.get("rest") == "fp32" else 8.0
    check.fastest(check.run())
    assert plan.rest == "fp32"


def test_the_least_precise_plan_is_raced_against_the_modules_own(monkeypatch):
    # the modules one by one chose fp32 (say); at every module's least precise candidate
    # the whole model takes 8 ms, the modules' own choice 7.6 ms: not clearly faster, so
    # the least precise plan (less memory) is taken, though a burst of load hit its check
    plan, check = _decision_setup()
    plan.set_choices(dict.fromkeys(plan.choices, "fp32"), Reason.SOLVED)
    burst = Burst(monkeypatch, lambda p: 8.0 if p.dtype == "bf16" else 7.6)
    result = check.run()
    real_run = check.run
    monkeypatch.setattr(check, "run", lambda: burst.during(real_run))
    result = check.whole_low(result)
    assert set(plan.choices.values()) == {"bf16"}
    assert result["plan_ms"] == pytest.approx(8.0)
    assert any("timed turn about" in n for n in plan.data["notes"])
    # where the modules' own choice is clearly faster (6 ms), it stays
    plan.set_choices(dict.fromkeys(plan.choices, "fp32"), Reason.SOLVED)
    burst.ms = lambda p: 8.0 if p.dtype == "bf16" else 6.0
    check.whole_low(result)
    assert set(plan.choices.values()) == {"fp32"}
