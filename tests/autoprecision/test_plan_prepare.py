"""One plan for the whole step: plan.prepare makes the model and the optimizer as the plan
says (the state, freed gradients, each module's precision and saved activations, blocks
recomputed, the head sliced); a checkpoint of them resumes bit for bit; a plan read back
from its file prepares the same."""
import copy

import pytest
import torch
from torch import nn

import ampc
from ampc.autoprecision import Plan, search
from autoprecision_models import Block, train_plan as _train


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), Block(), Block(), nn.Linear(64, 1024))


def _batches(n=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(256, 32, generator=g), torch.randint(0, 1024, (256,), generator=g))
            for _ in range(n)]


@pytest.fixture(scope="module")
def plan():
    """A budget no plan meets: every whole-step move taken."""
    with pytest.warns(UserWarning, match="NOT met"):
        return search(_model(), _batches(), candidates=("fp32", "bf16", "bf16+8b"),
                      objective="memory", peak_bytes=1, repeats=1)


def test_a_byte_budgets_forms_hold_only_measured_choices(monkeypatch):
    """Under a byte budget the plan's forms of higher precision are raced; "every module in
    fp32" keeps each module's saved-tensor code, so with fp32+8b not among the candidates it
    has no measured figures and is not raced. Here every form wins its race: the plan must
    still hold only choices it measured (it once took fp32+8b unmeasured and the search
    stopped with a KeyError)."""
    import ampc.autoprecision._search as search_mod
    import ampc.autoprecision._whole as whole
    import ampc.autoprecision._peak as peak
    # bf16 tried on every CPU (where its matmul is slow, as under AVX2, the probe would rule
    # it and bf16+8b out of the matmul units before anything is measured), and one unit of
    # the fitted plan at bf16+8b, measured, where the lowering picked none (what it picks
    # depends on the CPU's times)
    monkeypatch.setattr(search_mod, "probe", lambda candidates, device: {})
    fit = peak.fit

    def fit_coded(plan, *args):
        fit(plan, *args)
        if not any(u.choice == "bf16+8b" for u in plan.units):
            u = next(u for u in plan.units if "ms" in u.options.get("bf16+8b", {}))
            plan.set_choice(u.module, "bf16+8b", u.reason)
    monkeypatch.setattr(peak, "fit", fit_coded)
    monkeypatch.setattr(whole, "clearly_faster", lambda a, b: True)
    monkeypatch.setattr(whole.Check, "race",
                        lambda self, entrants: {n: float(-k) for k, n in enumerate(entrants)})
    with pytest.warns(UserWarning, match="NOT met"):
        got = search(_model(), _batches(), candidates=("fp32", "bf16", "bf16+8b"),
                     objective="memory", peak_bytes=1, repeats=1)
    assert any(u.choice == "bf16+8b" for u in got)
    for u in got.every_unit:
        assert u.choice in u.options and "ms" in u.figures(), (u.module, u.choice)


def test_prepare_makes_what_the_plan_chose(plan):
    assert plan.step.state == "lean" and plan.step.sliced_head
    model, opt = plan.prepare(_model(), ampc.optim.AdamW, lr=1e-3)
    assert isinstance(opt, ampc.optim.AdamW)
    assert opt.step_in_backward == plan.step.grads_freed
    assert all(g["moments"] == "8bit" and g["stochastic_rounding"] for g in opt.param_groups)
    assert model[0].weight.dtype == torch.bfloat16
    assert ampc.memory.sliced_heads(model) == list(plan.step.sliced_head)
    assert ampc.memory.recomputed(model) == list(plan.step.recompute)
    coded = {u.module for u in plan if u.choice.endswith("+8b")}
    assert set(ampc.memory.compressed(model)) == coded
    losses = _train(plan, model, opt, _batches(6, seed=1))
    assert all(l == l for l in losses) and losses[-1] < losses[0]


