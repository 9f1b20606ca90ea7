"""ampc's Lightning plugin in Lightning's own training loop, against Lightning's built-in torch
mixed precision and against the same steps written out by hand with ampc (CPU, small MLP)."""
import functools

import pytest
import torch
from torch import nn

from integration_helpers import need, param_bytes, regression_data, state_bytes

L = need("lightning.pytorch")
lightning_fabric = need("lightning.fabric")
Fabric, FabricMixedPrecision = lightning_fabric.Fabric, lightning_fabric.plugins.MixedPrecision

import ampc  # noqa: E402
from ampc.integrations.lightning import AmpcFabricPrecision, AmpcPrecision  # noqa: E402

BATCH = 8
INF_BATCH = 2          # the batch whose loss is made inf in the runs with a planted overflow


def _net(outputs=4):
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.LayerNorm(32), nn.Linear(32, outputs))


class Model(L.LightningModule):
    def __init__(self, optimizer="ampc", plant_inf=False, seed=0, outputs=4):
        super().__init__()
        torch.manual_seed(seed)
        self.net = _net(outputs)
        self.optimizer, self.plant_inf = optimizer, plant_inf
        self.losses = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x).float(), y)
        if self.plant_inf and self.current_epoch == 0 and batch_idx == INF_BATCH:
            loss = loss * float("inf")
        self.losses.append(loss.detach().clone())
        return loss

    def configure_optimizers(self):
        params = self.parameters()
        if self.optimizer == "ampc":
            return ampc.optim.AdamW(params, lr=1e-2)
        if self.optimizer == "lean":    # bf16 weights written by stochastic rounding, no master
            return ampc.optim.AdamW(params, lr=1e-2, state="lean")
        if self.optimizer == "fused":
            return torch.optim.AdamW(params, lr=1e-2, fused=True)
        return torch.optim.AdamW(params, lr=1e-2, foreach=False)


def _loader(outputs=4):
    x, y = regression_data(outputs=outputs)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=BATCH)


def _torch_fp16():
    # Lightning's built-in fp16 AMP (torch.autocast, torch.amp.GradScaler); on the CPU
    # precision="16-mixed" turns into bf16-mixed, so the plugin is spelled out
    return L.plugins.MixedPrecision("16-mixed", "cpu")


def _trainer(max_epochs=1, **kw):
    return L.Trainer(accelerator="cpu", devices=1, max_epochs=max_epochs, logger=False,
                     enable_checkpointing=False, enable_progress_bar=False,
                     enable_model_summary=False, num_sanity_val_steps=0, **kw)


def _fit(model, max_epochs=1, ckpt_path=None, outputs=4, **kw):
    trainer = _trainer(max_epochs, **kw)
    trainer.fit(model, _loader(outputs), ckpt_path=ckpt_path)
    return torch.stack(model.losses), trainer


def _by_hand(dtype, clip=None, plant_inf=False, scaler=None):
    """The same steps as a plain loop: ampc.autocast, ampc.GradScaler, ampc.optim.AdamW."""
    torch.manual_seed(0)
    net = _net()
    opt = ampc.optim.AdamW(net.parameters(), lr=1e-2)
    losses = []
    for i, (x, y) in enumerate(_loader()):
        opt.zero_grad()
        with ampc.autocast("cpu", dtype=dtype, cache_enabled=False):
            loss = nn.functional.mse_loss(net(x).float(), y)
        if plant_inf and i == INF_BATCH:
            loss = loss * float("inf")
        losses.append(loss.detach().clone())
        if scaler is None:
            loss.backward()
            if clip:
                torch.nn.utils.clip_grad_norm_(net.parameters(), clip)
            opt.step()
        else:
            scaler.scale(loss).backward()
            if clip:
                scaler.clip_grad_norm_(opt, clip)
            scaler.step(opt)
            scaler.update()
    return torch.stack(losses), net


