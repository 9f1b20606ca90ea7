"""The plan's table as a person reads it: at most 120 columns by default, every figure with
details=True, and for each candidate not taken what was measured against it."""
from ampc.autoprecision import Plan
from ampc.autoprecision._table import WIDTH, short

BASE = {"version": 1, "device": "cpu", "where": "torch CPU capability AVX2", "objective": "time",
        "budget": {"loss": 0.05, "grad": 0.25, "wgrad": 0.05, "noise_fraction": 0.5},
        "candidates": ["fp32", "bf16", "fp16", "fp8"], "fp8_recipe": "delayed",
        "loss_scale": 65536.0, "notes": [], "backoffs": []}


def _opts(fp32_ms, bf16_ms, err=1e-3):
    zero = {"loss_err": 0.0, "dgrad_err": 0.0, "wgrad_err": 0.0}
    return {"fp32": dict(zero, ms=fp32_ms, bytes=400),
            "bf16": dict(zero, loss_err=err, dgrad_err=err, wgrad_err=err, ms=bf16_ms, bytes=200)}


def _unit(name, choice, options, rejected=None, reason="solved"):
    return {"module": name, "type": "Linear", "kind": "gemm", "choice": choice,
            "options": options, "rejected": rejected or {}, "reason": reason}


def _row(plan, name):
    return next(l for l in plan.table().splitlines() if l.startswith(name + " "))


def test_reasons_say_what_was_measured():
    plan = Plan(dict(BASE, units=[
        _unit("slow", "fp32", _opts(1.0, 2.0)),                     # bf16 clearly slower
        _unit("summed", "fp32", _opts(1.0, 1.0)),                   # the solver raised it
        _unit("raised", "fp32", _opts(1.0, 0.5), reason="backed off"),
        _unit("hot", "bf16", dict(_opts(1.0, 0.5), fp16={"ms": 0.5, "bytes": 200}),
              {"fp16": "loss error not finite"}),
        _unit("tiny", "bf16", dict(_opts(1.0, 0.5), fp16={"ms": 0.5, "bytes": 200}),
              {"fp16": "wgrad err 1.0e+00 > 0.05"}),
        _unit("cut", "fp32", _opts(1.0, 3.0), {"bf16": "too slow here: 3.0x fp32's time"}),
        _unit("zero", "fp32", _opts(1.0, None),
              {"bf16": "not measured: its output gradient is all zero on every batch"}),
        _unit("odd", "fp32", _opts(1.0, None), {"bf16": "RuntimeError: no kernel"}),
    ]))
    assert _row(plan, "slow").endswith("bf16 slower")
    assert _row(plan, "summed").endswith("bf16 over budget")
    assert _row(plan, "raised").endswith("bf16 backed off")
    assert _row(plan, "hot").endswith("fp16 out of range")
    assert _row(plan, "tiny").endswith("fp16 over budget")
    assert _row(plan, "cut").endswith("bf16 slower")
    assert _row(plan, "zero").endswith("bf16 not measured")
    assert _row(plan, "odd").endswith("bf16 fails")
    assert "the cheapest within the summed budget" not in plan.table(details=True)
    # the memory objective ranks by bytes: an unrejected bf16 left behind was the summed budget
    memory = Plan(dict(BASE, objective="memory", units=[_unit("slow", "fp32", _opts(1.0, 2.0))]))
    assert _row(memory, "slow").endswith("bf16 over budget")
    assert short("saves 160 bytes, under 10% of the units' 2238504 at fp32") == "saves little"
    assert short("slower than the ceiling 1.25x: 3.3x the fastest (fp32 1.00 ms)") == "slower"


def test_at_most_120_columns_with_long_names_and_every_figure_on_request():
    long = "encoder.layers.encoder_layer_11.self_attention.out_proj_with_a_long_name"
    notes = ["a note long enough to need wrapping " * 8]
    plan = Plan(dict(BASE, notes=notes, units=[
        _unit(long, "fp32", dict(_opts(1.0, 2.0), fp16={"ms": 9.0, "bytes": 200}),
              {"fp16": "too slow here: 9.0x fp32's time", "bf16": "loss error not finite"})]))
    text = plan.table()
    assert max(map(len, text.splitlines())) <= WIDTH, text
    row = next(l for l in text.splitlines() if "out_proj" in l)
    assert "out_proj_with_a_long_name" in row                      # the name's end kept
    assert row.endswith("fp16 slower; bf16 out of range")
    wide = plan.table(details=True)
    assert max(map(len, wide.splitlines())) > WIDTH
    for word in (long, "ms fp16", "wgrad noise", "fp16: too slow here: 9.0x fp32's time",
                 "bf16: loss error not finite"):
        assert word in wide, word


def test_long_names_are_shortened_from_the_left_and_stay_apart():
    slow = {"bf16": "too slow here: 4.0x fp32's time", "fp16": "loss error not finite",
            "fp8": "RuntimeError: no kernel for this one here"}
    names = [f"{side}.block.{k}.layer.0.SelfAttention.q" for side in ("encoder", "decoder")
             for k in (0, 1)]
    plan = Plan(dict(BASE, units=[_unit(n, "fp32", _opts(1.0, 4.0), slow) for n in names]))
    rows = [l for l in plan.table().splitlines() if "SelfAttention.q" in l]
    shown = [r.split()[0] for r in rows]
    assert len(set(shown)) == 4, shown
    assert all(s.endswith("SelfAttention.q") and len(s) < len(n) for s, n in zip(shown, names))
    assert max(map(len, plan.table().splitlines())) <= WIDTH


def _measured(fp32_ms, plan_ms):
    return {"fp32_ms": fp32_ms, "plan_ms": plan_ms, "loss_err": 0.0, "grad_err": 0.0,
            "wgrad_err": 0.0, "wgrad_worst": None}


def test_the_search_cost_beside_what_it_saves():
    units = [_unit("a", "bf16", _opts(1.0, 0.5))]
    fast = Plan(dict(BASE, units=units, search_s=30.0, measured=_measured(10.0, 7.5)))
    # 30 s at 2.5 ms a step: 12,000 steps
    assert ("search took 30.0 s, repaid after 12,000 steps at the 2.50 ms a step it saves "
            "against fp32 (measured)") in " ".join(fast.table().split())
    slow = Plan(dict(BASE, units=units, search_s=30.0, measured=_measured(10.0, 11.0)))
    assert "the plan saves no time a step against fp32" in " ".join(slow.table().split())
    fp32 = Plan(dict(BASE, units=[_unit("a", "fp32", _opts(1.0, 0.5))], search_s=4.0,
                     measured=_measured(10.0, 10.0)))
    text = " ".join(fp32.table().split())
    assert "search took 4.0 s" in text and "repaid" not in text
