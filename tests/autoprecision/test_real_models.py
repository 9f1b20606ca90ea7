"""ampc.autoprecision on real models: a transformers GPT-2 (fresh small config),
torchvision's ResNet-18 and a small BatchNorm CNN. The plan applies, trains, stays inside
fp32's spread, and its step time is reported against fp32 and torch.amp; against fp32's
batch-to-batch spread the CNNs get mixed plans, with zero tolerance of it ResNet-18 does not."""
import pytest
import torch
from torch import nn

import ampc
from ampc.autoprecision import search
from ampc.validate import compare

pytestmark = pytest.mark.slow


def gpt2():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(vocab_size=256, n_positions=32, n_embd=64, n_layer=2, n_head=2,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(cfg)


def gpt2_batch(step):
    g = torch.Generator().manual_seed(step)
    # a learnable stream: each sequence counts up from a random start, with noise
    start = torch.randint(0, 256, (16, 1), generator=g)
    ids = (start + torch.arange(33)) % 256
    ids = torch.where(torch.rand(ids.shape, generator=g) < 0.2,
                      torch.randint(0, 256, ids.shape, generator=g), ids)
    return ids[:, :-1], ids[:, 1:]


def lm_loss(out, target):
    logits = out.logits if hasattr(out, "logits") else out
    return nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]),
                                       target.reshape(-1))


def test_gpt2_plan_trains_inside_fp32_spread(capsys):
    from transformers.pytorch_utils import Conv1D
    torch.manual_seed(0)
    model = gpt2()
    # GPT-2's projections are transformers' Conv1D (an addmm): name the type as a unit
    plan = search(model, [gpt2_batch(100 + k) for k in range(2)], lm_loss,
                  candidates=("fp32", "bf16"), objective="memory", max_slowdown=None, repeats=1,
                  units=(Conv1D, nn.Linear, nn.LayerNorm))
    names = set(plan.choices)
    assert "transformer.h.0.attn.c_attn" in names and "lm_head" in names
    assert "bf16" in plan.choices.values()
    report = plan.verify(gpt2, gpt2_batch, steps=40, loss_fn=lm_loss, lr=3e-3, progress=False)
    with capsys.disabled():
        print("\n" + plan.table() + "\n" + report.table())
    auto = next(r for r in report.rows if r["setup"] == "ampc memory")
    limit = report.spread if not report.too_wide else 0.05
    assert auto["final_gap"] <= max(limit, 0.01)
    assert all(r["step_ms"] > 0 for r in report.rows) and report.base.median_ms() > 0


def resnet_batches():
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(8, 3, 64, 64, generator=g), torch.randint(0, 10, (8,), generator=g))
            for _ in range(2)]


def low_count(plan):
    return sum(c != "fp32" for c in plan.choices.values())


def test_resnet18_mixed_against_noise_all_fp32_without():
    torchvision = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=10)
    batches = resnet_batches()
    plan = search(model, batches, candidates=("fp32", "bf16"), objective="memory",
                  max_slowdown=None, repeats=1)
    kinds = {u.type for u in plan.units}
    assert {"Conv2d", "BatchNorm2d", "Linear"} <= kinds and len(plan.units) == 41
    print(plan.table())
    # every convolution adds a few 1e-3 to its gradients; the whole model's weight
    # gradients at initialization differ from fp32's by about 0.4 in one step, but fp32's
    # own batch-to-batch spread of them is about 1.0: within half of it, so the plan holds
    m = plan.data["measured"]
    assert 0.5 < m["grad_noise"] < 1.5
    assert m["grad_err"] <= plan.budget.limit("grad_err", m["grad_noise"])
    assert m["grad_err"] > plan.budget.grad        # over the fixed figure: the noise decides
    assert low_count(plan) > 0
    u = plan.unit("layer1.0.conv1").options["bf16"]
    assert u["wgrad_noise"] > 0.5 and u["wgrad_err"] < 0.02
    applied = plan.apply(model)
    assert len(applied.changes) == 41
    opt = ampc.optim.AdamW(model.parameters(), lr=1e-3)
    for x, y in batches:
        opt.zero_grad()
        with plan.autocast():
            out = model(x)
        loss = nn.functional.cross_entropy(out.float(), y)
        loss.backward()
        opt.step()
        assert torch.isfinite(loss)
    # the control: zero tolerance of noise is the fixed budget alone, which the whole
    # model cannot meet in bf16 at initialization: back-off, then fp32 throughout (the
    # answer before the noise yardstick; three rounds of back-off to keep the test short)
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=10)
    strict = search(model, batches, candidates=("fp32", "bf16"), objective="memory",
                    max_slowdown=None, repeats=1,
                    budget={"noise_fraction": 0}, max_backoffs=3)
    assert low_count(strict) == 0
    assert strict.data["backoffs"] and all(b["why"].startswith("grad err")
                                           for b in strict.data["backoffs"])
    assert any("every module kept in fp32" in n for n in strict.data["notes"])


