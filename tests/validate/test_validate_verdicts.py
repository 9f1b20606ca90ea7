"""ampc.validate's verdicts: a fp32 spread too wide to judge by is said so (a warning and
the verdict), and the layer table shows every module its suggestions name."""
import re
import warnings

import pytest
import torch
from torch import nn

from ampc import validate
from ampc.validate._run import Run
from ampc.validate._report import MAX_SPREAD, Comparison, LayerReport


def run(name, losses, kind="ampc"):
    r = Run(name, kind, "bf16", 0)
    r.losses = list(losses)
    r.grad_norms = [1.0] * len(losses)
    r.scales = [1.0] * len(losses)
    r.step_ms = [1.0] * len(losses)
    return r


def comparison(spread_level, setup_level, steps=20):
    base = run("fp32", [1.0] * steps, "fp32")
    other = run("fp32 seed 1", [spread_level] * steps, "fp32")
    setup = run("ampc bf16", [setup_level] * steps)
    return Comparison(base, [setup], [other], {"seeds": [0, 1]})


def test_a_wide_spread_warns_and_judges_nothing():
    with pytest.warns(UserWarning, match=r"spread is 20.0%, over the 5% within which"):
        report = comparison(1.2, 1.15)          # 20% spread; a 15% gap would pass it
    assert report.too_wide and report.rows[0]["within_spread"] is None
    text = report.table()
    assert "spread too wide" in text and "too wide to judge a setup by" in text
    assert not report.ok()                      # held to MAX_SPREAD instead: 15% > 5%
    assert report.as_dict()["spread_too_wide"] is True


def test_a_narrow_spread_judges_as_before():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        report = comparison(1.01, 1.005)
    assert not report.too_wide and report.rows[0]["within_spread"] is True
    assert "yes" in report.table() and "too wide" not in report.table()
    assert report.ok()
    assert comparison(1.01, 1.04).rows[0]["within_spread"] is False


def test_one_seed_just_past_the_spread_is_unsure_not_outside():
    # one seed's gap against one fp32 pair's difference: 2x the spread is what a sound
    # setup gives half the time; 4x is outside
    with warnings.catch_warnings():
        warnings.simplefilter("error")              # not the "spread too wide" warning
        report = comparison(1.01, 1.02)
    (row,) = report.rows
    assert row["within_spread"] is None and row["undecided"] == "one seed"
    assert not report.too_wide and report.ok()
    text = report.table()
    assert "unsure: 1 seed" in text and "paired=True" in text and "too wide" not in text
    assert comparison(1.01, 1.04).rows[0]["undecided"] is None
    assert "unsure" not in comparison(1.01, 1.005).table()


def test_threshold_is_five_percent():
    assert MAX_SPREAD == 0.05
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not comparison(1.049, 1.0).too_wide
    with pytest.warns(UserWarning):
        assert comparison(1.051, 1.0).too_wide


def test_layer_table_shows_every_module_a_suggestion_names():
    rows = [{"module": f"m{i}", "type": "Linear", "leaf": True, "output_err": 1.0 / (i + 1),
             "added_err": 1e-3, "grad_err": 1e-3, "underflow": None, "overflow": None}
            for i in range(20)]
    line = "ampc.policy.module_scope(model.m17, dtype=torch.float32)"
    report = LayerReport(rows, [line], {"dtype": "bf16", "loss_scale": 1.0}, ["m17"])
    text = report.table(top=5)
    shown = [l.split("|")[0].strip() for l in text.splitlines()[3:]]
    assert shown[:6] == ["m0", "m1", "m2", "m3", "m4", "m17"]
    assert "(top 5, and 1 more a suggestion names)" in text and line in text
    assert "m16" not in shown


def test_layers_report_names_only_modules_its_table_shows():
    from validate.test_validate import cancel_model      # 2.bad loses precision in bf16
    model = cancel_model()
    batch = (torch.randn(32, 8), torch.randint(0, 4, (32,)))
    report = validate.layers(model, batch)
    assert report.suggested == ["2.bad"]
    assert report.rows[0]["module"] != "2.bad"     # not the top row: shown because named
    text = report.table(top=1)
    assert any(l.lstrip().startswith("2.bad |") for l in text.splitlines())


def test_grad_norm_ratio_median_reads_inside_its_range():
    base = run("fp32", [1.0] * 3, "fp32")
    setup = run("ampc bf16", [1.0] * 3)
    setup.grad_norms = [0.996, 0.999, 0.9999]   # to 2 places, min and max would read 1.00
    text = Comparison(base, [setup], [], {"seeds": [0]}).table()
    row = next(line for line in text.splitlines() if line.startswith("ampc bf16"))
    median, low, high = (float(v) for v in
                         re.search(r"(\d\.\d+) \((\d\.\d+)-(\d\.\d+)\)", row).groups())
    assert low <= median <= high and (median, low, high) == (0.999, 0.996, 1.0)


def test_an_interval_over_diverged_runs_is_not_finite_not_a_crash():
    """Paired gaps from runs that diverged (inf, nan) give a non-finite mean and width (the
    verdict reads them as outside), where statistics.stdev raised AttributeError."""
    import math
    from ampc.validate._run import mean_interval
    assert mean_interval([math.inf, math.inf]) == (math.inf, math.inf)
    assert mean_interval([0.01, math.inf])[1] == math.inf
    m, w = mean_interval([math.nan, 0.01])
    assert math.isnan(m) and math.isnan(w)
    m, w = mean_interval([0.01, 0.03])
    assert m == 0.02 and 0 < w < math.inf