def test_the_plan_file_prepares_the_same_and_trains_the_same(plan, tmp_path):
    again = Plan.load(plan.save(str(tmp_path / "plan.json")))
    assert again.step == plan.step and again.peak == plan.peak
    runs = []
    for p in (plan, again):
        model, opt = p.prepare(_model(), ampc.optim.AdamW, lr=1e-3)
        runs.append(_train(p, model, opt, _batches(3, seed=2)))
    assert runs[0] == runs[1]


def test_a_checkpoint_of_the_prepared_model_and_optimizer_resumes_bit_for_bit(plan):
    batches = _batches(6, seed=3)
    model, opt = plan.prepare(_model(), ampc.optim.AdamW, lr=1e-3)
    _train(plan, model, opt, batches[:3])
    ckpt = copy.deepcopy({"model": model.state_dict(), "opt": opt.state_dict()})
    rng = torch.get_rng_state()
    straight = _train(plan, model, opt, batches[3:])
    # a fresh process's view: the plan prepares a new model, the checkpoint is loaded
    fresh, fresh_opt = plan.prepare(_model(), ampc.optim.AdamW, lr=1e-3)
    fresh.load_state_dict(ckpt["model"])
    fresh_opt.load_state_dict(ckpt["opt"])
    torch.set_rng_state(rng)        # the stochastic rounding's draws follow torch's generator
    resumed = _train(plan, fresh, fresh_opt, batches[3:])
    assert resumed == straight
    for a, b in zip(model.parameters(), fresh.parameters()):
        assert torch.equal(a, b)


def test_the_memory_objective_without_a_budget_takes_the_free_moves():
    plan = search(_model(), _batches(), candidates=("fp32", "bf16", "bf16+8b"),
                  objective="memory", repeats=1)
    assert plan.peak is not None and plan.peak.budget is None
    # the module choices may stay fp32 where 16-bit compute is slow; the whole-step moves
    # lower the peak whatever they are
    # (the fastest plan's own peak may be over fp32's: a loss unit chosen bf16, which the
    # ceiling allows where the timing is noisy, keeps a bf16 copy of the logits)
    assert plan.peak.bytes < min(plan.peak.fastest, plan.peak.fp32)
    assert plan.peak.by_kind["grads"] == 0
    assert plan.step.state == "lean"
    assert set(plan.step.why) >= {"grads freed", "state"}
    assert "step peak" in plan.table()


def test_a_step_record_refuses_bad_fields_by_name(plan):
    d = plan.as_dict()
    for key, bad, match in (("state", "tiny", "state must be one of"),
                            ("grads_freed", "yes", "grads_freed must be True or False"),
                            ("recompute", "1", "recompute must be a list"),
                            ("peak", {"bytes": 1}, "peak must hold")):
        with pytest.raises(ValueError, match=f"ampc.autoprecision.Plan: {match}"):
            Plan(dict(d, **{key: bad}))


def test_a_plan_saved_before_the_step_was_recorded_loads_as_fp32(plan):
    d = plan.as_dict()
    for key in ("state", "grads_freed", "step_why"):
        d.pop(key)
    d["peak"] = dict(d["peak"], grads_freed=True)
    old = Plan(d)
    assert old.step.state == "fp32" and old.step.grads_freed is True


def test_prepare_refuses_what_it_cannot_make_before_anything_changes(plan):
    model = _model().to(torch.bfloat16)
    with pytest.raises(ValueError, match="Plan.prepare: parameter 0.weight is torch.bfloat16"):
        plan.prepare(model, ampc.optim.AdamW)
    model = _model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match="moments is the plan's choice"):
        plan.prepare(model, ampc.optim.AdamW, moments="fp32")
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert not ampc.memory.recomputed(model) and not ampc.memory.sliced_heads(model)