def test_bf16_same_losses_as_lightning_bf16_mixed():
    ours, _ = _fit(Model("ampc"), plugins=[AmpcPrecision("bf16-mixed", "cpu")])
    theirs, _ = _fit(Model("fused"), precision="bf16-mixed")
    assert torch.equal(ours, theirs), (ours, theirs)      # same math: bit for bit


def test_fp16_skips_the_planted_inf_step_as_lightning_16_mixed():
    ours, t_ours = _fit(Model("ampc", plant_inf=True), plugins=[AmpcPrecision("16-mixed", "cpu")])
    theirs, t_theirs = _fit(Model("fused", plant_inf=True), plugins=[_torch_fp16()])
    assert torch.isinf(ours[INF_BATCH]) and torch.isinf(theirs[INF_BATCH])
    assert torch.equal(ours, theirs), (ours, theirs)
    ours_scaler = t_ours.precision_plugin.scaler
    assert isinstance(ours_scaler, ampc.GradScaler)
    assert int(ours_scaler.skipped_steps()) == 1
    assert ours_scaler.get_scale() == t_theirs.precision_plugin.scaler.get_scale() == 2.0 ** 15
    for a, b in zip(t_ours.lightning_module.parameters(), t_theirs.lightning_module.parameters()):
        assert torch.equal(a, b)


def test_static_scaler_keeps_its_scale():
    plugin = AmpcPrecision("16-mixed", "cpu", dynamic=False, init_scale=1024.0)
    _fit(Model("ampc", plant_inf=True), plugins=[plugin])
    assert not plugin.scaler.is_dynamic()
    assert plugin.scaler.get_scale() == 1024.0 and int(plugin.scaler.skipped_steps()) == 1


def test_fp16_clipping_folded_where_lightning_refuses():
    # Lightning's own plugin refuses to clip with an optimizer that unscales in its step
    with pytest.raises(RuntimeError, match="does not allow for gradient clipping"):
        _fit(Model("ampc"), plugins=[_torch_fp16()], gradient_clip_val=0.05)
    ours, trainer = _fit(Model("ampc", plant_inf=True), plugins=[AmpcPrecision("16-mixed", "cpu")],
                         gradient_clip_val=0.05)
    # the same steps by hand: bit for bit
    ref, net = _by_hand(torch.float16, clip=0.05, plant_inf=True,
                        scaler=ampc.GradScaler("cpu"))
    assert torch.equal(ours, ref), (ours, ref)
    for a, b in zip(trainer.lightning_module.net.parameters(), net.parameters()):
        assert torch.equal(a, b)
    # and Lightning's own unscale-then-clip path with torch's AdamW: the same training up to
    # the two AdamW implementations' rounding (fused vs. for-loop, a few fp32 ulps per step)
    theirs, _ = _fit(Model("plain", plant_inf=True), plugins=[_torch_fp16()],
                     gradient_clip_val=0.05)
    finite = torch.isfinite(ours)
    torch.testing.assert_close(ours[finite], theirs[finite], rtol=1e-3, atol=1e-4)
    unclipped, _ = _fit(Model("ampc", plant_inf=True), plugins=[AmpcPrecision("16-mixed", "cpu")])
    assert not torch.equal(ours, unclipped)       # the clip did something


class ManualModel(Model):
    """Manual optimization: the step hands clip_gradients Lightning's optimizer wrapper."""

    def __init__(self):
        super().__init__("ampc")
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        opt.zero_grad()
        loss = super().training_step(batch, batch_idx)
        self.manual_backward(loss)
        self.clip_gradients(opt, gradient_clip_val=0.05, gradient_clip_algorithm="norm")
        opt.step()


def test_fp16_clipping_under_manual_optimization_as_by_hand():
    # the scaler sees one optimizer, not the wrapper in clip_gradients and the optimizer in
    # the step (that unscaled twice and lost the clip)
    ours, trainer = _fit(ManualModel(), plugins=[AmpcPrecision("16-mixed", "cpu")])
    ref, net = _by_hand(torch.float16, clip=0.05, scaler=ampc.GradScaler("cpu"))
    assert torch.equal(ours, ref), (ours, ref)
    for a, b in zip(trainer.lightning_module.net.parameters(), net.parameters()):
        assert torch.equal(a, b)


