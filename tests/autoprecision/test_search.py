"""ampc.autoprecision.search on models with known answers; the Plan's table, JSON,
Python and apply; bad input."""
import json

import pytest
import torch
from torch import nn

import ampc
from ampc.autoprecision import Budget, Plan, search

from autoprecision_models import ANY, SENSITIVE, Known, target_batches

CANDS = ("fp32", "bf16", "fp16")


@pytest.fixture(scope="module")
def known():
    torch.manual_seed(0)
    model = Known()
    batches = target_batches(model, n=2)
    plan = search(model, batches, candidates=CANDS, objective="memory",
                  max_slowdown=None, repeats=1)
    return model, batches, plan


def keeps_sensitive_high(plan):
    """Every sensitive module at a precision that holds for it, every other one low."""
    c = plan.choices
    return (all(c[n] in ok for n, ok in SENSITIVE.items())
            and all(c[n] in ("bf16", "fp16") for n in ANY))


def test_known_answers(known):
    model, _, plan = known
    c = plan.choices
    assert list(c) == ["norm", "inp", "hot", "tiny", "mid", "head"]
    assert c["norm"] == "fp32"             # bf16 and fp16 cannot resolve x + 1000
    assert c["hot"] == "bf16"              # fp16 overflows (outputs ~2e5)
    assert c["tiny"] == "bf16"             # fp16 weight gradients underflow
    assert c["head"] == "fp16"             # bf16 logits move the loss past the budget
    assert keeps_sensitive_high(plan)
    units = {u.module: u for u in plan.units}
    hot16 = units["hot"].options["fp16"]
    assert hot16["overflow"] > 0 and hot16["loss_err"] == float("inf")
    tiny16 = units["tiny"].options["fp16"]
    assert tiny16["underflow"] > 0.5 and tiny16["wgrad_err"] == pytest.approx(1.0)
    # an ordinary Linear's errors at bf16 are those of bf16's rounding (2**-9 relative)
    inp = units["inp"].options["bf16"]
    assert 5e-4 < inp["wgrad_err"] < 2e-2 and 5e-4 < inp["dgrad_err"] < 2e-2
    assert units["head"].options["bf16"]["loss_err"] > plan.budget.loss \
        > units["head"].options["fp16"]["loss_err"]
    assert plan.data["measured"]["loss_err"] <= plan.budget.loss
    assert plan.data["measured"]["grad_err"] <= plan.budget.grad


def test_control_without_sensitivity_fails(known):
    model, batches, _ = known
    blind = search(model, batches, candidates=CANDS, objective="memory",
                   max_slowdown=None, repeats=1,
                   sensitivity=False, check=False)
    assert not keeps_sensitive_high(blind)
    assert blind.choices["norm"] != "fp32"


def test_only_two_candidates(known):
    model, batches, _ = known
    plan = search(model, batches, candidates=("fp32", "bf16"), objective="memory",
                  max_slowdown=None, repeats=1)
    assert plan.choices == {"norm": "fp32", "inp": "bf16", "hot": "bf16", "tiny": "bf16",
                            "mid": "bf16", "head": "fp32"}


def test_same_plan_twice_and_the_model_untouched(known):
    model, batches, plan = known
    before = {k: v.clone() for k, v in model.state_dict().items()}
    again = search(model, batches, candidates=CANDS, objective="memory",
                   max_slowdown=None, repeats=1)
    assert again == plan and again.choices == plan.choices
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert all(p.grad is None for p in model.parameters())
    assert not any(hasattr(m, "_ampc_scope") for m in model.modules())


def test_json_round_trip(known, tmp_path):
    model, _, plan = known
    modules = dict(model.named_modules())
    assert all(u.shapes == {n: list(p.shape) for n, p in modules[u.module].named_parameters()}
               for u in plan)                   # what apply checks a model against
    path = plan.save(tmp_path / "plan.json")
    back = Plan.load(path)
    assert back == plan and back.as_dict() == plan.as_dict()
    assert back.table() == plan.table()
    assert json.loads(plan.to_json())["units"][0]["module"] == "norm"
    with pytest.raises(ValueError, match="not a plan of version 1"):
        Plan({"version": 99})


def test_table_shows_choices_errors_times(known):
    _, _, plan = known
    text = plan.table(details=True)
    for word in ("module", "choice", "loss err", "dgrad err", "wgrad err", "ms fp32", "ms bf16",
                 "ms fp16", "why not lower", "predicted", "measured", "search took"):
        assert word in text, word
    line = next(l for l in text.splitlines() if l.strip().startswith("hot"))
    assert "fp16: loss error not finite" in line
    # by default: the time at the choice, and what was measured in a word or two
    text = plan.table()
    assert max(map(len, text.splitlines())) <= 120 and "ms fp16" not in text
    line = next(l for l in text.splitlines() if l.startswith("hot "))
    assert "fp16 out of range" in line, line


def test_python_rendering_runs_and_matches_apply(known):
    model, batches, plan = known
    code = plan.python()
    assert "ampc.policy.module_scope(model.norm, dtype=torch.float32" in code
    # fp16 in a bf16 region hands back fp32 (a promote op refuses a foreign 16-bit dtype)
    assert ("ampc.policy.module_scope(model.head, dtype=torch.float16, "
            "cast_outputs=torch.float32)") in code
    fresh, applied = Known(), Known()
    exec(code, {"model": fresh})
    plan.apply(applied)
    assert ampc.policy.module_scope_of(fresh.norm).dtype == torch.float32
    assert ampc.policy.module_scope_of(fresh.hot) is None        # bf16 by the bf16 region

    def scopes(m):
        return {n: s and (s.dtype, s.ops) for n, mod in m.named_modules()
                for s in [ampc.policy.module_scope_of(mod)]}
    assert scopes(fresh) == scopes(applied)     # the same scopes as apply attaches


