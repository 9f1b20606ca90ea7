"""The memory objective's byte budget for a step's peak (search's ``peak_bytes``): the fastest
plan is lowered, module by module, until the step measures under the budget; the figures are
the step's as ampc.memory.report measures it, and a budget that cannot be met is said."""
import copy
import types
import warnings

import pytest
import torch
from torch import nn

import ampc.memory
from ampc.autoprecision import Plan, search
from ampc.autoprecision._step_peak import _Under
from ampc.autoprecision._step import Step
from ampc.autoprecision._units import Reason
from autoprecision_models import Block, train_plan

CANDIDATES = ("fp32", "bf16", "fp32+8b", "bf16+8b")


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), Block(), Block(), Block(), nn.Linear(64, 10))


def _batches(n=2):
    # activations (512 rows x 256 wide) well above the weights: what a budget can move
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(512, 32, generator=g), torch.randint(0, 10, (512,), generator=g))
            for _ in range(n)]


def _search(peak_bytes, **kw):
    return search(_model(), _batches(), candidates=CANDIDATES, objective="memory",
                  peak_bytes=peak_bytes, repeats=1, **kw)


def _optimizer(plan):
    """torch's AdamW where the plan keeps fp32 state and every gradient, else ampc's."""
    return (torch.optim.AdamW if plan.step.state == "fp32" and not plan.step.grads_freed
            else ampc.optim.AdamW)


def _measured(plan, batch=None):
    """The plan's step measured here, apart from the search: a fresh model and its
    optimizer made by plan.prepare."""
    model, opt = plan.prepare(_model(), _optimizer(plan))
    return ampc.memory.report(_Under(model, plan.autocast), opt, batch or _batches()[0],
                              plan.loss(None), micro_batches=plan.step.micro_batches).peak


@pytest.fixture(scope="module")
def least():
    """The plan for a budget no plan meets: every module as low as its errors allow."""
    with pytest.warns(UserWarning, match="peak budget .* NOT met"):
        return _search(1)


def test_a_budget_no_plan_meets_gives_the_least_and_says_so(least):
    d = least.peak
    assert d.met is False and d.budget == 1
    assert d.bytes < d.fp32, d          # it did lower what it could
    assert any("NOT met" in n for n in least.data["notes"])
    assert "NOT met" in least.table()
    # where it is not recomputed and not a head whose logits the loss makes a slice at a
    # time, every module in fewer bytes than fp32 (lowered, or so already in the fastest
    # plan where a candidate timed as a tie)
    blocks = tuple(b + "." for b in least.step.recompute)
    outside = [u for u in least
               if not u.module.startswith(blocks) and u.module not in least.step.sliced_head]
    assert outside and all(u.figures()["bytes"] < u.options["fp32"]["bytes"] for u in outside)
    # the figure is the step's: measured again apart from the search, the same bytes
    assert _measured(least) == d.bytes
    # the whole step's moves: the lean state taken (torch's AdamW's hyperparameters on
    # ampc's), the parts of the peak by kind
    assert least.step.state == "lean" and least.step.why["state"].startswith("taken")
    assert sum(d.by_kind.values()) == d.bytes and d.by_kind["state"] > 0
    assert "state lean: weights 2 + optimizer state 2.03" in " ".join(least.table().split())


def test_a_budget_between_is_met_lowering_less_than_the_least(least):
    d0 = least.peak
    mid = (d0.fastest + d0.bytes) // 2
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        plan = _search(mid)
    assert not [w for w in said if "peak budget" in str(w.message)], (mid, plan.data["notes"])
    d = plan.peak
    assert d.met and d.bytes <= mid, d
    assert _measured(plan) <= mid
    assert any("peak budget" in n and ": met" in n for n in plan.data["notes"])
    # lowered where the fastest plan was over (whether it was depends on which candidates
    # timed as ties here), but not as far as the least plan: what fits is taken, no more
    assert d.rounds == 0 or any(u.reason is Reason.PEAK for u in plan) or plan.step.recompute
    assert len(plan.step.recompute) <= len(least.step.recompute)
    # the figures and the reason survive a save and a load; the table says why not lower
    again = Plan.from_json(plan.to_json())
    assert again.peak == d and again.decisions == plan.decisions and again.step == plan.step
    assert "not needed" in plan.table() or all(u.reason is Reason.PEAK for u in plan)


@pytest.fixture(scope="module")
def roomy():
    """The plan for a budget the fastest plan meets."""
    return _search(10 ** 12)


def test_a_budget_the_fastest_plan_meets_lowers_nothing(roomy):
    plan = roomy
    d = plan.peak
    assert d.met and d.rounds == 0
    # the step the fit measured, unless the whole-plan check's race took a form of higher
    # precision that fits too (on a model this small fp32 throughout can time clearly faster)
    raced = [n for n in plan.data["notes"] if n.startswith("under the byte budget the whole")]
    assert d.bytes == d.fastest or not raced[0].endswith("the plan as chosen taken"), raced
    assert plan.step.state == "fp32" and not plan.step.grads_freed and not plan.step.sliced_head
    assert not any(u.reason is Reason.PEAK for u in plan)
    assert plan.data["ceiling"] is None      # a budget, not the time ceiling


