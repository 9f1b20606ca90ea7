"""ampc.autoprecision.Monitor: raises a module made to drift, leaves a stable run alone,
its record survives a checkpoint; and the plan is the same on every rank."""
import sys
import warnings

import pytest
import torch
from torch import nn

import ampc
from ampc.autoprecision import Plan, search


def make_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.Tanh(),
                         nn.Linear(32, 4))


def batches(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(16, 16, generator=g), torch.randint(0, 4, (16,), generator=g))
            for _ in range(n)]


@pytest.fixture(scope="module")
def plan_json():
    plan = search(make_model(), batches(2), candidates=("fp32", "fp16"), objective="memory",
                  max_slowdown=None, repeats=1)
    assert set(plan.choices.values()) == {"fp16"}
    return plan.to_json()


def train(model, plan, monitor, data, drift_at=None):
    opt = ampc.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = plan.scaler()
    for k, (x, y) in enumerate(data):
        if k == drift_at:
            with torch.no_grad():
                model[2].weight.mul_(1e5)      # its outputs now pass fp16's range
        opt.zero_grad()
        with plan.autocast():
            out = model(x)
        scaler.scale(nn.functional.cross_entropy(out.float(), y)).backward()
        scaler.step(opt)
        scaler.update()
        monitor.step((x, y))


def test_monitor_raises_a_drifting_module_and_survives_a_checkpoint(plan_json):
    plan = Plan.from_json(plan_json)
    model = make_model()
    applied = plan.apply(model)
    monitor = applied.monitor(every=2, sample=3)
    train(model, plan, monitor, batches(8, seed=1), drift_at=4)
    assert [(d["module"], d["from"], d["to"], d["step"]) for d in monitor.decisions] == \
        [("2", "fp16", "fp32", 6)]
    assert monitor.decisions[0]["ratio"] == float("inf")
    assert plan.choices == {"0": "fp16", "2": "fp32", "4": "fp16"}
    assert ampc.policy.module_scope_of(model[2]).dtype == torch.float32
    assert len(monitor.history) == 4 * 3      # 4 checks of all 3 modules

    state = monitor.state_dict()
    fresh_plan = Plan.from_json(plan_json)
    fresh = make_model()
    restored = fresh_plan.apply(fresh).monitor(every=2, sample=3)
    restored.load_state_dict(state)
    assert fresh_plan.choices == plan.choices
    assert ampc.policy.module_scope_of(fresh[2]).dtype == torch.float32
    assert restored.decisions == monitor.decisions and restored.steps == 8


def test_monitor_does_nothing_on_a_stable_run(plan_json):
    plan = Plan.from_json(plan_json)
    model = make_model()
    monitor = plan.apply(model).monitor(every=2, sample=2, action="warn")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        train(model, plan, monitor, batches(8, seed=2))
    assert monitor.decisions == [] and len(monitor.history) == 4 * 2
    assert all(h["ratio"] < 1 for h in monitor.history)
    assert set(plan.choices.values()) == {"fp16"}


def test_monitor_warns_once_with_hysteresis(plan_json):
    plan = Plan.from_json(plan_json)
    model = make_model()
    monitor = plan.apply(model).monitor(every=1, sample=3, action="warn")
    with pytest.warns(UserWarning, match=r"module 2 \(fp16\) is at inf"):
        train(model, plan, monitor, batches(6, seed=3), drift_at=2)
    assert [d["module"] for d in monitor.decisions] == ["2"]    # once, not every check
    assert plan.choices["2"] == "fp16"


def test_steps_between_checks_do_nothing(plan_json, monkeypatch):
    plan = Plan.from_json(plan_json)
    monitor = plan.apply(make_model()).monitor(every=5)
    monkeypatch.setattr(monitor, "measure", lambda *a: pytest.fail("measured between checks"))
    for _ in range(4):
        assert monitor.step(batches(1)[0]) == []


