"""The loss as a decision unit: measured at fp32, bf16 and fp16 like any module (fp16 at the
loss scale a run would settle at), kept higher where its measured error or its small size
says so (whatever it is called), and run at its choice through ``plan.loss(loss_fn)``, in
search's whole-plan checks and in validate."""
import copy
import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ampc
from ampc.autoprecision import Plan, search
from ampc.autoprecision import _loss
from ampc.autoprecision._units import Reason
from ampc._numerics.capture import capture
from ampc._numerics.model import default_loss

VOCAB = 4096


class TinyLM(nn.Module):
    """An embedding, one hidden layer and a 4096-word head: the logits are most of the
    bytes a step moves, as in a language model."""

    def __init__(self, vocab=VOCAB, width=32):
        super().__init__()
        self.emb = nn.Embedding(vocab, width)
        self.hidden = nn.Linear(width, width)
        self.head = nn.Linear(width, vocab)

    def forward(self, tokens):
        return self.head(torch.relu(self.hidden(self.emb(tokens))))


def lm_batches(n=2, vocab=VOCAB):
    g = torch.Generator().manual_seed(0)
    return [(torch.randint(0, vocab, (4, 16), generator=g),
             torch.randint(0, vocab, (4, 16), generator=g)) for _ in range(n)]


def classifier_batches(n=2):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(16, 32, generator=g), torch.randint(0, 10, (16,), generator=g))
            for _ in range(n)]


@pytest.fixture(scope="module")
def lm_plan():
    torch.manual_seed(0)
    return search(TinyLM(), lm_batches(), candidates=("fp32", "bf16"),
                  objective="memory", max_slowdown=None, repeats=1)


def test_the_loss_is_measured_and_lowered_where_its_logits_are_most_of_the_bytes(lm_plan):
    u = lm_plan.loss_unit
    assert u is not None and u.module == "(loss)" and u.kind == "loss"
    assert u.type == "default_loss"
    assert set(u.options) == {"fp32", "bf16"}
    assert u.options["fp32"]["loss_err"] == 0.0 and u.options["fp32"]["dgrad_err"] == 0.0
    bf16 = u.options["bf16"]
    assert 0.0 < bf16["loss_err"] < 0.05 and 0.0 < bf16["dgrad_err"] < 0.05
    assert bf16["bytes"] * 2 == u.options["fp32"]["bytes"] == 4 * 4 * 16 * VOCAB
    assert u.choice == "bf16"                 # half the logits' bytes, error in budget
    assert lm_plan.decisions["(loss)"] == "bf16" and "(loss)" not in lm_plan.choices
    assert "(loss)" in lm_plan.table() and "default_loss" in lm_plan.table()


def test_an_fp16_loss_is_judged_at_the_scale_a_run_backs_off_to(monkeypatch):
    # the modules' loss scale (2**19 here) is past fp16's 65504, and in fp16 the loss's own
    # gradient is the scale: a dynamic scaler backs off until it is in range, so fp16 is
    # measured at such a scale (the largest power of two keeping 1 and dL/dy under half of
    # fp16's range), not ruled out for GradScaler's first one
    assert _loss.loss_scale(2.0 ** 19, [torch.tensor([0.5, -0.25])]) == 16384.0
    assert _loss.loss_scale(2.0 ** 19, [torch.tensor([4.0])]) == 4096.0
    assert _loss.loss_scale(1024.0, [torch.tensor([0.5])]) == 1024.0
    torch.manual_seed(0)
    step = capture(TinyLM(), lm_batches()[0], default_loss, [], keep_output=True)

    def fp16_at(scale):
        tally = _loss.Tally(None, ("fp32", "fp16"), "cpu", repeats=1)
        tally.add(step, scale)
        return tally.result()["fp16"]
    fp16 = fp16_at(2.0 ** 19)
    assert fp16["loss_scale"] == 16384.0 and fp16["overflow"] == 0.0
    assert 0.0 < fp16["dgrad_err"] < 0.05 and 0.0 < fp16["loss_err"] < 0.05
    # the control: judged at the modules' scale, the loss's own gradient overflows
    monkeypatch.setattr(_loss, "loss_scale", lambda scale, grads: scale)
    assert fp16_at(2.0 ** 19)["dgrad_err"] == float("inf")


