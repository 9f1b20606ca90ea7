"""ampc's AdamW(step_in_backward=True) inside the frameworks' own loops: Lightning's Trainer
and Fabric, Accelerate. Each trains bit for bit as the same optimizer stepping after the
backward, gradient accumulation included (the micro-batches the framework accumulates keep
their gradients, the last steps on the sum), and clipping, which needs gradients that the
step in the backward has freed, is refused."""
import pytest
import torch
from torch import nn

from integration_helpers import need, regression_data, regression_step

L = need("lightning.pytorch")
lightning_fabric = need("lightning.fabric")
accelerate = need("accelerate")
from accelerate.state import AcceleratorState, GradientState  # noqa: E402

import ampc  # noqa: E402
from ampc.integrations.accelerate import use_ampc  # noqa: E402
from ampc.integrations.lightning import AmpcFabricPrecision, AmpcPrecision  # noqa: E402


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 4))


def _loader():
    x, y = regression_data()            # 48 examples: 6 batches of 8
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8)


class Model(L.LightningModule):
    def __init__(self, in_backward):
        super().__init__()
        self.net = _net()
        self.in_backward = in_backward
        self.losses = []

    def training_step(self, batch, batch_idx):
        return regression_step(self, batch)

    def configure_optimizers(self):
        return ampc.optim.AdamW(self.parameters(), lr=1e-2,
                                step_in_backward=self.in_backward)


def trainer_losses(in_backward, master_weights=False, **trainer_options):
    model = Model(in_backward)
    plugin = AmpcPrecision("bf16-mixed", "cpu", master_weights=master_weights)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=2, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0,
                        plugins=[plugin], **trainer_options)
    trainer.fit(model, _loader())
    return torch.stack(model.losses), model


@pytest.mark.parametrize("accumulate,master_weights", [(1, False), (2, False), (4, False),
                                                      (2, True)])
def test_lightning_trainer_steps_in_the_backward_as_after_it(accumulate, master_weights):
    ours, model = trainer_losses(True, master_weights, accumulate_grad_batches=accumulate)
    after, _ = trainer_losses(False, master_weights, accumulate_grad_batches=accumulate)
    assert torch.equal(ours, after), (ours, after)
    assert model.net[0].weight.dtype == (torch.bfloat16 if master_weights else torch.float32)
    if accumulate > 1:      # it did accumulate: not the run that steps every batch
        every, _ = trainer_losses(True, master_weights)
        assert not torch.equal(ours, every)


def test_lightning_trainer_refuses_clipping_before_a_weight_changes():
    with pytest.raises(ValueError, match=r"^AmpcPrecision: optimizer 0 steps each parameter "
                                         r"in the backward.*gradient_clip_val=1.0"):
        trainer_losses(True, gradient_clip_val=1.0)
    model = Model(True)
    before = [p.detach().clone() for p in model.parameters()]
    trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, gradient_clip_val=1.0,
                        plugins=[AmpcPrecision("bf16-mixed", "cpu")])
    with pytest.raises(ValueError, match="step_in_backward=False"):
        trainer.fit(model, _loader())
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert not model.losses                          # refused before the first step


def fabric_losses(in_backward, accumulate=1, clip=False):
    fabric = lightning_fabric.Fabric(accelerator="cpu", devices=1,
                                     plugins=[AmpcFabricPrecision("bf16-mixed", "cpu")])
    net = _net()
    opt = ampc.optim.AdamW(net.parameters(), lr=1e-2, step_in_backward=in_backward)
    net, opt = fabric.setup(net, opt)
    losses = []
    for i, (x, y) in enumerate(_loader()):
        last = (i + 1) % accumulate == 0
        loss = nn.functional.mse_loss(net(x).float(), y) / accumulate
        with opt.accumulating() if not last else torch.enable_grad():
            fabric.backward(loss)
        if last:
            if clip:
                fabric.clip_gradients(net, opt, max_norm=1.0)
            opt.step()
            opt.zero_grad()
        losses.append(loss.detach().clone())
    return torch.stack(losses)


@pytest.mark.parametrize("accumulate", [1, 3])
def test_fabric_steps_in_the_backward_as_after_it(accumulate):
    ours = fabric_losses(True, accumulate)
    assert torch.equal(ours, fabric_losses(False, accumulate))


def test_fabric_refuses_clipping():
    with pytest.raises(RuntimeError, match=r"^AmpcFabricPrecision: .*step_in_backward=True.*"
                                           r"nothing left to clip"):
        fabric_losses(True, clip=True)


def accelerate_losses(in_backward, accumulate=1, clip=None):
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    acc = use_ampc(accelerate.Accelerator(mixed_precision="bf16", cpu=True,
                                          gradient_accumulation_steps=accumulate))
    net = _net()
    opt = ampc.optim.AdamW(net.parameters(), lr=1e-2, step_in_backward=in_backward)
    net, opt, loader = acc.prepare(net, opt, _loader())
    losses = []
    for x, y in loader:
        with acc.accumulate(net):
            loss = nn.functional.mse_loss(net(x).float(), y)
            acc.backward(loss)
            if clip and acc.sync_gradients:
                getattr(acc, clip)(net.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
        losses.append(loss.detach().clone())
    return torch.stack(losses)


@pytest.mark.parametrize("accumulate", [1, 2, 3])
def test_accelerate_steps_in_the_backward_as_after_it(accumulate):
    ours = accelerate_losses(True, accumulate)
    assert torch.equal(ours, accelerate_losses(False, accumulate))
    if accumulate > 1:
        assert not torch.equal(ours, accelerate_losses(True))


@pytest.mark.parametrize("clip", ["clip_grad_norm_", "clip_grad_value_"])
def test_accelerate_refuses_clipping(clip):
    with pytest.raises(RuntimeError, match=rf"^ampc.integrations.accelerate.use_ampc: "
                                           rf"accelerator.{clip}: .*nothing is left to clip"):
        accelerate_losses(True, clip=clip)
