"""The Monitor's watch for spikes of the loss and the gradient norm: flagged against a
float64 reference of the same statistic, no host read while the run is healthy, and on a
spike every planned module re-measured at once: the one over its allowance raised, or, when
none is, the closest named."""
import math
import sys
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

from ampc.autoprecision import Plan
from ampc.autoprecision._spikes import SpikeWatch

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1] / "scaler"))
from test_grad_scaler_extras import SyncCounter   # noqa: E402
from test_monitor import batches, make_model, plan_json   # noqa: E402,F401


def reference_flags(values, k, rise, warmup, beta):
    """The spike rule in float64, step by step (see ampc/autoprecision/_spikes.py)."""
    mean = var = None
    flags, streak = [], 0
    for n, x in enumerate(values):
        lx = math.log(max(x, 1e-30)) if math.isfinite(x) else math.nan
        if mean is None:
            mean, var = lx, 0.0
        finite = math.isfinite(lx)
        dev = lx - mean if finite else 0.0
        spike = finite and n >= warmup and dev > max(k * math.sqrt(var), math.log1p(rise))
        streak = streak + 1 if spike else 0
        if finite and (not spike or streak >= 3):
            mean, var = mean + (1 - beta) * dev, beta * (var + (1 - beta) * dev * dev)
        flags.append(spike)
    return flags


def test_spike_flags_match_a_float64_reference():
    g = torch.Generator().manual_seed(0)
    values = (2.0 * torch.exp(-torch.arange(200) / 100) * (1 + 0.05 * torch.randn(200, generator=g)))
    values = values.tolist()
    values[60] *= 3                  # spikes
    values[61] *= 2.5
    values[120] = math.inf           # non-finite: not a spike, kept out of the history
    values[150] = math.nan
    values[170] *= 1.3               # a rise under the floor
    for i in range(180, 200):        # a new level: three flagged, then it is the history
        values[i] *= 4
    watch = SpikeWatch(k=4.0, rise=0.5, warmup=20)
    got = [bool(watch.seen(watch.update(torch.tensor(v)))) for v in values]
    want = reference_flags(values, 4.0, 0.5, 20, 0.95)
    assert got == want
    assert [i for i, f in enumerate(got) if f] == [60, 61, 180, 181, 182]


def test_a_spike_in_warmup_is_not_flagged():
    watch = SpikeWatch(warmup=20)
    assert not any(watch.seen(watch.update(torch.tensor(v))) for v in [1.0] * 10 + [50.0])


def run(model, plan, monitor, data, spike_at=None, drift_at=None, counter=None):
    """Trains on `data` with the plan, handing the Monitor each step's loss (`spike_at`:
    that step's reported 20x) and gradient norm; `counter` counts only the Monitor's reads."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for k, (x, y) in enumerate(data):
        if k == drift_at:
            with torch.no_grad():
                model[2].weight.mul_(1e5)      # its outputs now pass fp16's range
        opt.zero_grad()
        with plan.autocast():
            loss = nn.functional.cross_entropy(model(x).float(), y)
        loss.backward()
        norm = nn.utils.clip_grad_norm_(model.parameters(), 1e9)
        opt.step()
        reported = loss.detach() * (20 if k == spike_at else 1)
        if counter is not None:
            counter.paused = False
        monitor.step((x, y), loss=reported, grad_norm=norm if k != drift_at else None)
        if counter is not None:
            counter.paused = True


def test_healthy_steps_read_nothing_back(plan_json, monkeypatch):
    plan = Plan.from_json(plan_json)
    model = make_model()
    monitor = plan.apply(model).monitor(every=1000, spike_warmup=5)
    monkeypatch.setattr(monitor, "measure", lambda *a: pytest.fail("measured on a healthy run"))
    counter = SyncCounter(monkeypatch)
    counter.paused = True
    run(model, plan, monitor, batches(30, seed=4), counter=counter)
    assert counter.calls == []
    assert monitor.spikes == [] and monitor.decisions == []


def test_a_spike_re_measures_at_once_and_raises_the_module_over_its_allowance(plan_json):
    plan = Plan.from_json(plan_json)
    model = make_model()
    monitor = plan.apply(model).monitor(every=1000, spike_warmup=10)
    run(model, plan, monitor, batches(16, seed=5), spike_at=12, drift_at=12)
    assert [s["step"] for s in monitor.spikes] == [13]
    assert monitor.spikes[0]["signals"] == ["loss"] and monitor.spikes[0]["raised"] == ["2"]
    assert [(d["module"], d["from"], d["to"]) for d in monitor.decisions] == \
        [("2", "fp16", "fp32")]
    assert plan.choices == {"0": "fp16", "2": "fp32", "4": "fp16"}


def test_a_spike_no_module_explains_is_named_not_acted_on(plan_json):
    plan = Plan.from_json(plan_json)
    model = make_model()
    monitor = plan.apply(model).monitor(every=1000, spike_warmup=10)
    with pytest.warns(UserWarning, match=r"step 13: a spike of the loss; no module of the plan "
                                         r"is over its error allowance .*closest: "):
        run(model, plan, monitor, batches(16, seed=5), spike_at=12)
    assert monitor.decisions == [] and set(plan.choices.values()) == {"fp16"}
    assert len(monitor.spikes) == 1 and monitor.spikes[0]["raised"] == []
    assert len(monitor.spikes[0]["ratios"]) == 3
    state = monitor.state_dict()
    again = Plan.from_json(plan_json).apply(make_model()).monitor()
    again.load_state_dict(state)
    assert again.spikes == monitor.spikes


@pytest.mark.parametrize("kwargs, match", [
    (dict(spike_k=0), "spike_k must be a positive number"),
    (dict(spike_rise=-1.0), "spike_rise must be a positive number"),
    (dict(spike_warmup=0), "spike_warmup must be a positive int"),
    (dict(spike_cooldown=0), "spike_cooldown must be a positive int"),
])
def test_bad_spike_arguments(plan_json, kwargs, match):
    with pytest.raises(ValueError, match=r"ampc.autoprecision.Monitor: " + match):
        Plan.from_json(plan_json).apply(make_model()).monitor(**kwargs)


def test_warnings_free_run_has_no_spike(plan_json):
    plan = Plan.from_json(plan_json)
    model = make_model()
    monitor = plan.apply(model).monitor(every=1000, spike_warmup=5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        run(model, plan, monitor, batches(30, seed=6))
    assert monitor.spikes == []