@pytest.mark.parametrize("kw, err, match", [
    (dict(peak_bytes="6 parsecs", objective="memory"), ValueError, "a string such as '6GiB'"),
    (dict(peak_bytes=0, objective="memory"), ValueError, "peak_bytes must be a positive"),
    (dict(peak_bytes=-5, objective="memory"), ValueError, "peak_bytes must be a positive"),
    (dict(peak_bytes=float("inf"), objective="memory"), ValueError, "peak_bytes"),
    (dict(peak_bytes=True, objective="memory"), ValueError, "peak_bytes"),
    (dict(peak_bytes=10 ** 6, objective="memory", optimizer="adamw"), TypeError, "optimizer"),
])
def test_bad_arguments_are_refused_before_anything_runs(kw, err, match):
    model = _model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(err, match=match) as e:
        search(model, _batches(), **kw)
    assert "ampc.autoprecision.search" in str(e.value)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_the_optimizer_given_is_the_one_measured(roomy):
    # SGD keeps no state: the same plan's step measures fewer bytes than with AdamW's moments
    sgd = _search(10 ** 12, optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))
    adamw = roomy
    n_params = sum(p.numel() for p in _model().parameters())
    assert adamw.peak.fp32 - sgd.peak.fp32 >= 2 * 4 * n_params


def test_blocks_are_recomputed_when_lowering_is_not_enough(least):
    # every Block holds two units: recomputed whole, its modules' codes dropped (a copy
    # of what is not saved); the plan applies, pastes, prints and removes it
    assert least.step.recompute == ("1", "2", "3")
    assert not any(u.choice.endswith("+8b") for u in least if u.module[:2] in ("1.", "2.", "3."))
    assert "ampc.memory.recompute(model, ['1', '2', '3'])" in least.python()
    assert "recomputed in the backward (ampc.memory.recompute): 3 module(s)" in least.table()
    model = _model()
    applied = least.apply(model)
    assert ampc.memory.recomputed(model) == ["1", "2", "3"]
    applied.remove()
    assert ampc.memory.recomputed(model) == []
    again = Plan.from_json(least.to_json())
    assert again.step.recompute == ("1", "2", "3")


def test_a_saved_plan_with_bad_recompute_is_refused(roomy):
    d = roomy.as_dict()
    d["recompute"] = "1"
    with pytest.raises(ValueError, match="recompute must be a list of module names"):
        Plan(d)


def _figures(ms, bytes_, loss_err=0.0, dgrad_err=0.0):
    return {"ms": ms, "bytes": bytes_, "loss_err": loss_err, "dgrad_err": dgrad_err,
            "wgrad_err": 0.0}


class _Plan:
    def __init__(self, choice):
        self.decisions = dict(choice)
        self.data = {}
        self.step = Step()


def test_the_moves_save_the_most_bytes_for_the_least_time_within_the_errors():
    from ampc.autoprecision._peak import _Lowering
    from ampc.autoprecision._solve import Budget
    measured = {
        "a": {"fp32": _figures(1.0, 1000), "fp32+8b": _figures(1.1, 400)},     # 0.1 ms for 600 B
        "b": {"fp32": _figures(1.0, 1000), "bf16": _figures(3.0, 500)},        # 2 ms for 500 B
        "c": {"fp32": _figures(1.0, 1000), "bf16": _figures(1.0, 900, loss_err=0.06)},  # over
        "blk.x": {"fp32": _figures(3.0, 1000), "fp32+8b": _figures(3.3, 400)},  # 0.3 ms
        "blk.y": {"fp32": _figures(3.0, 1000)},
    }
    usable = {n: list(o) for n, o in measured.items()}
    budget = Budget(loss=0.05)
    # 600 B wanted: a alone (cheapest per byte) covers it
    low = _Lowering(_Plan(dict.fromkeys(measured, "fp32")), usable, measured, budget, [], {})
    changed, blocks, got = low.take(600)
    assert changed == {"a": "fp32+8b"} and not blocks and got == 600
    # more wanted: blk.x, then b; c never (its loss error alone is over)
    low = _Lowering(_Plan(dict.fromkeys(measured, "fp32")), usable, measured, budget, [], {})
    changed, blocks, got = low.take(10 ** 6)
    assert changed == {"a": "fp32+8b", "blk.x": "fp32+8b", "b": "bf16"} and got == 1700
    # a block recomputed: 2 ms (a third of its units' 6) for 5000 B, after a, before blk.x's
    # code and b; its units make no moves of their own then
    low = _Lowering(_Plan(dict.fromkeys(measured, "fp32")), usable, measured, budget, [],
                    {"blk": 5000})
    changed, blocks, got = low.take(10 ** 6)
    assert blocks == ["blk"] and changed == {"a": "fp32+8b", "b": "bf16"} and got == 6100
    # a unit of it coded before: the code is dropped (nothing inside is saved)
    low = _Lowering(_Plan({**dict.fromkeys(measured, "fp32"), "blk.x": "fp32+8b"}), usable,
                    measured, budget, [], {"blk": 5000})
    changed, blocks, _ = low.take(5000)
    assert blocks == ["blk"] and changed == {"a": "fp32+8b", "blk.x": "fp32"}
    # the head's logits sliced in the loss: no time added, so first; a code on the head is
    # dropped (its input is kept whole for the loss)
    low = _Lowering(_Plan({**dict.fromkeys(measured, "fp32"), "b": "fp32+8b"}),
                    {**usable, "b": ["fp32", "fp32+8b", "bf16"]},
                    {**measured, "b": {**measured["b"], "fp32+8b": _figures(1.1, 400)}},
                    budget, [], {}, head_bytes={"b": 3000})
    assert low.moves()[0][2:] == ("b", "sliced head")
    changed, blocks, got = low.take(3000)
    assert low.sliced == ["b"] and changed == {"b": "fp32"} and not blocks and got == 3000


