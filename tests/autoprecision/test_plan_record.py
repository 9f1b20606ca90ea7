"""The Plan as a record: frozen units kept by name, one way to change a choice, the saved
format of version 1 (plans saved before the typed records still load)."""
import dataclasses
import json

import pytest
import torch
from torch import nn

from ampc.autoprecision import Plan
from ampc.autoprecision._plan import Reason, Unit

# a plan as search() saved it before units carried a reason or "too_slow"
OLD = {"version": 1, "device": "cpu", "where": "torch CPU capability AVX2", "objective": "time",
       "budget": {"loss": 0.05, "grad": 0.25, "wgrad": 0.05}, "candidates": ["fp32", "bf16", "fp16"],
       "fp8_recipe": "delayed", "loss_scale": 65536.0, "notes": [], "backoffs": [],
       "units": [{"module": "0", "type": "Linear", "kind": "gemm", "choice": "bf16",
                  "options": {"fp32": {"loss_err": 0.0, "ms": 0.1, "bytes": 400},
                              "bf16": {"loss_err": 0.01, "ms": 0.05, "bytes": 200},
                              "fp16": {"error": "too slow here: 9x fp32's time", "ms": None,
                                       "bytes": 200}},
                  "rejected": {"fp16": "too slow here: 9x fp32's time"}},
                 {"module": "1", "type": "LayerNorm", "kind": "norm", "choice": "fp32",
                  "options": {"fp32": {"ms": 0.02, "bytes": 80}}, "rejected": {}}]}


def test_old_saved_plan_loads_and_round_trips(tmp_path):
    path = tmp_path / "old.json"
    path.write_text(json.dumps(OLD))
    plan = Plan.load(str(path))
    assert plan.choices == {"0": "bf16", "1": "fp32"} and plan.dtype == "bf16"
    assert plan.unit("0").reason is Reason.SOLVED and plan.unit("1").kind == "norm"
    again = Plan.from_json(plan.to_json())
    assert again == plan and again.as_dict()["units"][0]["reason"] == "solved"
    # what it held comes back as it was; the whole step, saved before it was chosen, is
    # written out at what such a plan did: fp32 state, every gradient kept, nothing recomputed,
    # the batch whole
    saved = {k: v for k, v in again.as_dict().items() if k != "units"}
    assert {k: v for k, v in saved.items() if k in OLD} == \
        {k: v for k, v in OLD.items() if k != "units"}
    assert {k: v for k, v in saved.items() if k not in OLD} == {
        "state": "fp32", "grads_freed": False, "recompute": [], "sliced_head": [],
        "step_why": {}, "micro_batches": 1}
    assert "fp16: too slow here" in plan.table(details=True)
    assert next(l for l in plan.table().splitlines() if l.startswith("0 ")).endswith("fp16 slower")
    # saved before the noise yardstick: judged, and read back, by the fixed figures alone
    assert plan.budget.noise_fraction == 0 and "within 0 of fp32's" in plan.table()
    with pytest.raises(ValueError, match="version 1"):
        Plan(dict(OLD, version=2))


def test_units_are_frozen_and_change_only_through_set_choice():
    plan = Plan(OLD)
    u = plan.unit("0")
    with pytest.raises(dataclasses.FrozenInstanceError):
        u.choice = "fp32"
    new = plan.set_choice("0", "fp32", Reason.BACKED_OFF)
    assert u.choice == "bf16"                    # the old record is untouched
    assert new is plan.unit("0") and new.choice == "fp32" and new.reason is Reason.BACKED_OFF
    assert plan.dtype == "fp32" and not plan.needs_scaler()   # the counts followed
    plan.set_choice("1", "fp16")
    assert plan.dtype == "fp16" and plan.needs_scaler() and plan.unit("1").reason is Reason.SET
    with pytest.raises(ValueError, match="choice must be one of"):
        plan.set_choice("1", "int8")
    with pytest.raises(KeyError):
        plan.set_choice("nope", "fp32")


def test_lookup_by_name_does_not_walk_the_units():
    units = [dict(OLD["units"][0], module=str(k)) for k in range(2000)]
    plan = Plan(dict(OLD, units=units))

    class Counting(dict):
        """The plan's index; iterating it would mean a walk over every unit."""
        walks = 0

        def __iter__(self):
            Counting.walks += 1
            return super().__iter__()

        def values(self):
            Counting.walks += 1
            return super().values()
    plan._units = Counting(plan._units)
    for k in range(0, 2000, 7):
        assert plan.unit(str(k)).module == str(k) and plan.choice(str(k)) == "bf16"
        plan.set_choice(str(k), "fp32")
        assert str(k) in plan and plan.dtype == "bf16"
    assert Counting.walks == 0