def test_clip_by_value_unscales_first():
    ours, _ = _fit(Model("ampc"), plugins=[AmpcPrecision("16-mixed", "cpu")],
                   gradient_clip_val=0.01, gradient_clip_algorithm="value")
    theirs, _ = _fit(Model("plain"), plugins=[_torch_fp16()],
                     gradient_clip_val=0.01, gradient_clip_algorithm="value")
    torch.testing.assert_close(ours, theirs, rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("precision,master,fp8,optimizer", [("16-mixed", False, False, "ampc"),
                                                            ("bf16-mixed", True, False, "ampc"),
                                                            ("bf16-mixed", True, False, "lean"),
                                                            ("bf16-mixed", False, True, "ampc")])
def test_resume_from_checkpoint_equals_uninterrupted(tmp_path, precision, master, fp8, optimizer):
    def plugin():
        scaler = None
        if precision == "16-mixed":     # a short growth interval: the scale moves every few steps
            scaler = ampc.GradScaler("cpu", init_scale=2.0 ** 12, growth_interval=2)
        recipe = ampc.fp8.DelayedScaling(amax_history_len=4) if fp8 else None
        return AmpcPrecision(precision, "cpu", scaler=scaler, master_weights=master, fp8=recipe)

    plant = precision == "16-mixed"     # bf16 has no scaler to skip an overflow
    outputs = 16 if fp8 else 4          # FP8 GEMMs: multiples of 16
    fit = functools.partial(_fit, outputs=outputs)
    whole, t_whole = fit(Model(optimizer, plant_inf=plant, outputs=outputs), max_epochs=2,
                         plugins=[plugin()])
    first, t_first = fit(Model(optimizer, plant_inf=plant, outputs=outputs), max_epochs=1,
                         plugins=[plugin()])
    path = tmp_path / "epoch1.ckpt"
    t_first.save_checkpoint(path)
    checkpoint = torch.load(path, weights_only=False)
    if precision == "16-mixed":
        assert checkpoint["AmpcPrecision"]["_skipped_steps"] == 1
    if fp8:     # the FP8 scaling state beside the model's weights, which stay plain
        assert "net.0.fp8_fwd_scale" in checkpoint["AmpcPrecision.fp8_state"]
        assert not any("fp8" in k for k in checkpoint["state_dict"])
        assert not torch.equal(checkpoint["AmpcPrecision.fp8_state"]["net.0.fp8_fwd_scale"],
                               torch.ones(2))
    # a differently initialized model: everything must come from the checkpoint
    rest, t_rest = fit(Model(optimizer, plant_inf=plant, seed=1, outputs=outputs), max_epochs=2,
                       ckpt_path=str(path), plugins=[plugin()])
    assert torch.equal(torch.cat([first, rest]), whole)
    for a, b in zip(t_rest.lightning_module.parameters(), t_whole.lightning_module.parameters()):
        assert a.dtype == b.dtype and torch.equal(a, b)
    if fp8:     # the FP8 scaling state came back too
        assert torch.equal(t_rest.lightning_module.net[0].fp8_fwd_scale,
                           t_whole.lightning_module.net[0].fp8_fwd_scale)
    s_rest, s_whole = t_rest.precision_plugin.scaler, t_whole.precision_plugin.scaler
    if s_whole is not None:
        assert s_rest.state_dict() == s_whole.state_dict()


def test_master_weights_memory_against_lightning_bf16_mixed():
    plugin = AmpcPrecision("bf16-mixed", "cpu", master_weights=True)
    ours, t_ours = _fit(Model("ampc"), plugins=[plugin])
    theirs, t_theirs = _fit(Model("fused"), precision="bf16-mixed")
    m_ours, m_theirs = t_ours.lightning_module, t_theirs.lightning_module
    o_ours, o_theirs = t_ours.optimizers[0], t_theirs.optimizers[0]
    linear = m_ours.net[0].weight
    assert linear.dtype == torch.bfloat16 and m_ours.net[2].weight.dtype == torch.float32
    assert o_ours.state[linear]["master"].dtype == torch.float32
    # Lightning's bf16-mixed: fp32 weights (they are the masters), fp32 grads, fp32 moments,
    # plus a bf16 copy of each weight that autocast makes in every forward. Master weights:
    # bf16 weights and grads, fp32 masters and moments, no per-forward copy.
    w_o, w_t = param_bytes(m_ours.parameters()), param_bytes(m_theirs.parameters())
    s_o, s_t = state_bytes(o_ours), state_bytes(o_theirs)
    copies = sum(p.numel() * 2 for p in m_theirs.parameters() if p.dim() > 1)
    print(f"\nmaster weights: weights {w_o} B + grads {w_o} B + optimizer state {s_o} B = "
          f"{2 * w_o + s_o} B; Lightning bf16-mixed: weights {w_t} B + grads {w_t} B + "
          f"optimizer state {s_t} B + autocast weight copies {copies} B = "
          f"{2 * w_t + s_t + copies} B")
    assert 2 * w_o + s_o < 2 * w_t + s_t + copies
    assert w_o < w_t
    # the master-weight run trains: same start, losses close to the fp32-weight run's
    assert torch.equal(ours[0], theirs[0])
    torch.testing.assert_close(ours, theirs, rtol=5e-2, atol=5e-2)


def test_lean_state_through_master_weights():
    # an optimizer made with state="lean" in configure_optimizers: master_weights=True casts
    # the model, the optimizer keeps no fp32 copy, and the run follows the master-weight run
    lean, t_lean = _fit(Model("lean"), plugins=[AmpcPrecision("bf16-mixed", "cpu",
                                                               master_weights=True)])
    master, t_master = _fit(Model("ampc"), plugins=[AmpcPrecision("bf16-mixed", "cpu",
                                                                   master_weights=True)])
    net, opt = t_lean.lightning_module.net, t_lean.optimizers[0]
    assert net[0].weight.dtype == torch.bfloat16 and net[2].weight.dtype == torch.float32
    assert all("master" not in s for s in opt.state.values()) and len(opt.state) == 6
    assert state_bytes(opt) < state_bytes(t_master.optimizers[0])
    assert torch.equal(lean[0], master[0])
    torch.testing.assert_close(lean, master, rtol=5e-2, atol=5e-2)


def test_fp16_master_weights_with_clipping_as_by_hand():
    # fp16 weights and gradients: unscale_ refuses fp16 gradients, the folded clip takes them
    plugin = AmpcPrecision("16-mixed", "cpu", master_weights=True)
    ours, trainer = _fit(Model("ampc", plant_inf=True), plugins=[plugin], gradient_clip_val=0.05)
    assert trainer.lightning_module.net[0].weight.dtype == torch.float16
    torch.manual_seed(0)
    net, opt = ampc.prepare(_net(), ampc.optim.AdamW, torch.float16, lr=1e-2)
    scaler = ampc.GradScaler("cpu")
    ref = []
    for i, (x, y) in enumerate(_loader()):
        opt.zero_grad()
        with ampc.autocast("cpu", dtype=torch.float16, cache_enabled=False):
            loss = nn.functional.mse_loss(net(x).float(), y)
        if i == INF_BATCH:
            loss = loss * float("inf")
        ref.append(loss.detach())
        scaler.scale(loss).backward()
        scaler.clip_grad_norm_(opt, 0.05)
        scaler.step(opt)
        scaler.update()
    assert torch.equal(ours, torch.stack(ref)), (ours, ref)
    assert int(plugin.scaler.skipped_steps()) == 1
    for a, b in zip(trainer.lightning_module.net.parameters(), net.parameters()):
        assert torch.equal(a, b)


def test_master_weights_need_ampc_optimizer():
    with pytest.raises(TypeError,
                       match="AmpcPrecision\\(master_weights=True\\): optimizer 0 is AdamW"):
        _fit(Model("plain"), plugins=[AmpcPrecision("bf16-mixed", "cpu", master_weights=True)])


def test_edited_policy_applies_in_the_forward():
    seen = []
    model = Model("ampc")
    model.net[3].register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    _fit(model, plugins=[AmpcPrecision("bf16-mixed", "cpu", policy={"linear": "fp32"})])
    assert seen and set(seen) == {torch.float32}
    seen.clear()
    model = Model("ampc")
    model.net[3].register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    _fit(model, plugins=[AmpcPrecision("bf16-mixed", "cpu")])
    assert set(seen) == {torch.bfloat16}


def test_fp8_converts_linears_and_trains_as_by_hand():
    recipe = ampc.fp8.Float8CurrentScaling()
    # FP8 GEMMs take dimensions that are multiples of 16
    ours, trainer = _fit(Model("ampc", outputs=16), outputs=16,
                         plugins=[AmpcPrecision("bf16-mixed", "cpu", fp8=recipe)])
    net = trainer.lightning_module.net
    assert isinstance(net[0], ampc.fp8.Linear) and isinstance(net[3], ampc.fp8.Linear)
    torch.manual_seed(0)
    ref_net = ampc.fp8.convert(_net(16))
    opt = ampc.optim.AdamW(ref_net.parameters(), lr=1e-2)
    ref = []
    for x, y in _loader(16):
        opt.zero_grad()
        with ampc.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False), \
                ampc.fp8.autocast(recipe=recipe):
            loss = nn.functional.mse_loss(ref_net(x).float(), y)
        ref.append(loss.detach())
        loss.backward()
        opt.step()
    assert torch.equal(ours, torch.stack(ref))