def _train(plan, steps=3):
    """Losses of a few AdamW steps of a fresh model with ``plan`` applied."""
    model, opt = plan.prepare(_model(), _optimizer(plan), lr=1e-2)
    return train_plan(plan, model, opt, _batches(steps))


def test_a_saved_plan_with_blocks_recomputed_trains_on_as_the_plan_it_was(least):
    # the plan saved and loaded trains step for step as the one searched; and recomputing is
    # exact: without its blocks recomputed the same choices train the same
    again = Plan.from_json(least.to_json())
    plain = Plan.from_json(least.to_json())
    plain.set_step(recompute=())
    assert _train(again) == _train(least) == _train(plain)


def test_an_ampc_optimizer_frees_the_gradients_first():
    """With ampc's AdamW the first move is the gradients freed in the backward (no error,
    little time), kept where the step's peak falls by 1% or more: on 16 rows, where the
    weights' bytes matter; its step is the one measured, and plan.prepare makes the
    optimizer so. torch's AdamW is stood for by ampc's with its hyperparameters: the same."""
    few = [(x[:16], y[:16]) for x, y in _batches()]
    plans = []
    for optimizer in (lambda ps: ampc.optim.AdamW(ps, weight_decay=0.1),
                      lambda ps: torch.optim.AdamW(ps, weight_decay=0.1)):
        with pytest.warns(UserWarning, match="peak budget .* NOT met"):
            plans.append(search(_model(), few, candidates=CANDIDATES, objective="memory",
                                peak_bytes=1, repeats=1, optimizer=optimizer))
    plan = plans[0]
    assert plan.step.grads_freed is True and plan.peak.bytes == _measured(plan, few[0])
    assert plan.step.why["grads freed"].startswith("taken")
    assert any("gradients freed in the backward" in n for n in plan.data["notes"])
    model, opt = plan.prepare(_model(), ampc.optim.AdamW, weight_decay=0.1)
    assert opt.step_in_backward and all(g["moments"] == "8bit" for g in opt.param_groups)
    assert plans[1].step.grads_freed is True


def test_an_optimizer_that_is_not_adam_keeps_fp32_state_and_its_gradients():
    with pytest.warns(UserWarning, match="peak budget .* NOT met"):
        plan = _search(1, optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))
    assert plan.step.state == "fp32" and not plan.step.grads_freed
    assert "not Adam or AdamW" in plan.step.why["state"]
    assert "not Adam or AdamW" in plan.step.why["grads freed"]


def test_the_time_objective_takes_a_byte_budget(least):
    """The fastest plan under the budget: the time objective's candidates, lowered to fit."""
    budget = (least.peak.fp32 + least.peak.fastest) // 2
    plan = search(_model(), _batches(), candidates=("fp32", "bf16"), objective="time",
                  peak_bytes=budget, repeats=1)
    assert plan.peak.met and plan.peak.bytes <= budget and _measured(plan) <= budget


def test_a_byte_budget_given_as_a_string():
    from ampc.autoprecision._step_peak import check_args
    assert check_args("6GiB", torch.optim.AdamW, "memory") == 6 * 2 ** 30
    assert check_args("500 MB", torch.optim.AdamW, "time") == 500 * 10 ** 6
    assert check_args("1.5kib", torch.optim.AdamW, "memory") == 1536


def test_the_heads_logits_are_sliced_when_the_budget_needs_them(least):
    """The model's last Linear gives its logits: under a budget no plan meets, the loss makes
    them a slice at a time (ampc.memory.sliced_head); the plan applies, pastes, prints, saves
    and loads it, and trains on as before."""
    assert least.step.sliced_head == ("4",)
    model = _model()
    applied = least.apply(model)
    assert isinstance(model(_batches()[0][0]), ampc.memory.DeferredLogits)
    applied.remove()
    assert type(model(_batches()[0][0])) is torch.Tensor
    assert "ampc.memory.sliced_head(model, ['4'])" in least.python()
    assert "ampc.memory.sliced_head): 1 module(s), 4" in " ".join(least.table().split())
    assert Plan.from_json(least.to_json()).step.sliced_head == ("4",)
    bad = dict(least.as_dict(), sliced_head="4")
    with pytest.raises(ValueError, match="sliced_head must be a list of module names"):
        Plan(bad)


def test_under_a_budget_a_slow_candidate_is_not_tried_on_matmul_units(monkeypatch):
    # the first plan is the fastest: a matmul that slow saves its bytes at a higher price
    # than the 8-bit codes or a recomputed block (the norms still measure it)
    import ampc.autoprecision._search as search_mod
    slow = {"fp16": "its 512x512 matmul takes 5x fp32's time", "bf16": "13x"}
    monkeypatch.setattr(search_mod, "probe", lambda candidates, device: dict(slow))
    plan = search(_model(), _batches(), candidates=("fp32", "bf16", "fp16", "fp32+8b"),
                  objective="memory", peak_bytes=10**12, repeats=1)
    gemm = [u for u in plan.units if u.kind == "gemm"]
    assert gemm and all(set(u.options) == {"fp32", "fp32+8b"} for u in gemm)
    for c in ("fp16", "bf16"):
        assert any(n.startswith(f"{c} not tried on the matmul and conv modules") for n in
                   plan.data["notes"])
    # without them slow, all are tried
    slow.clear()
    plan = search(_model(), _batches(), candidates=("fp32", "bf16", "fp16", "fp32+8b"),
                  objective="memory", peak_bytes=10**12, repeats=1)
    assert all(set(u.options) == {"fp32", "bf16", "fp16", "fp32+8b"}
               for u in plan.units if u.kind == "gemm")