class BNCNN(nn.Module):
    """A small BatchNorm CNN: three conv, batch norm, ReLU blocks, pooling, a Linear head."""

    def __init__(self):
        super().__init__()
        layers, c = [], 3
        for width in (16, 32, 64):
            layers += [nn.Conv2d(c, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU(),
                       nn.MaxPool2d(2)]
            c = width
        self.features = nn.Sequential(*layers)
        self.fc = nn.Linear(64, 10)

    def forward(self, x):
        return self.fc(self.features(x).mean((2, 3)))


def test_bn_cnn_mixed_plan():
    torch.manual_seed(0)
    model = BNCNN()
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(16, 3, 32, 32, generator=g), torch.randint(0, 10, (16,), generator=g))
               for _ in range(3)]
    plan = search(model, batches, candidates=("fp32", "bf16"), objective="memory",
                  max_slowdown=None, repeats=1)
    print(plan.table())
    assert len(plan.units) == 7 and low_count(plan) > 0
    # batch norm is measured in bf16 for real (a scope that ignored it measured 0.0)
    for u in plan.units:
        if u.type == "BatchNorm2d":
            assert u.options["bf16"]["dgrad_err"] > 1e-4, u.module
    m = plan.data["measured"]
    assert m["grad_err"] <= plan.budget.limit("grad_err", m["grad_noise"])
    strict = search(model, batches, candidates=("fp32", "bf16"), objective="memory",
                    max_slowdown=None, repeats=1,
                    budget={"noise_fraction": 0}, max_backoffs=3)
    print(strict.table())
    # fixed figures alone hold the whole plan to 0.25: never more permissive than the noise
    assert low_count(strict) <= low_count(plan)
    # the whole model's gradient error (about 0.06) fits even the fixed 0.25, so the
    # control keeps bf16; but each unit's weight gradient in the whole plan (it carries the
    # dgrad error of every unit after it) is over the fixed 0.05: the plan says so, by name
    assert low_count(strict) > 0
    assert any("weight-gradient errors over their limit" in n and "features.0" in n
               for n in strict.data["notes"]), strict.data["notes"]


def template_task(hw, batch, noise):
    """make_batch(step) for a learnable image task: each of 10 classes is a fixed random
    image, seen through Gaussian noise of standard deviation ``noise``."""
    templates = torch.randn(10, 3, hw, hw, generator=torch.Generator().manual_seed(123))

    def make_batch(step):
        g = torch.Generator().manual_seed(1000 + step)
        y = torch.randint(0, 10, (batch,), generator=g)
        return templates[y] + noise * torch.randn(batch, 3, hw, hw, generator=g), y
    return make_batch


def plan_against_fp32_seeds(make_model, make_batch, steps, lr):
    """The plan searched on two batches of the task (not the training ones), then trained
    through validate.compare beside fp32 from seeds 0 and 1."""
    torch.manual_seed(0)
    plan = search(make_model(), [make_batch(10_000 + k) for k in range(2)],
                  candidates=("fp32", "bf16"), objective="memory", max_slowdown=None, repeats=1)
    report = compare(make_model, make_batch, steps=steps, setups=(plan,), seeds=(0, 1), lr=lr,
                     progress=False, device="cpu")
    print("\n" + plan.table() + "\n" + report.table())
    (row,) = report.rows
    assert row["setup"] == "ampc memory"      # the objective names the run
    assert low_count(plan) > 0                       # mixed, not the all-fp32 answer
    return plan, report, row


def test_bn_cnn_plan_trains_inside_fp32_seed_spread():
    # 20 steps of batch 16 at 32x32: the loss falls from 2.4 to about 1.85; fp32's two
    # seeds end about 4% apart, the plan within a few tenths of a percent of fp32
    plan, report, row = plan_against_fp32_seeds(BNCNN, template_task(32, 16, 1.0), 20, 3e-3)
    assert len(plan.units) == 7
    assert not report.too_wide and report.spread > 0
    assert row["within_spread"] is True and abs(row["gap"]) <= report.spread
    assert report.base.losses[-1] < 0.9 * report.base.losses[0]      # it learns


def test_resnet18_plan_trains_inside_fp32_seed_spread():
    torchvision = pytest.importorskip("torchvision")
    # 12 steps of batch 16 at 16x16 (CI time): ResNet-18's fp32 seeds end far apart on so
    # short a run (about 10% over the last quarter, over validate's 5% for a verdict), so
    # validate holds the plan to 5% of fp32 (Comparison.ok) as well as to the spread it
    # measured; both by the statistic its verdict reads, the paired gap over the last quarter
    # (a single last step's gap is noisier: 15% against that 10% in one run)
    plan, report, row = plan_against_fp32_seeds(lambda: torchvision.models.resnet18(num_classes=10),
                                                template_task(16, 16, 3.0), 12, 1e-3)
    assert len(plan.units) == 41
    assert abs(row["gap"]) <= report.spread
    assert report.ok(), report.table()