def test_bad_arguments():
    with pytest.raises(ValueError, match="AmpcPrecision: precision must be"):
        AmpcPrecision("16-true")
    with pytest.raises(ValueError, match="needs no loss scaling"):
        AmpcPrecision("bf16-mixed", "cpu", scaler=ampc.GradScaler("cpu"))
    with pytest.raises(TypeError, match="fp8 must be"):
        AmpcPrecision("bf16-mixed", "cpu", fp8="yes")


def test_lightning_fsdp_refuses_other_precision_plugins():
    # Lightning's FSDP (FSDP1) strategy takes only its own FSDPPrecision; FSDP2 goes through
    # ModelParallelStrategy, which takes any plugin (see docs/frameworks.md)
    with pytest.raises(TypeError, match="FSDP strategy can only work with the `FSDPPrecision`"):
        L.strategies.FSDPStrategy(precision_plugin=AmpcPrecision("bf16-mixed", "cpu"))


def _fabric_run(plugin=None, precision=None, clip=None, optimizer="ampc", plant_inf=False):
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[plugin] if plugin else None,
                    precision=precision)
    torch.manual_seed(0)
    net = _net()
    opt = (ampc.optim.AdamW(net.parameters(), lr=1e-2) if optimizer == "ampc"
           else torch.optim.AdamW(net.parameters(), lr=1e-2, foreach=False))
    net, opt = fabric.setup(net, opt)
    losses = []
    for i, (x, y) in enumerate(_loader()):
        opt.zero_grad()
        loss = nn.functional.mse_loss(net(x).float(), y)
        if plant_inf and i == INF_BATCH:
            loss = loss * float("inf")
        losses.append(loss.detach().clone())
        fabric.backward(loss)
        if clip:
            fabric.clip_gradients(net, opt, max_norm=clip, error_if_nonfinite=False)
        opt.step()
    return torch.stack(losses)