def _no_budget(**kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return search(_model(), _batches(), candidates=CANDIDATES, objective="memory",
                      repeats=1, **kw)


def test_without_a_budget_blocks_are_recomputed_in_the_time_the_ceiling_leaves():
    # no ceiling: every block recomputed, the step measured lower than with the free moves alone
    free = _no_budget(max_slowdown=1.0)          # no time to spare: nothing recomputed
    assert free.step.recompute == ()
    assert free.step.why["recompute"].startswith("left: no block's recomputation fits the 0.0 ms")
    unbound = _no_budget(max_slowdown=None)
    assert unbound.step.recompute == ("1", "2", "3"), unbound.step.why
    assert unbound.step.why["recompute"].startswith("taken: 3 block(s)")
    assert unbound.peak.budget is None and unbound.peak.bytes < free.peak.bytes
    # nothing inside a recomputed block keeps a code (it would only add a copy)
    assert not any(u.choice.endswith("+8b") for u in unbound if u.module[:2] in ("1.", "2.", "3."))
    assert _measured(unbound) == unbound.peak.bytes


def _bf16_first(monkeypatch, fastest):
    """bf16 measures fastest on every unit (so the first plan is bf16), and the whole-step
    race finds ``fastest`` the fastest of the forms it is given; returns the forms raced."""
    from ampc.autoprecision import _measure, _whole
    import ampc.autoprecision._search as search_mod
    monkeypatch.setattr(search_mod, "probe", lambda candidates, device: {})
    real_run = _measure.run_at

    def run_at(module, choice, *args):
        y, dx, dw, _ = real_run(module, choice, *args)
        return y, dx, dw, 1e-3 * (1.0 if choice.startswith("bf16") else 2.0)
    monkeypatch.setattr(_measure, "run_at", run_at)
    raced = []

    def race(entrants, batches, device, rounds=3):
        raced.append(list(entrants))
        for setup in entrants.values():
            setup()
        return {n: 1.0 if n == fastest else 10.0 for n in entrants}
    monkeypatch.setattr(_whole, "race", race)
    return raced


def test_under_a_budget_a_form_in_fp32_that_fits_and_runs_faster_is_taken(monkeypatch):
    # the units one by one chose bf16; the whole step in bf16 measured slower than with every
    # module in fp32 (as on a CPU whose bf16 matmuls are slow), which fits the budget
    raced = _bf16_first(monkeypatch, "every module in fp32")
    plan = _search(10**12)
    assert raced == [["as chosen", "the ops outside the modules in fp32", "every module in fp32"]]
    assert plan.dtype == "fp32" and set(plan.decisions.values()) <= {"fp32", "fp32+8b"}
    assert any(n.endswith("every module in fp32 taken") for n in plan.data["notes"])
    assert plan.data["measured"]["loss_err"] < 1e-6
    # the peak the plan records is the step of the form taken, as a fresh model measures it
    assert abs(plan.peak.bytes - _measured(plan)) <= 0.02 * plan.peak.bytes


def test_under_a_budget_the_plan_as_chosen_is_kept_when_no_form_is_clearly_faster(monkeypatch):
    _bf16_first(monkeypatch, "as chosen")
    plan = _search(10**12)
    assert plan.dtype == "bf16" and plan.rest == "bf16"
    assert any(n.endswith("the plan as chosen taken") for n in plan.data["notes"])


def test_under_a_budget_a_form_over_it_is_not_raced(monkeypatch):
    raced = _bf16_first(monkeypatch, "as chosen")
    bf16_peak = _search(10**12).peak.bytes
    raced.clear()
    plan = _search(bf16_peak)
    # every module in fp32 needs more than the bf16 plan's peak: measured, never raced
    assert all("every module in fp32" not in r for r in raced)
    assert plan.dtype == "bf16" and plan.peak.met


@pytest.mark.parametrize("margin", [10.0, -1.0])
def test_over_the_budget_anyway_a_form_may_take_up_to_the_margin_more_bytes(monkeypatch, margin):
    # no plan meets a budget of one byte: a form of higher precision is then raced when its
    # peak is within MARGIN of the plan's own (a huge margin: every form; below zero: none)
    from ampc.autoprecision import _whole
    raced = _bf16_first(monkeypatch, "every module in fp32")
    monkeypatch.setattr(_whole, "MARGIN", margin)
    with pytest.warns(UserWarning, match="NOT met"):
        plan = _search(1)
    if margin > 0:
        assert raced == [["as chosen", "the ops outside the modules in fp32", "every module in fp32"]]
        assert plan.dtype == "fp32"
        assert any(n.endswith("every module in fp32 taken") for n in plan.data["notes"])
    else:
        assert raced == [] and plan.dtype == "bf16"
        assert any("forms of higher precision were over it" in n for n in plan.data["notes"])
    assert not plan.peak.met


def test_where_nothing_else_fits_the_batch_is_split_and_trains_as_the_whole(least):
    step = least.step
    assert step.micro_batches == 16 and step.why["micro-batches"].startswith("taken: 16")
    assert "the batch in 16 micro-batches" in least.table()
    assert "plan.backward(model, opt, (x, y), loss_fn)" in least.python()
    assert Plan.from_json(least.to_json()).step.micro_batches == 16
    # the same plan with the batch whole measures higher: the split is what lowered it
    whole = Plan.from_json(least.to_json())
    whole.set_step(micro_batches=1)
    assert _measured(whole) > 1.5 * _measured(least)
    # trained on beside the same plan run on whole batches: the same updates
    losses = []
    for plan in (whole, least):
        model, opt = plan.prepare(_model(), _optimizer(plan), lr=1e-3)
        rows = []
        model[0].register_forward_hook(lambda m, args, out: rows.append(len(out)))
        run = []
        for k in range(6):
            opt.zero_grad(set_to_none=True)
            run.append(plan.backward(model, opt, _batches(k + 3)[k + 2]).item())
            opt.step()
        losses.append(run)
        assert rows == [512 // plan.step.micro_batches] * 6 * plan.step.micro_batches
    assert max(abs(a - b) / a for a, b in zip(*losses)) <= 2e-3, losses


def test_a_batchnorm_model_keeps_its_batch_whole():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 256), nn.BatchNorm1d(256), nn.ReLU(), nn.Linear(256, 10))
    with pytest.warns(UserWarning, match="NOT met"):
        plan = search(model, _batches(), candidates=("fp32",), objective="memory",
                      peak_bytes=1, repeats=1)
    assert plan.step.micro_batches == 1
    assert plan.step.why["micro-batches"].startswith("left: 1 is a BatchNorm1d")


