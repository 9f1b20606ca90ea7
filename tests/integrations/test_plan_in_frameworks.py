"""plan= of the framework integrations (Lightning's Trainer, Accelerate): the plan's whole step
(the region, each module's precision, the blocks recomputed, the weights and the optimizer's
state, gradients freed in the backward) set up on the optimizer the framework hands over,
training exactly as ``plan.prepare`` and the usual loop by hand; what contradicts the plan is
refused before training starts."""
import pytest
import torch
from torch import nn

from integration_helpers import need, regression_data

L = need("lightning.pytorch")
accelerate = need("accelerate")
from accelerate.state import AcceleratorState, GradientState  # noqa: E402

import ampc  # noqa: E402
from ampc.autoprecision import Plan  # noqa: E402
from ampc.integrations.accelerate import use_ampc  # noqa: E402
from ampc.integrations.lightning import AmpcPrecision  # noqa: E402


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 4))


def plan(state="lean", grads_freed=True, choice="bf16", first="0"):
    p = Plan({"version": 1, "device": "cpu", "objective": "memory",
              "candidates": ["fp32", "bf16", "fp16"],
              "budget": {"loss": 0.01, "grad": 0.05, "wgrad": 0.1},
              "units": [{"module": first, "type": "Linear", "choice": choice},
                        {"module": "2", "type": "Linear", "choice": "fp32"}]})
    p.set_step(state=state, grads_freed=grads_freed, recompute=("0", "1"))
    return p


def _loader():
    x, y = regression_data()
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8)


def by_hand(p):
    net, opt = p.prepare(_net(), ampc.optim.AdamW, lr=1e-2)
    losses = []
    for x, y in _loader():
        opt.zero_grad()
        with p.autocast():
            loss = nn.functional.mse_loss(net(x).float(), y)
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return torch.stack(losses)


class Model(L.LightningModule):
    def __init__(self, optimizer=ampc.optim.AdamW, n_optimizers=1):
        super().__init__()
        self.net, self.optimizer, self.n = _net(), optimizer, n_optimizers
        self.automatic_optimization = n_optimizers == 1   # (Lightning's rule for several)
        self.losses = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x).float(), y)
        self.losses.append(loss.detach().clone())
        return loss

    def configure_optimizers(self):
        opts = [self.optimizer(self.parameters(), lr=1e-2) for _ in range(self.n)]
        return opts[0] if self.n == 1 else opts


def lightning(plugin, model=None, **trainer):
    model = model or Model()
    t = L.Trainer(accelerator="cpu", devices=1, max_epochs=1, logger=False,
                  enable_checkpointing=False, enable_progress_bar=False,
                  enable_model_summary=False, num_sanity_val_steps=0, plugins=[plugin], **trainer)
    t.fit(model, _loader())
    return torch.stack(model.losses), model, t


def accelerated(p, mixed_precision="bf16"):
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    acc = use_ampc(accelerate.Accelerator(mixed_precision=mixed_precision, cpu=True), plan=p)
    net = _net()
    opt = ampc.optim.AdamW(net.parameters(), lr=1e-2)
    net, opt, loader = acc.prepare(net, opt, _loader())
    losses = []
    for x, y in loader:
        opt.zero_grad()
        loss = nn.functional.mse_loss(net(x).float(), y)
        acc.backward(loss)
        opt.step()
        losses.append(loss.detach())
    return torch.stack(losses), net, opt


@pytest.mark.parametrize("state, grads_freed", [("lean", True), ("master", False),
                                                ("fp32", True)])
def test_lightning_and_accelerate_train_as_plan_prepare_by_hand(state, grads_freed):
    want = by_hand(plan(state, grads_freed))
    ours, model, trainer = lightning(AmpcPrecision(device="cpu", plan=plan(state, grads_freed)))
    assert torch.equal(ours, want), (ours, want)
    opt = trainer.optimizers[0]
    assert ampc.memory.recomputed(model) == ["net.0", "net.1"]
    assert opt.step_in_backward == grads_freed
    assert model.net[0].weight.dtype == (torch.float32 if state == "fp32" else torch.bfloat16)
    assert opt.param_groups[0]["moments"] == ("8bit" if state == "lean" else "fp32")
    acc, net, aopt = accelerated(plan(state, grads_freed))
    assert torch.equal(acc, want), (acc, want)
    assert ampc.memory.recomputed(net) == ["0", "1"]