@pytest.mark.parametrize("state", ["fp32", "master", "lean", "kahan8"])
@pytest.mark.parametrize("grads_freed", [False, True])
def test_an_optimizer_made_already_trains_as_the_one_prepare_makes(plan, state, grads_freed):
    # a framework makes the optimizer from the user's code; the plan then sets its layout
    p = copy.deepcopy(plan)
    p.set_step(state=state, grads_freed=grads_freed)
    runs = []
    for made in (False, True):
        model = _model()
        given = ampc.optim.AdamW(model.parameters(), lr=1e-3) if made else ampc.optim.AdamW
        model, opt = p.prepare(model, given, **({} if made else {"lr": 1e-3}))
        assert opt.step_in_backward == grads_freed
        runs.append(_train(p, model, opt, _batches(3, seed=2)) + [
            [t.clone() for t in model.parameters()]])
    assert runs[0][:-1] == runs[1][:-1]
    assert all(torch.equal(a, b) for a, b in zip(runs[0][-1], runs[1][-1]))


def test_an_optimizer_made_already_is_refused_when_it_cannot_take_the_plan(plan):
    model = _model()
    opt = ampc.optim.AdamW(model.parameters(), lr=1e-3, moments="bf16")
    with pytest.raises(ValueError, match=r"AdamW.relayout: param group 0 has moments='bf16', "
                                         r"the layout asks '8bit'"):
        plan.prepare(model, opt)
    assert model[0].weight.dtype == torch.float32 and not opt.step_in_backward
    with pytest.raises(TypeError, match=r"an optimizer already made takes no arguments; got lr"):
        plan.prepare(model, ampc.optim.AdamW(model.parameters()), lr=1e-3)
    opt = ampc.optim.AdamW(model.parameters())
    model(torch.randn(2, 32)).sum().backward()
    opt.step()
    with pytest.raises(ValueError, match=r"AdamW.relayout: the optimizer has state already"):
        plan.prepare(model, opt)


def test_a_plan_of_fp32_modules_computes_in_fp32_on_the_states_bf16_weights():
    """The lean state keeps the weights in bf16; a plan whose modules all chose fp32 runs
    them in fp32 all the same (the region casts up), not in the weights' bf16."""
    with pytest.warns(UserWarning, match="NOT met"):
        plan = search(_model(), _batches(), candidates=("fp32",), objective="memory",
                      peak_bytes=1, repeats=1)
    assert plan.dtype == "fp32" and plan.step.state == "lean"
    model, opt = plan.prepare(_model(), ampc.optim.AdamW, lr=1e-3)
    assert model[0].weight.dtype == torch.bfloat16
    out_dtypes = []
    for m in model.modules():
        if type(m) is nn.Linear and m is not model[-1]:     # the head is sliced in the loss
            m.register_forward_hook(lambda mod, args, out: out_dtypes.append(out.dtype))
    # the reference: fp32 computing on the same weights (bf16 values, held in fp32)
    ref = _model()
    held = dict(model.named_parameters())
    with torch.no_grad():
        for n, p in ref.named_parameters():
            p.copy_(held[n].float())
    x, y = _batches(1, seed=3)[0]
    with plan.autocast():
        out = model(x)
    loss = plan.loss(torch.nn.functional.cross_entropy)(out, y)
    want = torch.nn.functional.cross_entropy(ref(x), y)
    assert out_dtypes and set(out_dtypes) == {torch.float32}
    assert abs(loss.item() - want.item()) <= 1e-5 * abs(want.item())
    assert "torch.bfloat16), ampc.policy.scope(dtype=torch.float32)" in plan.python()


def test_validate_shows_no_grad_norm_for_a_plan_that_frees_the_gradients(plan):
    """The gradients are gone after the backward: validate says so ("-"), not a zero norm."""
    freed = copy.deepcopy(plan)
    freed.set_step(grads_freed=True, micro_batches=1)
    report = ampc.validate.compare(_model, lambda k: _batches(1, seed=k)[0], steps=3, lr=1e-3,
                                   setups=(freed,), seeds=(0,), device="cpu", progress=False,
                                   paired=False)
    run = report.runs[0]
    assert all(n != n for n in run.grad_norms)                  # NaN: nothing to read
    assert all(n > 0 for n in report.base.grad_norms)           # fp32 keeps its gradients
    row = report.rows[0]
    assert row["grad_norm_ratio_median"] is None
    line = next(l for l in report.table().splitlines() if l.strip().startswith(row["setup"]))
    assert "0.000" not in line and " - " in line