def test_a_framework_refuses_a_plan_that_splits_the_batch_before_anything_changes(least):
    from ampc.integrations._settings import check
    with pytest.raises(ValueError, match=r"AmpcPrecision: the plan runs each batch as 16 "
                                         r"micro-batches.*accumulate_grad_batches=16"):
        check("AmpcPrecision", "cpu", None, plan=least)
    with pytest.raises(ValueError, match=r"micro_batches must be an int >= 1, got 0"):
        Step(micro_batches=0)


def test_validate_trains_a_plan_that_splits_the_batch_as_it_says(least):
    from ampc.validate._compare import train_one
    rows = []

    def make():
        m = _model()
        m[0].register_forward_hook(lambda mod, args, out: rows.append(len(out)))
        return m
    run = train_one(least, None, make, _batches(3), lr=1e-3)
    assert rows == [512 // 16] * 16 * 3 and all(map(lambda v: v == v, run.losses))


class _Peak:
    """A measured step standing in for a report: its peak, and gradients alive at it (the peak
    in the backward) unless ``grads`` is 0."""

    def __init__(self, peak, grads=1):
        self.peak = peak
        self.parts = {"grads": grads}
        self.phase = "backward" if grads else "forward"


def _fake_peaks(monkeypatch, peak_of):
    from ampc.autoprecision import _peak
    monkeypatch.setattr(_peak, "step_peak", lambda model, plan, *a: _Peak(peak_of(plan)))
    return _peak


def test_with_the_budget_met_each_move_it_does_not_need_is_dropped(least, monkeypatch):
    """Under the budget, each move that costs time is undone where the step stays under it
    (each measured): here only block 1's recomputation saves bytes, so blocks 2 and 3, the
    freed gradients and the sliced head go, and the modules lowered stay (raising them
    would go over)."""
    plan = Plan.from_json(least.to_json())
    plan.set_step(grads_freed=True)
    before = {u.module: u for u in plan.every_unit}
    lowered = next(n for n, u in before.items() if u.choice != "fp32" and u.module[:2] not in
                   ("1.", "2.", "3."))
    plan.set_choice(lowered, "fp32", Reason.PEAK)       # stands for a move of the lowering

    def peak_of(p):
        return (100 - 30 * ("1" in p.step.recompute) - 5 * bool(p.step.sliced_head)
                + 10 * (p.unit(lowered).choice != "fp32"))
    _peak = _fake_peaks(monkeypatch, peak_of)
    rep = _peak.drop_unneeded(plan, _model(), _batches()[0], None, None, _Peak(peak_of(plan)),
                              72, before)
    assert rep.peak == 70
    assert plan.step.recompute == ("1",) and plan.step.sliced_head == ()
    assert plan.step.grads_freed is False and plan.unit(lowered).choice == "fp32"
    for move in ("recompute 3", "recompute 2", "grads freed", "sliced head 4"):
        assert plan.step.why[move].startswith("dropped: the step stays under the budget")
    assert "recompute 1" not in plan.step.why and "1 module(s) lowered" not in plan.step.why


def test_with_the_budget_met_micro_batches_are_halved_while_the_step_stays_under_it(
        roomy, monkeypatch):
    """The split taken last: with the budget met, halved while the step stays under it
    (each count measured), before the other moves are tried; it stops at the fewest that
    fit, and says so."""
    plan = Plan.from_json(roomy.to_json())
    plan.set_step(micro_batches=8)
    _peak = _fake_peaks(monkeypatch, lambda p: {8: 40, 4: 50, 2: 60, 1: 100}[
        p.step.micro_batches])
    rep = _peak.drop_unneeded(plan, _model(), _batches()[0], None, None, _Peak(40), 72,
                              {u.module: u for u in plan.every_unit})
    assert plan.step.micro_batches == 2 and rep.peak == 60
    assert plan.step.why["micro-batches"] == ("taken: 2, fewer than the split took: the step "
                                              "stays under the budget with 2 (0.0 -> 0.0 MiB)")
    plan.set_step(micro_batches=4)
    _peak = _fake_peaks(monkeypatch, lambda p: 70 - 10 * p.step.micro_batches)
    _peak.drop_unneeded(plan, _model(), _batches()[0], None, None, _Peak(30), 72,
                        {u.module: u for u in plan.every_unit})
    assert plan.step.micro_batches == 1
    assert plan.step.why["micro-batches"].startswith("dropped: the step stays under the budget "
                                                     "whole")


class _Layer(nn.Module):
    """A transformer layer's shape: two parts of two units each and nothing else, so that a
    part's time per byte saved is never worse than its layer's (the layer's is the parts'
    together) and which part is taken does not hang on a measured tie."""

    def __init__(self, d=16):
        super().__init__()
        self.attn = nn.Sequential(nn.Linear(d, d), nn.Linear(d, d))
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        return x + self.mlp(x + self.attn(x))


def test_a_layers_parts_of_two_units_or_more_may_be_recomputed_in_place_of_the_layer():
    """Recomputing a layer's MLP alone costs a part of the layer's time for most of its saved
    bytes: the layers, then their parts, are what the budget may recompute; a layer taken
    replaces its parts taken before, and a part of a layer recomputed whole is not taken."""
    from ampc.autoprecision import _peak
    model = nn.Sequential(_Layer(), _Layer())
    units = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    assert _peak.recompute_candidates(model, units) == ["0", "1", "0.attn", "0.mlp", "1.attn",
                                                        "1.mlp", "0.mlp.1", "1.mlp.1"]
    low = _peak._Lowering.__new__(_peak._Lowering)
    low.recompute, low.choice = [], dict.fromkeys(units, "bf16")
    for b in ("0.mlp", "1.mlp", "0", "0.attn"):
        low.recompute_block(b, {})
    assert low.recompute == ["1.mlp", "0"]


class _TanhGelu(nn.Module):
    """GPT-2's GELU: five ops, three of them saving a tensor as wide as the input."""

    def forward(self, x):
        return 0.5 * x * (1.0 + torch.tanh(0.7978845608 * (x + 0.044715 * torch.pow(x, 3.0))))


class _GeluLayer(nn.Module):
    def __init__(self, d=64):
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(d, 4 * d), _TanhGelu(), nn.Linear(4 * d, d)
        self.gelu, self.relu = nn.GELU(), nn.ReLU(inplace=True)

    def forward(self, x):
        return x + self.relu(self.gelu(self.fc2(self.act(self.fc1(x)))))


def test_a_layers_activation_alone_may_be_recomputed_for_its_own_forward():
    """A module inside a layer that holds no parameters and no module (an activation) may be
    recomputed alone: it keeps its input and drops what its ops saved, for its own forward's
    time, timed in the plan's model. One that works in place is not offered (recompute
    refuses it), nor a unit. The lowering prices the leaf by that time, a part by a third of
    its units' forward + backward."""
    import contextlib
    from ampc.autoprecision import _peak
    from ampc.autoprecision._solve import Budget
    model = nn.Sequential(_GeluLayer(), _GeluLayer())
    units = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    leaves = ["0.act", "0.gelu", "1.act", "1.gelu"]
    assert _peak.leaves(model, units) == leaves
    assert _peak.recompute_candidates(model, units)[-4:] == leaves
    batch = (torch.randn(256, 64), None)
    as_is = types.SimpleNamespace(apply=lambda m: None, autocast=contextlib.nullcontext)
    costs = _peak.LeafCosts(model, as_is, batch, leaves)
    assert set(costs.ms) == set(leaves) and all(t > 0 for t in costs.ms.values())
    assert costs.kept == {"0.act": 256 * 256 * 4, "1.act": 256 * 256 * 4,
                          "0.gelu": 256 * 64 * 4, "1.gelu": 256 * 64 * 4}

    def report(names):       # the step with `names` recomputed
        m = copy.deepcopy(model)
        if names:
            ampc.memory.recompute(m, names)
        return ampc.memory.report(_Under(m, contextlib.nullcontext),  # named as in a search
                                  torch.optim.SGD(m.parameters(), lr=0), batch,
                                  lambda out, _: out.sum(), warmup=0)
    plain = report([])
    # the tanh GELU saves its input and three more as wide; torch's GELU its input alone,
    # which its recomputation keeps: it is offered nothing to save
    net = costs.saved(plain, leaves)
    assert net["0.act"] >= 3 * 256 * 256 * 4 and net["0.gelu"] == 0
    assert plain.peak - report(["0.act"]).peak >= 2 * 256 * 256 * 4
    # priced by its forward: the cheaper leaf per byte first, a part by its units' third
    measured = {n: {"fp32": _figures(3.0, 1000)} for n in units}
    low = _peak._Lowering(_Plan(dict.fromkeys(units, "fp32")), {n: ["fp32"] for n in units},
                          measured, Budget(loss=0.05), [],
                          {"0": 2 * 10 ** 6, "0.act": 10 ** 6, "1.act": 10 ** 6},
                          leaf_ms={"0.act": 0.5, "1.act": 2.0})
    # (module, ms): layer 0 a third of its two units' 3 ms each, for twice the leaf's bytes
    assert [(m[2], -m[0] * m[1]) for m in low.moves()] == [
        ("0.act", pytest.approx(0.5)), ("0", pytest.approx(2.0)), ("1.act", pytest.approx(2.0))]


def test_without_a_budget_a_layer_and_its_parts_are_alternatives():
    """The memory objective with no ceiling recomputes what saves bytes, layers or their
    parts, never a part inside a layer it recomputes as well."""
    torch.manual_seed(0)
    model = nn.Sequential(_Layer(64), _Layer(64))
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(512, 64, generator=g), torch.randint(0, 64, (512,), generator=g))
               for _ in range(2)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = search(model, batches, candidates=CANDIDATES, objective="memory", repeats=1,
                      max_slowdown=None)
    rc = plan.step.recompute
    assert rc and plan.step.why["recompute"].startswith("taken"), plan.step.why
    assert not any(a != b and a.startswith(b + ".") for a in rc for b in rc), rc
    assert set(rc) <= {"0", "1", "0.attn", "0.mlp", "1.attn", "1.mlp"}
    # the MLPs hold most of the layers' saved bytes (4x wide) for part of their time
    assert {"0.mlp", "1.mlp"} <= set(rc), rc