@pytest.mark.parametrize("kwargs, match", [
    (dict(action="panic"), "action must be 'raise' or 'warn'"),
    (dict(every=0), "every must be a positive int"),
    (dict(release=1.5), r"release must be in \(0, 1\)"),
])
def test_monitor_bad_arguments(plan_json, kwargs, match):
    plan = Plan.from_json(plan_json)
    with pytest.raises(ValueError, match=match):
        plan.apply(make_model()).monitor(**kwargs)


# ---- two ranks ----

def _rank_search(rank):
    # each rank measures its own batches (different data, different timings): rank 0's
    # plan is the one every rank gets
    torch.manual_seed(0)
    model = make_model()
    plan = search(model, batches(2, seed=rank), candidates=("fp32", "bf16"), repeats=1)
    return plan.to_json()


@pytest.mark.slow
def test_two_ranks_get_the_same_plan(tmp_path):
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parents[1]))
    from distributed.test_distributed import run_ranks
    a, b = run_ranks(_rank_search, tmp_path=tmp_path)
    assert a == b


def _tensor_bytes(tensors):
    return sum(t.numel() * t.element_size() for t in tensors)


def test_monitor_copies_only_the_modules_it_checks():
    import copy
    from ampc._numerics.capture import capture
    from ampc._numerics.errors import loss_error, rel_error
    from ampc.autoprecision import _measure
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 512), nn.BatchNorm1d(512), nn.ReLU(), nn.Linear(512, 512),
                          nn.ReLU(), nn.Linear(512, 4))
    data = batches(3)
    plan = search(model, data[:2], candidates=("fp32", "bf16"), objective="memory",
                  max_slowdown=None, repeats=1)
    assert plan.choice("1") == "bf16" and plan.choice("5") == "bf16"
    monitor = plan.apply(model).monitor(every=1, sample=2)
    for p in model.parameters():
        p.grad = torch.full_like(p, 7.0)           # as if between backward and step
    hits = []
    model[3].weight.register_hook(lambda g: hits.append(g))   # as DDP hooks its parameters
    stats = (model[1].running_mean.clone(), model[1].num_batches_tracked.clone())
    checked = ["1", "5"]
    errors = monitor.measure(data[2], checked)

    # the copy: the model's buffers (batch norm's statistics) and the two modules checked
    whole = _tensor_bytes(list(model.parameters()) + list(model.buffers()))
    expected = _tensor_bytes(model.buffers()) + sum(
        _tensor_bytes(list(model[int(n)].parameters()) + list(model[int(n)].buffers()))
        for n in checked)
    print(f"\nmonitor check copies {monitor.copied_bytes} bytes of the model's {whole}")
    # buffers 2 x 512 fp32 + an int64 count; the norm's 2 x 512 weights and its buffers;
    # the last Linear's 512 x 4 + 4
    assert monitor.copied_bytes == expected == 4104 + (4096 + 4104) + 4 * (512 * 4 + 4)
    assert monitor.copied_bytes < 0.02 * whole
    # the model is untouched: gradients, statistics, its parameters' hooks
    assert all(bool((p.grad == 7.0).all()) for p in model.parameters())
    assert torch.equal(model[1].running_mean, stats[0])
    assert torch.equal(model[1].num_batches_tracked, stats[1])
    assert hits == []

    # the figures are those of a check on a whole copy of the model (as it was measured)
    shadow = copy.deepcopy(model)
    with torch.random.fork_rng(devices=[]):
        step = capture(shadow, data[2], nn.functional.cross_entropy, checked)
        for n in checked:
            m, rec = shadow.get_submodule(n), step.calls[n]
            y0, dx0, dw0, _ = _measure.run_at(m, "fp32", rec, "cpu", None, 1.0)
            y, dx, dw, _ = _measure.run_at(m, "bf16", rec, "cpu", None, 1.0)
            assert errors[n] == {"loss_err": loss_error(y, y0, rec.grad, step.loss),
                                 "dgrad_err": rel_error(dx, dx0), "wgrad_err": rel_error(dw, dw0)}
            assert errors[n]["dgrad_err"] > 0