def test_apply_sets_every_unit_and_applied_set_changes_the_record():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8))
    plan = Plan(dict(OLD, units=[dict(OLD["units"][0]), dict(OLD["units"][1])]))
    applied = plan.apply(model)
    assert applied.changes == [("0", "Linear", "bf16"), ("1", "LayerNorm", "fp32")]
    applied.set("0", "fp32")
    assert plan.choice("0") == "fp32" and applied.changes[-1] == ("0", "Linear", "fp32")  # last set, last
    applied.remove()
    wrong = nn.Sequential(nn.Conv1d(8, 8, 1), nn.LayerNorm(8))
    with pytest.raises(ValueError, match="made for a Linear"):
        plan.apply(wrong)
    assert isinstance(Unit.from_dict(OLD["units"][1]), Unit)


def test_units_read_by_saved_keys_but_never_written():
    u = Plan(OLD).unit("0")
    assert u["choice"] == "bf16" and u["module"] == "0" and u["reason"] == "solved"
    assert u["rejected"] == {"fp16": "too slow here: 9x fp32's time"}
    with pytest.raises(KeyError):
        u["nope"]
    with pytest.raises(TypeError):
        u["choice"] = "fp32"


def _state(model):
    """Everything apply could change on a model: each module's class, hooks, scope,
    buffers and parameters."""
    return [(n, type(m), dict(m._forward_pre_hooks), dict(m._forward_hooks),
             getattr(m, "_ampc_scope", None), sorted(b for b, _ in m.named_buffers(recurse=False)),
             {p: t.detach().clone() for p, t in m.named_parameters(recurse=False)})
            for n, m in model.named_modules()]


def _same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x[:6] == y[:6]
        assert x[6].keys() == y[6].keys() and all(torch.equal(x[6][k], y[6][k]) for k in x[6])


def _unit(module, typ, choice, shapes=None):
    d = {"module": module, "type": typ, "kind": "gemm", "choice": choice,
         "options": {"fp32": {"ms": 0.1, "bytes": 4}}, "rejected": {}}
    if shapes is not None:
        d["shapes"] = shapes
    return d


@pytest.mark.parametrize("units, match", [
    # the last unit is the bad one: nothing before it may have been placed
    ([_unit("0", "Linear", "fp8"), _unit("1", "Linear", "bf16"), _unit("9", "Linear", "bf16")],
     "does not have: 9"),
    ([_unit("0", "Linear", "fp8"), _unit("1", "Linear", "bf16"), _unit("2", "Conv1d", "bf16")],
     "made for a Conv1d"),
    ([_unit("0", "Linear", "fp8"), _unit("1", "Linear", "bf16"),
      _unit("2", "Linear", "bf16", {"weight": [16, 32], "bias": [16]})], "made for"),
])
def test_apply_refuses_before_changing_anything(units, match):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 16))
    before = _state(model)
    with pytest.raises(ValueError, match=match):
        Plan(dict(OLD, units=units)).apply(model)
    _same(_state(model), before)


def test_apply_failing_midway_puts_the_model_back(monkeypatch):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16), nn.LayerNorm(16))
    plan = Plan(dict(OLD, units=[_unit("0", "Linear", "fp8"), _unit("1", "Linear", "bf16"),
                                 dict(_unit("2", "LayerNorm", "bf16"), kind="norm")]))
    before = _state(model)
    scope = __import__("ampc").policy.module_scope
    calls = []

    def failing(module, **kw):
        calls.append(module)
        if len(calls) == 2:            # the norm: the fp8 Linear is placed by then
            raise RuntimeError("no scope here")
        return scope(module, **kw)
    monkeypatch.setattr("ampc.policy.module_scope", failing)
    with pytest.raises(RuntimeError, match="no scope here"):
        plan.apply(model)
    assert len(calls) == 2
    _same(_state(model), before)
    assert type(model[0]) is nn.Linear and not hasattr(model[0], "fp8_fwd_scale")


def test_apply_checks_parameter_shapes_recorded_by_the_plan():
    shapes = {"weight": [8, 8], "bias": [8]}
    plan = Plan(dict(OLD, units=[_unit("0", "Linear", "bf16", shapes)]))
    assert plan.unit("0").shapes == shapes and Plan.from_json(plan.to_json()) == plan
    assert plan.as_dict()["units"][0]["shapes"] == shapes
    plan.apply(nn.Sequential(nn.Linear(8, 8))).remove()
    other = nn.Sequential(nn.Linear(4, 8))       # same name and type, other shape
    before = _state(other)
    with pytest.raises(ValueError, match=r"module 0 has parameters .*\[8, 4\].*made for"):
        plan.apply(other)
    _same(_state(other), before)
    # a plan saved before shapes were recorded still loads, and skips the check
    old = Plan(dict(OLD, units=[_unit("0", "Linear", "bf16")]))
    assert old.unit("0").shapes is None and "shapes" not in old.as_dict()["units"][0]
    old.apply(other).remove()