def test_with_the_budget_met_saved_activations_in_8_bits_are_kept_as_they_are_if_it_fits(
        least, monkeypatch):
    """Codes the fastest plan took on a tie, or the lowering left, cost an encode and a decode
    a step: with the budget met, dropped together where the step stays under it."""
    plan = Plan.from_json(least.to_json())
    plan.set_step(recompute=(), grads_freed=False, sliced_head=(), micro_batches=1)
    coded = [u.module for u in plan.every_unit if u.choice.endswith("+8b")]
    assert coded

    def peak_of(p):                 # each code lowers the peak
        return 60 - 5 * sum(p.unit(n).choice.endswith("+8b") for n in coded)
    for budget, left in ((60, 0), (59, len(coded))):
        again = Plan.from_json(plan.to_json())
        _peak = _fake_peaks(monkeypatch, peak_of)
        _peak.drop_unneeded(again, _model(), _batches()[0], None, None, _Peak(peak_of(again)),
                            budget, {u.module: u for u in again.every_unit})
        still = [n for n in coded if again.unit(n).choice.endswith("+8b")]
        assert len(still) == left
        name = f"{len(coded)} module(s)' saved activations in 8 bits"
        assert (name in again.step.why) == (left == 0)


@pytest.mark.parametrize("costlier", ["codes", "block"])
def test_with_the_budget_met_the_costliest_move_is_undone_first(least, monkeypatch, costlier):
    """Two moves, either of which the step needs, not both: the one whose measured time is
    the larger is undone (a block recomputed against the 8-bit codes), the other kept."""
    plan = Plan.from_json(least.to_json())
    plan.set_step(recompute=("1",), grads_freed=False, sliced_head=(), micro_batches=1)
    coded = [u.module for u in plan.every_unit
             if u.choice.endswith("+8b") and not u.module.startswith("1.")]
    assert coded

    def peak_of(p):
        return (100 - 30 * ("1" in p.step.recompute)
                - 30 * any(p.unit(n).choice.endswith("+8b") for n in coded))
    _peak = _fake_peaks(monkeypatch, peak_of)
    # the block's time a third of its units' forward + backward, the codes' what uncoding saves
    assert _peak._block_ms(plan, "1") == pytest.approx(sum(
        u.figures()["ms"] for u in plan.every_unit if u.module.startswith("1.")) / 3)
    monkeypatch.setattr(_peak, "_block_ms", lambda p, b: 1.0 if costlier == "codes" else 9.0)
    monkeypatch.setattr(_peak, "_units_ms", lambda p, records: (
        9.0 if costlier == "codes" else 1.0) if records else 0.0)
    _peak.drop_unneeded(plan, _model(), _batches()[0], None, None, _Peak(peak_of(plan)), 72,
                        {u.module: u for u in plan.every_unit})
    still_coded = any(plan.unit(n).choice.endswith("+8b") for n in coded)
    assert still_coded == (costlier == "block")
    assert ("1" in plan.step.recompute) == (costlier == "codes")