def test_fabric_bf16_and_fp16_with_clipping():
    ours = _fabric_run(AmpcFabricPrecision("bf16-mixed", "cpu"))
    theirs = _fabric_run(precision="bf16-mixed", optimizer="ampc")
    assert torch.equal(ours, theirs)
    # fp16 with clipping: Fabric unscales through the plugin, then clips; the same losses
    # as Fabric's own plugin with torch's for-loop AdamW (which refuses ampc's optimizer)
    plugin = AmpcFabricPrecision("16-mixed", "cpu")
    ours = _fabric_run(plugin, clip=0.05, plant_inf=True)
    theirs = _fabric_run(FabricMixedPrecision("16-mixed", "cpu"), clip=0.05, optimizer="plain",
                         plant_inf=True)
    assert torch.isinf(ours[INF_BATCH]) and int(plugin.scaler.skipped_steps()) == 1
    assert torch.equal(ours, theirs), (ours, theirs)


def test_plugins_are_the_frameworks_mixed_precision():
    # Lightning's code that asks for MixedPrecision (the throughput monitor's dtype, old
    # checkpoints' scaler key) sees ampc's plugins as what they are
    plugin = AmpcPrecision("16-mixed", "cpu")
    assert isinstance(plugin, L.plugins.MixedPrecision)
    assert isinstance(AmpcFabricPrecision("16-mixed", "cpu"), FabricMixedPrecision)
    from lightning.pytorch.callbacks.throughput_monitor import _plugin_to_compute_dtype
    assert _plugin_to_compute_dtype(plugin) == torch.float16


