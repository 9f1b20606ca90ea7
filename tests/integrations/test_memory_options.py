"""compress=, recompute= and sliced_head= of the framework integrations (Lightning's Trainer
and Fabric, Accelerate): the modules named keep their saved activations in 8 bits, recompute
in the backward, or defer their logits to the loss, exactly as ampc.memory set by hand on the
model before the framework gets it."""
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

# wide enough that the second Linear's saved input (8 x 1024) is coded (ampc.memory's
# min_numel is 4096)
WIDE = 1024
COMPRESS, RECOMPUTE = "net.2", ["net.0", "net.1"]


def _net():
    return nn.Sequential(nn.Linear(16, WIDE), nn.GELU(), nn.Linear(WIDE, 4))


def _loader():
    x, y = regression_data()
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8)


class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = _net()
        self.losses = []

    def training_step(self, batch, batch_idx):
        return regression_step(self, batch)

    def configure_optimizers(self):
        return ampc.optim.AdamW(self.parameters(), lr=1e-2)


def by_hand(model, compress=True, recompute=True):
    """ampc.memory set on ``model`` directly (names without the "net." of the wrapper when
    ``model`` is the Sequential itself)."""
    strip = (lambda n: n) if hasattr(model, "net") else (lambda n: n.removeprefix("net."))
    if compress:
        ampc.memory.compress(model, strip(COMPRESS), "8bit")
    if recompute:
        ampc.memory.recompute(model, [strip(n) for n in RECOMPUTE])
    return model


def lightning_losses(plugin, model=None):
    model = model or Model()
    trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0, plugins=[plugin])
    trainer.fit(model, _loader())
    return torch.stack(model.losses), model


def test_lightning_trainer_sets_them_as_by_hand():
    ours, model = lightning_losses(AmpcPrecision("bf16-mixed", "cpu", compress=COMPRESS,
                                                 recompute=RECOMPUTE))
    assert ampc.memory.compressed(model) == {COMPRESS: "8bit"}
    assert ampc.memory.recomputed(model) == RECOMPUTE
    hand, _ = lightning_losses(AmpcPrecision("bf16-mixed", "cpu"), by_hand(Model()))
    assert torch.equal(ours, hand), (ours, hand)
    plain, _ = lightning_losses(AmpcPrecision("bf16-mixed", "cpu"))
    assert not torch.equal(ours, plain)            # the 8-bit codes do change the gradients
    # recomputing alone changes nothing: the same bits as saving
    again, _ = lightning_losses(AmpcPrecision("bf16-mixed", "cpu", recompute=RECOMPUTE))
    assert torch.equal(again, plain)


def loop(net, opt, loader, backward):
    """The framework's own loop: its ``backward``; the losses."""
    losses = []
    for x, y in loader:
        opt.zero_grad()
        loss = nn.functional.mse_loss(net(x).float(), y)
        backward(loss)
        opt.step()
        losses.append(loss.detach().clone())
    return torch.stack(losses)


def fabric_losses(plugin, net=None):
    fabric = lightning_fabric.Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    torch.manual_seed(0)
    net = net or _net()
    opt = ampc.optim.AdamW(net.parameters(), lr=1e-2)
    net, opt = fabric.setup(net, opt)
    return loop(net, opt, _loader(), fabric.backward), net


def test_fabric_sets_them_as_by_hand():
    names = dict(compress=COMPRESS.removeprefix("net."),
                 recompute=[n.removeprefix("net.") for n in RECOMPUTE])
    ours, net = fabric_losses(AmpcFabricPrecision("bf16-mixed", "cpu", **names))
    torch.manual_seed(0)
    hand, _ = fabric_losses(AmpcFabricPrecision("bf16-mixed", "cpu"), by_hand(_net()))
    assert torch.equal(ours, hand), (ours, hand)
    assert ampc.memory.compressed(net.module) == {"2": "8bit"}


def _accelerator():
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    return accelerate.Accelerator(mixed_precision="bf16", cpu=True)


def accelerate_losses(acc, net=None):
    torch.manual_seed(0)
    net = net or _net()
    opt = ampc.optim.AdamW(net.parameters(), lr=1e-2)
    net, opt, loader = acc.prepare(net, opt, _loader())
    return loop(net, opt, loader, acc.backward), net


def test_accelerate_sets_them_as_by_hand():
    names = dict(compress=COMPRESS.removeprefix("net."),
                 recompute=[n.removeprefix("net.") for n in RECOMPUTE])
    ours, net = accelerate_losses(use_ampc(_accelerator(), **names))
    torch.manual_seed(0)
    hand, _ = accelerate_losses(use_ampc(_accelerator()), by_hand(_net()))
    assert torch.equal(ours, hand), (ours, hand)
    assert ampc.memory.recomputed(net) == ["0", "1"]


@pytest.mark.parametrize("arg", ["compress", "recompute", "sliced_head"])
@pytest.mark.parametrize("bad", [3, [], ["net.0", 2], ""])
def test_bad_names_are_refused_naming_the_integration_and_the_argument(arg, bad):
    with pytest.raises(TypeError, match=rf"^AmpcPrecision: {arg} must be a module name"):
        AmpcPrecision("bf16-mixed", "cpu", **{arg: bad})
    with pytest.raises(TypeError, match=rf"^ampc.integrations.accelerate.use_ampc: {arg} must"):
        use_ampc(_accelerator(), **{arg: bad})


def test_a_name_the_model_lacks_is_refused_when_the_model_is_handed_over():
    plugin = AmpcPrecision("bf16-mixed", "cpu", recompute="net.9")
    with pytest.raises(ValueError, match=r"ampc.memory.recompute: .*net\.9"):
        lightning_losses(plugin)


class Classifier(Model):
    """Model with a cross-entropy loss over 4 classes: its last Linear is the head."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x).float(), y.argmax(-1))
        self.losses.append(loss.detach().clone())
        return loss


def test_a_sliced_head_as_by_hand_and_as_the_plain_head():
    ours, model = lightning_losses(AmpcPrecision("bf16-mixed", "cpu", sliced_head="net.2"),
                                   Classifier())
    assert ampc.memory.sliced_heads(model) == ["net.2"]
    by_hand = Classifier()
    ampc.memory.sliced_head(by_hand, "net.2")
    hand, _ = lightning_losses(AmpcPrecision("bf16-mixed", "cpu"), by_hand)
    assert torch.equal(ours, hand), (ours, hand)
    plain, _ = lightning_losses(AmpcPrecision("bf16-mixed", "cpu"), Classifier())
    assert torch.allclose(ours, plain, rtol=2e-2), (ours, plain)   # bf16 matmuls, other sums
    acc = use_ampc(_accelerator(), sliced_head="2")
    torch.manual_seed(0)
    net = _net()
    opt = ampc.optim.AdamW(net.parameters(), lr=1e-2)
    net, opt, loader = acc.prepare(net, opt, _loader())
    x, y = next(iter(loader))
    assert isinstance(net(x), ampc.memory.DeferredLogits)    # Accelerate's fp32 cast kept it
    loss = nn.functional.cross_entropy(net(x), y.argmax(-1))
    acc.backward(loss)
    assert net[2].weight.grad is not None