def test_a_whole_step_move_that_lowers_the_peak_by_less_than_one_percent_is_left(
        roomy, monkeypatch):
    plan = Plan.from_json(roomy.to_json())
    _peak = _fake_peaks(monkeypatch, lambda p: 1000 - 5 * p.step.grads_freed
                        - 300 * (p.step.state == "lean"))
    rep = _peak.free_moves(plan, _model(), _batches()[0], None, torch.optim.AdamW, _Peak(1000))
    assert plan.step.grads_freed is False and plan.step.state == "lean" and rep.peak == 700
    assert plan.step.why["grads freed"] == ("left: the step's peak did not fall by 1% "
                                            "(0.0 -> 0.0 MiB)")


def test_freeing_the_gradients_is_not_measured_where_none_is_alive_at_the_peak(
        roomy, monkeypatch):
    """A peak in the forward, with no gradient alive (the batch whole): freeing them leaves
    the bytes there as they are, so the move is left without a measurement. Gradients alive
    at the peak (earlier micro-batches' in the forward, or the backward's): measured."""
    plan = Plan.from_json(roomy.to_json())
    asked = []

    def peak_of(p):
        asked.append(p.step.grads_freed)
        return 1000 - 300 * (p.step.state == "lean")
    _peak = _fake_peaks(monkeypatch, peak_of)
    rep = _peak.free_moves(plan, _model(), _batches()[0], None, torch.optim.AdamW,
                           _Peak(1000, grads=0), head_bytes={})
    assert asked == [False] and rep.peak == 700        # the state measured; the freeing not
    assert plan.step.grads_freed is False and plan.step.state == "lean"
    assert plan.step.why["grads freed"] == ("left: no gradient is alive at the step's peak (in "
                                            "its forward): freeing them cannot lower it")
    again, asked[:] = Plan.from_json(roomy.to_json()), []
    _peak.free_moves(again, _model(), _batches()[0], None, torch.optim.AdamW,
                     _Peak(1000, grads=64), head_bytes={})
    assert asked == [True, False]
    assert again.step.why["grads freed"].startswith("left: the step's peak did not fall")


