"""plan.verify (validate.compare) with a Monitor on the plan's runs: each run watched on its
own copy of the plan, the monitor's record on the run, a line under the table, and the
plan handed in left as it was."""
import pytest
import torch
from torch import nn

from ampc.autoprecision import search
from ampc.validate import compare

BLOWUP = 12     # from this step on the inputs are 1e6 times larger: past fp16's range


def make_model():
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.Tanh(),
                         nn.Linear(32, 4))


def make_batch(step):
    g = torch.Generator().manual_seed(step)
    x = torch.randn(16, 16, generator=g) * (1e6 if BLOWUP <= step < 1000 else 1.0)
    return x, torch.randint(0, 4, (16,), generator=g)


@pytest.fixture(scope="module")
def fp16_plan():
    torch.manual_seed(0)
    plan = search(make_model(), [make_batch(1000), make_batch(1001)], candidates=("fp32", "fp16"),
                  objective="memory", max_slowdown=None, loss_unit=False, check=False)
    assert "fp16" in plan.choices.values(), plan.table()
    return plan


def test_the_monitor_raises_a_module_in_each_watched_run(fp16_plan):
    before = dict(fp16_plan.choices)
    report = fp16_plan.verify(make_model, make_batch, 20, seeds=(0, 1), progress=False,
                              monitor=dict(every=1, sample=3))
    watched = [r for r in report.runs + [r for p in report.paired_runs for r in p]
               if r.monitor is not None]
    assert len(watched) == 2                       # the plan's run from each seed
    for run in watched:
        raised = run.monitor["decisions"]
        assert raised and all(d["step"] > BLOWUP and d["to"] == "fp32" for d in raised), raised
    assert fp16_plan.choices == before             # each run raised its own copy
    lines = [t for t in report.table().splitlines() if t.startswith("monitor on")]
    assert len(lines) == 2 and all("fp16 -> fp32" in t for t in lines), lines
    assert all(r.monitor is None for r in report.spread_runs + [report.base])


def test_without_a_monitor_nothing_is_watched(fp16_plan):
    report = fp16_plan.verify(make_model, make_batch, 4, seeds=(0,), progress=False)
    assert all(r.monitor is None for r in report.runs)
    assert "monitor on" not in report.table()


def test_a_monitor_that_is_not_a_dict_is_refused():
    with pytest.raises(TypeError, match="ampc.validate.compare: monitor must be a dict"):
        compare(make_model, make_batch, steps=2, monitor=3, progress=False)