def test_the_plan_from_its_file_and_an_accelerator_without_mixed_precision(tmp_path):
    path = plan().save(str(tmp_path / "plan.json"))
    want = by_hand(plan())
    ours, _, _ = lightning(AmpcPrecision(device="cpu", plan=path))
    assert torch.equal(ours, want)
    acc, _, _ = accelerated(path, mixed_precision="no")
    assert torch.equal(acc, want)


def test_what_contradicts_the_plan_is_refused_before_training():
    with pytest.raises(ValueError, match=r"^AmpcPrecision: the plan chooses master_weights, "
                                         r"recompute; pass the plan alone"):
        AmpcPrecision(device="cpu", plan=plan(), recompute="net.0", master_weights=True)
    with pytest.raises(ValueError, match=r"the plan trains in a bf16 region; dtype is "
                                         r"torch.float16"):
        AmpcPrecision("16-mixed", "cpu", plan=plan())
    with pytest.raises(TypeError, match=r"^AmpcPrecision: plan must be an "
                                        r"ampc.autoprecision.Plan or the path"):
        AmpcPrecision(device="cpu", plan=3)
    with pytest.raises(ValueError, match=r"use_ampc: the plan chooses compress"):
        AcceleratorState._reset_state(True)
        use_ampc(accelerate.Accelerator(mixed_precision="bf16", cpu=True), plan=plan(),
                 compress="0")
    # at fit's start, before a step: the lean state needs ampc's optimizer
    model = Model(optimizer=torch.optim.AdamW)
    with pytest.raises(TypeError, match=r"the plan's state is 'lean' with gradients freed, "
                                        r"which needs an ampc.optim optimizer; got AdamW"):
        lightning(AmpcPrecision(device="cpu", plan=plan()), model)
    assert model.net[0].weight.dtype == torch.float32 and not model.losses
    with pytest.raises(ValueError, match=r"the plan sets up one optimizer; "
                                         r"configure_optimizers made 2"):
        lightning(AmpcPrecision(device="cpu", plan=plan()), Model(n_optimizers=2))
    # gradients freed in the backward leave nothing to clip
    with pytest.raises(ValueError, match=r"gradient_clip_val=1.0\) would find none"):
        lightning(AmpcPrecision(device="cpu", plan=plan()), gradient_clip_val=1.0)


def test_a_plan_of_another_model_is_refused_by_module_name():
    with pytest.raises(ValueError, match=r"the plan names module 'encoder.0', which neither "
                                         r"the model \(Model\) nor any module inside it has"):
        lightning(AmpcPrecision(device="cpu", plan=plan(first="encoder.0")))


@pytest.mark.parametrize("state, grads_freed", [("lean", True), ("fp32", False)])
def test_fabric_trains_as_plan_prepare_by_hand(state, grads_freed):
    from lightning.fabric import Fabric
    from ampc.integrations.lightning import AmpcFabricPrecision
    p = plan(state, grads_freed)
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[AmpcFabricPrecision(plan=p)])
    net = _net()
    net, opt = p.prepare_state(net, ampc.optim.AdamW(net.parameters(), lr=1e-2))
    net, opt = fabric.setup(net, opt)
    losses = []
    for x, y in _loader():
        opt.zero_grad()
        loss = nn.functional.mse_loss(net(x).float(), y)
        fabric.backward(loss)
        opt.step()
        losses.append(loss.detach())
    assert torch.equal(torch.stack(losses), by_hand(p))


def test_fabric_refuses_a_plan_whose_state_was_not_made_before_setup():
    from lightning.fabric import Fabric
    from ampc.integrations.lightning import AmpcFabricPrecision
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[AmpcFabricPrecision(plan=plan())])
    net = _net()
    opt = ampc.optim.AdamW(net.parameters(), lr=1e-2)
    before = [q.clone() for q in net.parameters()]
    with pytest.raises(ValueError, match=r"AmpcFabricPrecision\(plan=...\): the plan keeps the "
                                         r"lean state \(bf16 weights\) and frees each gradient .*"
                                         r"plan.prepare_state\(model, optimizer\) before fabric"):
        fabric.setup(net, opt)
    assert all(torch.equal(a, b) for a, b in zip(before, net.parameters()))