def test_the_measured_errors_match_an_independent_float64_reckoning(lm_plan):
    # the loss err of bf16 is |L_bf16 - L_fp32| / |L_fp32| averaged over the batches: the same
    # figure reckoned here from scratch, with the model's own fp32 logits
    torch.manual_seed(0)
    model = TinyLM()
    errs, dgrads = [], []
    for x, y in lm_batches():
        logits = model(x).detach()
        ref = F.cross_entropy(logits.double().reshape(-1, VOCAB), y.reshape(-1))
        z32 = logits.clone().requires_grad_(True)
        l32 = default_loss(z32, y)
        l32.backward()
        zb = logits.clone().requires_grad_(True)
        lb = _loss.AtPrecision(None, "bf16", "cpu")(zb, y)
        lb.backward()
        assert lb.dtype == torch.float32 and abs(l32.item() - ref.item()) < 1e-5 * ref.item()
        errs.append(abs(lb.item() - l32.item()) / abs(l32.item()))
        dgrads.append(float((zb.grad - z32.grad).norm() / z32.grad.norm()))
    measured = lm_plan.loss_unit.options["bf16"]
    assert measured["loss_err"] == pytest.approx(sum(errs) / 2, rel=1e-6)
    assert measured["dgrad_err"] == pytest.approx(sum(dgrads) / 2, rel=1e-3)


def test_plan_loss_runs_the_loss_at_its_choice(lm_plan):
    x = torch.randn(64, VOCAB)
    y = torch.randint(0, VOCAB, (64,))
    loss = lm_plan.loss()(x, y)
    # bf16: the same as torch's cross-entropy on bf16 logits, returned in fp32
    assert loss.dtype == torch.float32
    assert loss.item() == F.cross_entropy(x.bfloat16(), y).float().item()
    assert loss.item() != F.cross_entropy(x, y).item()
    fp32 = copy.deepcopy(lm_plan)
    fp32.set_choice("(loss)", "fp32")
    with ampc.autocast("cpu", dtype=torch.bfloat16):       # fp32 even inside a region
        assert fp32.loss()(x, y).item() == F.cross_entropy(x, y).item()


def test_a_loss_handed_out_follows_the_plan(lm_plan):
    p = copy.deepcopy(lm_plan)
    fn = p.loss()
    x, y = torch.randn(64, VOCAB), torch.randint(0, VOCAB, (64,))
    assert fn(x, y).item() == F.cross_entropy(x.bfloat16(), y).float().item()
    model = TinyLM()
    applied = p.apply(model)
    applied.set("(loss)", "fp32")                     # no module of that name: the loss's record
    assert p.loss_unit.choice == "fp32" and fn.choice == "fp32"
    assert fn(x, y).item() == F.cross_entropy(x, y).item()


def test_a_loss_bf16_cannot_hold_is_kept_in_fp32_whatever_its_name():
    # a regression loss on targets near 1000: bf16's spacing there (8) swallows the
    # difference the loss measures, so its error is near 1; the name says nothing
    def my_objective(out, target):
        return F.mse_loss(out, target)

    class Offset(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(32, 64)

        def forward(self, x):
            return self.lin(x) + 1000.0
    g = torch.Generator().manual_seed(2)
    batches = [(torch.randn(64, 32, generator=g), 1000.0 + torch.randn(64, 64, generator=g))
               for _ in range(2)]
    torch.manual_seed(0)
    plan = search(Offset(), batches, my_objective, candidates=("fp32", "bf16"),
                  objective="memory", max_slowdown=None, repeats=1)
    u = plan.loss_unit
    assert u.type == "my_objective" and u.choice == "fp32"
    assert u.options["bf16"]["loss_err"] > 0.05
    assert "bf16" in u.rejected and "err" in u.rejected["bf16"]


def test_a_classifier_loss_stays_fp32_it_would_save_too_little():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 10))
    plan = search(model, classifier_batches(), candidates=("fp32", "bf16"), objective="memory",
                  max_slowdown=None, repeats=1)
    u = plan.loss_unit
    assert u.options["bf16"]["loss_err"] < 0.05        # it would fit the budget ...
    assert u.choice == "fp32"                            # ... but buys 320 bytes
    assert "under 10%" in u.rejected["bf16"]
    assert all(c == "bf16" for c in plan.choices.values())