def test_apply_reports_every_module_and_runs(known):
    model, batches, plan = known
    fresh = Known()
    fresh.load_state_dict(model.state_dict())
    applied = plan.apply(fresh)
    assert [(n, c) for n, _, c in applied.changes] == list(plan.choices.items())
    assert "6 modules set" in str(applied)
    seen = {}
    hooks = [getattr(fresh, n).register_forward_hook(
        lambda m, a, o, n=n: seen.__setitem__(n, o.dtype)) for n in ("norm", "hot", "head")]
    x, y = batches[0]
    with plan.autocast():
        out = fresh(x)
    for h in hooks:
        h.remove()
    # fp16 in the bf16 region: the head's result is handed back in fp32
    assert seen == {"norm": torch.float32, "hot": torch.bfloat16, "head": torch.float32}
    loss = nn.functional.cross_entropy(out.float(), y)
    scaler = plan.scaler()
    assert isinstance(scaler, ampc.GradScaler)
    scaler.scale(loss).backward()
    assert all(torch.isfinite(p.grad).all() for p in fresh.parameters())
    applied.remove()
    assert ampc.policy.module_scope_of(fresh.hot) is None


def test_apply_refuses_a_missing_module_before_changing_anything(known):
    _, _, plan = known
    other = nn.Sequential(nn.Linear(64, 64))
    other.norm = nn.LayerNorm(64)
    with pytest.raises(ValueError, match=r"Plan.apply: the plan names 5 module\(s\) the model "
                                         r"does not have: inp, hot, tiny, mid, head"):
        plan.apply(other)
    assert not any(hasattr(m, "_ampc_scope") for m in other.modules())
    wrong = Known()
    wrong.hot = nn.Conv1d(64, 64, 1)
    with pytest.raises(ValueError, match="module hot is a Conv1d, the plan was made for a Linear"):
        plan.apply(wrong)
    with pytest.raises(TypeError, match="model must be an nn.Module"):
        plan.apply("model")


def test_fp8_choice_applies_to_linear_only():
    torch.manual_seed(0)
    # the last Linear's 8 outputs are not a multiple of 16: fp8 is no candidate for it
    model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(),
                          nn.Linear(32, 8))
    batches = [(torch.randn(16, 32), torch.randint(0, 8, (16,))) for _ in range(2)]
    plan = search(model, batches, candidates=("fp32", "fp8"), objective="memory",
                  max_slowdown=None, repeats=1,
                  budget=Budget(loss=1.0, grad=1.0, wgrad=1.0))
    assert plan.choices == {"0": "fp8", "2": "fp8", "4": "fp32"}
    assert "fp8" not in plan.units[2].options
    assert "FP8_MODULES = {" in plan.python() and "fp8_filter" in plan.python()
    applied = plan.apply(model)
    assert isinstance(model[0], ampc.fp8.Linear)
    with plan.autocast():
        out = model(batches[0][0])
    assert torch.isfinite(out).all()
    applied.set("0", "bf16")              # raised: runs outside FP8 from now on
    assert plan.choices["0"] == "bf16"
    with plan.autocast():
        out = model(batches[0][0])
    assert torch.isfinite(out).all()


def test_time_objective_runs_and_notes_slow_candidates():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 10))
    batches = [(torch.randn(64, 64), torch.randint(0, 10, (64,))) for _ in range(2)]
    plan = search(model, batches, candidates=("fp32", "bf16", "fp16"), repeats=1)
    assert set(plan.choices.values()) <= {"fp32", "bf16", "fp16"}
    assert plan.data["objective"] == "time"
    for u in plan.units:
        assert u.options["fp32"]["ms"] > 0
    # a candidate not tried is said so, with the measured ratio
    tried = {c for u in plan.units for c in u.options}
    for c in {"bf16", "fp16"} - tried:
        assert any(n.startswith(f"{c} not tried: its 512x512 matmul takes") for n in
                   plan.data["notes"])


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(model="m"), TypeError, "search: model must be an nn.Module"),
    (dict(batches=[]), ValueError, "batches must be a non-empty list"),
    (dict(batches=(torch.randn(2, 4), torch.zeros(2))), TypeError, "got one pair"),
    (dict(candidates=("fp32", "int4")), ValueError, "candidates must be among fp32, bf16"),
    (dict(objective="speed"), ValueError, "objective must be one of time, memory"),
    (dict(budget=3), TypeError, "budget must be an ampc.autoprecision.Budget"),
    (dict(budget={"loss": -1}), ValueError, "Budget: loss must be a positive number"),
    (dict(fp8_recipe="mx"), ValueError, "fp8_recipe must be 'delayed' or 'current'"),
])
def test_bad_input(kwargs, error, match):
    args = dict(model=nn.Linear(4, 3), batches=[(torch.randn(2, 4), torch.zeros(2).long())])
    args.update(kwargs)
    with pytest.raises(error, match=match):
        search(args.pop("model"), args.pop("batches"), objective=args.pop("objective", "memory"),
               **args)


def test_fp64_model_and_no_units_refused():
    with pytest.raises(ValueError, match="parameter weight is torch.float64"):
        search(nn.Linear(4, 3).double(), [(torch.randn(2, 4), torch.zeros(2).long())])
    with pytest.raises(ValueError, match="has no module of the types it decides"):
        search(nn.Sequential(nn.ReLU()), [(torch.randn(2, 4), torch.zeros(2).long())])