@pytest.mark.parametrize("change, match", [
    (lambda d: d.pop("units"), "units must be a list"),
    (lambda d: d["units"][0].pop("module"), r"units\[0\].module must be a string"),
    (lambda d: d["units"][1].pop("choice"), r"units\[1\].choice must be a string"),
    (lambda d: d["units"][0].update(choice="int8"), r"units\[0\] \('0'\).choice must be one of"),
    (lambda d: d["units"][0].update(reason="luck"), r"units\[0\] \('0'\).reason must be one of"),
    (lambda d: d["units"][0].update(options=[]), r"units\[0\] \('0'\).options must be a dict"),
    (lambda d: d["units"][0].update(shapes={"weight": "8x8"}), r"shapes must map"),
    (lambda d: d["units"].append(dict(d["units"][0])), "module '0' appears twice"),
    (lambda d: d["units"].append("0"), r"units\[2\] must be a dict"),
    (lambda d: d.update(device="tpu"), "device must be one of cpu, cuda, got 'tpu'"),
    (lambda d: d.pop("device"), "device must be one of"),
    (lambda d: d.update(objective="speed"), "objective must be one of"),
    (lambda d: d.update(candidates=["fp32", "int4"]), "candidates must be a list"),
    (lambda d: d["budget"].update(loss=-1), "budget .* is not a budget"),
    (lambda d: d["budget"].update(speed=1), "budget .* is not a budget"),
    (lambda d: d["budget"].pop("wgrad"), "budget lacks wgrad"),
])
def test_load_names_the_bad_field(tmp_path, change, match):
    d = json.loads(json.dumps(OLD))
    change(d)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(d))
    with pytest.raises(ValueError, match=match):
        Plan.load(str(path))


def _timed(units):
    return dict(OLD, units=units, predicted={"fp32_ms": 2.0, "plan_ms": 2.0},
                measured={"fp32_ms": 3.0, "plan_ms": 4.33, "loss_err": 0.0, "grad_err": 0.0,
                          "wgrad_err": 0.0, "wgrad_worst": None})


def test_an_all_fp32_plan_saves_nothing_and_pastes_as_nothing():
    units = [dict(u, choice="fp32") for u in OLD["units"]]
    plan = Plan(_timed(units))
    text = plan.table()
    assert "saving" not in text and "-1.33" not in text
    assert text.count("every module runs fp32: nothing saved") == 2
    code = plan.python()
    assert "module_scope" not in code and "nullcontext" not in code and "autocast" not in code
    model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8))
    before = _state(model)
    exec(code, {"model": model})                # runs, and sets nothing
    _same(_state(model), before)
    # a mixed plan measured slower says so, in words
    mixed = Plan(_timed([dict(u) for u in OLD["units"]]))
    assert "1.33 ms slower per step" in mixed.table() and "saving 0.00 ms" in mixed.table()


def test_python_of_a_mixed_plan_runs_and_sets_what_apply_sets():
    plan = Plan(dict(OLD, units=[_unit("0", "Linear", "bf16"), _unit("1", "Linear", "fp32"),
                                 dict(_unit("2", "LayerNorm", "bf16"), kind="norm")]))
    code = plan.python()
    assert code.count("module_scope") == 2      # the bf16 Linear has its dtype from the region
    pasted, applied = (nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8), nn.LayerNorm(8))
                       for _ in range(2))
    exec(code, {"model": pasted})
    plan.apply(applied)
    scope_of = __import__("ampc").policy.module_scope_of
    for a, b in zip(pasted, applied):
        sa, sb = scope_of(a), scope_of(b)
        assert (sa is None) == (sb is None) and (sa is None or (sa.dtype, sa.ops) == (sb.dtype, sb.ops))


def test_plan_saved_with_the_untyped_step_loads_typed():
    # before plan.step and plan.peak: recompute and sliced_head lists, the peak a dict that
    # also held grads_freed
    old = dict(OLD, recompute=["1"], sliced_head=["0"],
               peak={"budget": 1000, "fp32": 3000, "fastest": 2500, "bytes": 900, "met": True,
                     "rounds": 2, "grads_freed": True})
    plan = Plan(old)
    assert plan.step.recompute == ("1",) and plan.step.sliced_head == ("0",)
    assert plan.step.grads_freed is True and plan.step.state == "fp32"
    assert plan.peak.bytes == 900 and plan.peak.met is True and plan.peak.rounds == 2
    again = Plan.from_json(plan.to_json())
    assert again.step == plan.step and again.peak == plan.peak