def test_loss_unit_false_leaves_the_loss_out():
    torch.manual_seed(0)
    plan = search(TinyLM(), lm_batches(), candidates=("fp32", "bf16"), objective="memory",
                  max_slowdown=None, repeats=1, loss_unit=False)
    assert plan.loss_unit is None and "(loss)" not in plan.decisions
    assert plan.loss() is default_loss

    def fn(out, target):
        return default_loss(out, target)
    assert plan.loss(fn) is fn


def test_a_model_that_returns_its_own_loss_has_no_loss_unit():
    class OwnLoss(TinyLM):
        def forward(self, tokens, labels=None):
            logits = super().forward(tokens)
            return {"loss": F.cross_entropy(logits.float().reshape(-1, VOCAB), labels.reshape(-1)),
                    "logits": logits}
    torch.manual_seed(0)
    batches = [({"tokens": x, "labels": y}, None) for x, y in lm_batches()]
    plan = search(OwnLoss(), batches, candidates=("fp32", "bf16"), objective="memory",
                  max_slowdown=None, repeats=1)
    assert plan.loss_unit is None


def test_the_loss_record_saves_loads_and_is_checked(lm_plan, tmp_path):
    back = Plan.load(lm_plan.save(str(tmp_path / "plan.json")))
    assert back == lm_plan and back.loss_unit == lm_plan.loss_unit
    data = json.loads(lm_plan.to_json())
    data["loss"]["choice"] = "fp8"
    with pytest.raises(ValueError, match=r"loss\.choice"):
        Plan(data)
    data["loss"]["choice"] = 3
    with pytest.raises(ValueError, match=r"units\[loss\]\.choice"):
        Plan(data)
    with pytest.raises(ValueError, match="the loss's choice"):
        copy.deepcopy(lm_plan).set_choice("(loss)", "fp8")
    old = json.loads(lm_plan.to_json())
    del old["loss"]                                     # a plan saved before the loss unit
    assert Plan(old).loss_unit is None


def test_an_fp16_loss_needs_the_scaler_and_the_python_says_how(lm_plan):
    p = copy.deepcopy(lm_plan)
    p.set_choices(dict.fromkeys(p.choices, "bf16"), Reason.SET)
    assert not p.needs_scaler()
    p.set_choice("(loss)", "fp16")
    assert p.needs_scaler()
    text = lm_plan.python()
    assert "then the loss in bf16" in text and "out.to(torch.bfloat16)" in text
    env = {}
    exec(next(line for line in text.splitlines() if line.startswith("LOSS_OPS")), env)
    with ampc.policy.scope(dtype=torch.bfloat16, ops=env["LOSS_OPS"]):
        pass                                            # every name is one a scope honours


def test_verify_trains_with_the_plans_loss(lm_plan, monkeypatch):
    def make_batch(step):
        g = torch.Generator().manual_seed(step)
        return (torch.randint(0, VOCAB, (4, 16), generator=g),
                torch.randint(0, VOCAB, (4, 16), generator=g))
    seen = []
    real = _loss.AtPrecision.__call__

    def spy(self, output, target):
        seen.append(self.choice)
        return real(self, output, target)
    monkeypatch.setattr(_loss.AtPrecision, "__call__", spy)
    report = lm_plan.verify(TinyLM, make_batch, steps=3, progress=False)
    assert seen and set(seen) == {"bf16"}
    auto = next(r for r in report.rows if r["setup"] == "ampc memory")
    assert auto["final_gap"] < 0.05