def test_inside_a_search_each_plan_is_measured_once(roomy, monkeypatch):
    """Within a search (``measuring``), a plan's step measured before is not measured again:
    its report comes back; a floor above a mark is reused for a lower mark, and a floor under
    a mark goes on to the whole step once. Sound because a step measures the same bytes
    each time (checked here apart from the memo); a changed plan is measured anew."""
    from ampc.autoprecision import _step_peak
    from ampc.autoprecision._step_peak import Floor, measuring, step_peak
    plan = Plan.from_json(roomy.to_json())
    model, batch, opt = _model(), _batches()[0], torch.optim.AdamW
    a = step_peak(model, plan, batch, None, opt)
    b = step_peak(model, plan, batch, None, opt)
    assert a is not b and a.peak == b.peak and a.saved == b.saved      # no memo: both measured
    runs = []
    real = _step_peak._measured
    monkeypatch.setattr(_step_peak, "_measured",
                        lambda measure, *args: runs.append(measure.__name__) or real(measure, *args))

    @measuring
    def one_search():
        floor = step_peak(model, plan, batch, None, opt, 0)
        low = step_peak(model, plan, batch, None, opt, 1)
        whole = step_peak(model, plan, batch, None, opt, a.peak)
        assert isinstance(floor, Floor) and low == floor and whole.peak == a.peak
        assert step_peak(model, plan, batch, None, opt) is whole
        assert step_peak(model, plan, batch, None, opt, 0) is whole     # the step is known
        changed = Plan.from_json(plan.to_json())
        changed.set_step(state="lean")
        assert step_peak(model, changed, batch, None, opt).peak < whole.peak
    one_search()
    assert runs == ["forward_floor", "report", "report"]
    runs.clear()
    one_search()                # a new scope measures again
    assert runs == ["forward_floor", "report", "report"]


def test_a_search_freezes_the_collector_only_while_it_runs(roomy):
    """Measured steps collect garbage first; the objects alive before the search are frozen
    out of those walks while it runs, and the collector is as it was after, also where the
    caller had frozen objects of its own."""
    import gc
    from ampc.autoprecision._step_peak import measuring
    counts = []
    measuring(lambda: counts.append(gc.get_freeze_count()))()
    assert counts[0] > 0 and gc.get_freeze_count() == 0
    gc.freeze()
    try:
        measuring(lambda: counts.append(gc.get_freeze_count()))()
        assert counts[1] > 0 and gc.get_freeze_count() > 0     # the caller's, not unfrozen
    finally:
        gc.unfreeze()
    with pytest.raises(ZeroDivisionError):
        measuring(lambda: 1 / 0)()
    assert gc.get_freeze_count() == 0


def test_a_step_whose_forward_alone_is_over_the_mark_stops_there(roomy):
    """step_peak with ``over``: the forward measured first; over the mark, a Floor of its
    bytes (at most the step's peak, the backward not run); under it, the whole step."""
    from ampc.autoprecision._step_peak import Floor, step_peak
    plan = Plan.from_json(roomy.to_json())
    batch = _batches()[0]
    whole = step_peak(_model(), plan, batch, None, torch.optim.AdamW)
    floor = step_peak(_model(), plan, batch, None, torch.optim.AdamW, 0)
    assert isinstance(floor, Floor) and 0 < floor.peak <= whole.peak
    again = step_peak(_model(), plan, batch, None, torch.optim.AdamW, whole.peak)
    assert not isinstance(again, Floor) and again.peak == whole.peak


def test_backward_refuses_a_plan_with_fp16_modules_without_a_scaler(roomy):
    """The search measures fp16 choices at the loss scale a run settles at: a loop that runs
    them unscaled could underflow their gradients, silently. plan.backward names the fp16
    modules and asks for plan.scaler() before anything runs; with it, the step trains."""
    plan = Plan.from_json(roomy.to_json())
    name = next(iter(plan.choices))
    plan.set_choice(name, "fp16")
    model, opt = plan.prepare(_model(), _optimizer(plan), lr=1e-3)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match=f"Plan.backward: the plan runs {name} in fp16.*"
                                         "scaler=plan.scaler()"):
        plan.backward(model, opt, _batches()[0])
    assert all(p.grad is None for p in model.parameters())      # nothing ran
    scaler = plan.scaler()
    assert scaler is not None
    loss = plan.backward(model, opt, _batches()[0], scaler=scaler)
    scaler.step(opt)
    scaler.update()
    assert torch.isfinite(loss)
    assert any(not torch.equal(a, p) for a, p in zip(before, model.parameters()))


def test_the_lowering_offers_bf16_not_fp16_for_the_same_bytes(roomy):
    """A budget's lowering takes moves by time added per byte saved: fp16 measured a hair
    faster than bf16 for the same bytes would win, and cost the plan a scaler and its freed
    gradients. It is offered only where no candidate without a scaler saves as much."""
    from ampc.autoprecision._peak import _Lowering
    plan = Plan.from_json(roomy.to_json())
    measured = {n: {c: dict(r) for c, r in plan.unit(n).options.items()} for n in plan.decisions}
    name = next(iter(plan.choices))
    fp32 = measured[name]["fp32"]
    quiet = dict(loss_err=0.0, dgrad_err=0.0, wgrad_err=0.0, error=None)
    measured[name]["bf16"] = dict(fp32, bytes=fp32["bytes"] // 2, ms=fp32["ms"] * 1.01, **quiet)
    measured[name]["fp16"] = dict(fp32, bytes=fp32["bytes"] // 2, ms=fp32["ms"] * 1.00, **quiet)
    usable = {n: [c for c in m if c in ("fp32", "bf16", "fp16")] for n, m in measured.items()}

    def offered():
        low = _Lowering(plan, usable, measured, plan.budget, (), {})
        return {a for _, _, n, a in low.moves() if n == name}
    assert offered() == {"bf16"}
    usable[name].remove("bf16")             # no other way to those bytes: fp16 is offered
    assert offered() == {"fp16"}