class LBFGSModel(Model):
    def configure_optimizers(self):
        return torch.optim.LBFGS(self.parameters())


def test_fp16_refuses_lbfgs_as_lightning():
    # the refusal is Lightning's own (LBFGS re-evaluates the closure)
    from lightning.pytorch.utilities.exceptions import MisconfigurationException
    with pytest.raises(MisconfigurationException, match="LBFGS optimizer are not compatible"):
        _fit(LBFGSModel(), plugins=[AmpcPrecision("16-mixed", "cpu")])


class ManualValueClipModel(ManualModel):
    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        opt.zero_grad()
        loss = Model.training_step(self, batch, batch_idx)
        self.manual_backward(loss)
        self.clip_gradients(opt, gradient_clip_val=0.01, gradient_clip_algorithm="value")
        opt.step()


def test_fp16_clip_by_value_under_manual_optimization_as_by_hand():
    # manual optimization clips before the step: the gradients are unscaled there first
    ours, trainer = _fit(ManualValueClipModel(), plugins=[AmpcPrecision("16-mixed", "cpu")])
    torch.manual_seed(0)
    net = _net()
    opt = ampc.optim.AdamW(net.parameters(), lr=1e-2)
    scaler = ampc.GradScaler("cpu")
    ref = []
    for x, y in _loader():
        opt.zero_grad()
        with ampc.autocast("cpu", dtype=torch.float16, cache_enabled=False):
            loss = nn.functional.mse_loss(net(x).float(), y)
        ref.append(loss.detach())
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_value_(net.parameters(), 0.01)
        scaler.step(opt)
        scaler.update()
    assert torch.equal(ours, torch.stack(ref)), (ours, ref)
    for a, b in zip(trainer.lightning_module.net.parameters(), net.parameters()):
        assert torch.equal(a, b)


def test_fabric_fp16_refuses_lbfgs_as_fabric():
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[AmpcFabricPrecision("16-mixed", "cpu")])
    net = _net()
    net, opt = fabric.setup(net, torch.optim.LBFGS(net.parameters()))
    with pytest.raises(TypeError, match="LBFGS optimizer are not compatible"):
        opt.step(lambda: 0.0)


class ManualValueClipPlainModel(ManualValueClipModel):
    def __init__(self):
        super().__init__()
        self.optimizer = "plain"


def test_fp16_clip_by_value_under_manual_optimization_never_clips_scaled_gradients():
    # an optimizer that cannot unscale in its step is unscaled for the clip, and Lightning's
    # step would unscale it again: refused, not a clip of the scaled gradients (which
    # Lightning's own MixedPrecision does silently)
    with pytest.raises(RuntimeError, match="unscale_\\(\\) has already been called"):
        _fit(ManualValueClipPlainModel(), plugins=[AmpcPrecision("16-mixed", "cpu")])
