"""ampc in Accelerate's loop and under the transformers Trainer, against Accelerate's built-in
torch mixed precision (CPU, small models).

Accelerate does no fp16 mixed precision on the CPU (its fp16 path needs a GPU); the torch
side of the fp16 comparisons switches its GPU path on for the CPU by setting the two
attributes it sets there: ``accelerator.scaler = torch.amp.GradScaler(...)`` and
``accelerator.native_amp = True`` (torch.autocast around the forward)."""
import math

import pytest
import torch
from torch import nn

from integration_helpers import need, param_bytes, regression_data, state_bytes

accelerate = need("accelerate")
transformers = need("transformers")

from accelerate.state import AcceleratorState, GradientState  # noqa: E402

import ampc  # noqa: E402
from ampc.integrations.accelerate import use_ampc  # noqa: E402

INF_STEP = 2
CLIP = 0.05


def _fresh_accelerator(mixed_precision, torch_fp16=False, **kw):
    # Accelerate keeps one process-wide state: start each run from a clean one
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    acc = accelerate.Accelerator(mixed_precision=mixed_precision, cpu=True, **kw)
    if torch_fp16:
        acc.scaler, acc.native_amp = torch.amp.GradScaler("cpu"), True
    return acc


def _net():
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.LayerNorm(32), nn.Linear(32, 4))


def _loader():
    x, y = regression_data()
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8)


def _train(acc, optimizer="ampc", plant_inf=False, clip=None, steps=None, seed=0, state=None):
    """Accelerate's loop; returns (losses, skipped flags, model, optimizer)."""
    torch.manual_seed(seed)
    net = _net()
    opts = {"ampc": lambda p: ampc.optim.AdamW(p, lr=1e-2),
            "lean": lambda p: ampc.optim.AdamW(p, lr=1e-2, state="lean"),
            "fused": lambda p: torch.optim.AdamW(p, lr=1e-2, fused=True)}
    opt = opts[optimizer](net.parameters())
    net, opt, loader = acc.prepare(net, opt, _loader())
    if state is not None:
        acc.load_state(state)
    losses, skipped = [], []
    for i, (x, y) in enumerate(loader):
        if steps is not None and not steps[0] <= i < steps[1]:
            continue
        opt.zero_grad()
        loss = nn.functional.mse_loss(net(x), y)
        if plant_inf and i == INF_STEP:
            loss = loss * float("inf")
        losses.append(loss.detach().clone())
        acc.backward(loss)
        if clip:
            acc.clip_grad_norm_(net.parameters(), clip)
        opt.step()
        skipped.append(acc.optimizer_step_was_skipped)
    return torch.stack(losses), skipped, net, opt


def test_bf16_same_losses_as_accelerate_bf16():
    acc = use_ampc(_fresh_accelerator("bf16"))
    assert type(acc).__name__ == "AmpcAccelerator" and acc.scaler is None
    ours, _, net, _ = _train(acc)
    with acc.autocast():
        assert torch.is_autocast_enabled("cpu")
        assert torch.get_autocast_dtype("cpu") == torch.bfloat16
    theirs, _, _, _ = _train(_fresh_accelerator("bf16"), optimizer="fused")
    assert torch.equal(ours, theirs), (ours, theirs)
    assert net(torch.randn(2, 16)).dtype == torch.float32      # outputs converted, as Accelerate's


def test_fp16_skip_and_clip_as_accelerate_fp16():
    acc = use_ampc(_fresh_accelerator("fp16"))
    assert isinstance(acc.scaler, ampc.GradScaler)
    ours, skipped, _, _ = _train(acc, plant_inf=True, clip=CLIP)
    theirs, t_skipped, _, _ = _train(_fresh_accelerator("fp16", torch_fp16=True), "fused",
                                     plant_inf=True, clip=CLIP)
    # folded clip + ampc's AdamW: the bits of torch's unscale_, clip_grad_norm_ and fused AdamW
    assert torch.equal(ours, theirs), (ours, theirs)
    assert skipped == [i == INF_STEP for i in range(6)]
    # Accelerate's own detection misses a skip made inside a fused optimizer's step
    assert t_skipped == [False] * 6
    assert int(acc.scaler.skipped_steps()) == 1 and acc.scaler.get_scale() == 2.0 ** 15
    unclipped, _, _, _ = _train(use_ampc(_fresh_accelerator("fp16")), plant_inf=True)
    assert not torch.equal(ours, unclipped)


def test_save_state_load_state_equals_uninterrupted(tmp_path):
    def acc():
        return use_ampc(_fresh_accelerator("fp16"),
                        scaler=ampc.GradScaler("cpu", init_scale=2.0 ** 12, growth_interval=2))

    w = acc()
    whole, _, net_whole, _ = _train(w, plant_inf=True, clip=CLIP)
    a = acc()
    first, _, _, _ = _train(a, plant_inf=True, clip=CLIP, steps=(0, 3))
    a.save_state(str(tmp_path / "state"))
    b = acc()
    rest, _, net_rest, _ = _train(b, plant_inf=True, clip=CLIP, steps=(3, 6), seed=1,
                                  state=str(tmp_path / "state"))
    assert torch.equal(torch.cat([first, rest]), whole)
    for p, q in zip(net_rest.parameters(), net_whole.parameters()):
        assert torch.equal(p, q)
    assert b.scaler.state_dict() == w.scaler.state_dict()
    assert int(b.scaler.skipped_steps()) == 1


def test_master_weights_state_and_losses():
    acc = use_ampc(_fresh_accelerator("bf16"), master_weights=True)
    ours, _, net, opt = _train(acc)
    theirs, _, t_net, t_opt = _train(_fresh_accelerator("bf16"), optimizer="fused")
    assert net[0].weight.dtype == torch.bfloat16 and net[2].weight.dtype == torch.float32
    assert opt.optimizer.state[net[0].weight]["master"].dtype == torch.float32
    w, tw = param_bytes(net.parameters()), param_bytes(t_net.parameters())
    s, ts = state_bytes(opt.optimizer), state_bytes(t_opt.optimizer)
    copies = sum(p.numel() * 2 for p in t_net.parameters() if p.dim() > 1)
    print(f"\nAccelerate master weights: weights+grads {2 * w} B, optimizer state {s} B; "
          f"Accelerate bf16: weights+grads {2 * tw} B, optimizer state {ts} B, "
          f"autocast weight copies {copies} B")
    assert 2 * w + s < 2 * tw + ts + copies
    assert torch.equal(ours[0], theirs[0])
    torch.testing.assert_close(ours, theirs, rtol=5e-2, atol=5e-2)


def test_lean_state_through_master_weights(tmp_path):
    # an optimizer made with state="lean": cast like master weights, no fp32 copy kept, and
    # save_state / load_state resume it bit-exactly (its stochastic rounding included)
    acc = use_ampc(_fresh_accelerator("bf16"), master_weights=True)
    lean, _, net, opt = _train(acc, optimizer="lean")
    master, _, _, m_opt = _train(use_ampc(_fresh_accelerator("bf16"), master_weights=True))
    assert net[0].weight.dtype == torch.bfloat16
    assert all("master" not in s for s in opt.optimizer.state.values())
    assert state_bytes(opt.optimizer) < state_bytes(m_opt.optimizer)
    torch.testing.assert_close(lean, master, rtol=5e-2, atol=5e-2)
    a = use_ampc(_fresh_accelerator("bf16"), master_weights=True)
    first, _, _, _ = _train(a, optimizer="lean", steps=(0, 3))
    a.save_state(str(tmp_path / "state"))
    b = use_ampc(_fresh_accelerator("bf16"), master_weights=True)
    rest, _, net_rest, _ = _train(b, optimizer="lean", steps=(3, 6), seed=1,
                                  state=str(tmp_path / "state"))
    whole, _, net_whole, _ = _train(use_ampc(_fresh_accelerator("bf16"), master_weights=True),
                                    optimizer="lean", steps=(0, 6))
    assert torch.equal(torch.cat([first, rest]), whole)
    for p, q in zip(net_rest.parameters(), net_whole.parameters()):
        assert torch.equal(p, q)


def test_policy_and_fp8():
    seen = []
    acc = use_ampc(_fresh_accelerator("bf16"), policy={"linear": "fp32"})
    net = acc.prepare(_net())
    net[3].register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    net(torch.randn(4, 16))
    assert seen == [torch.float32]
    # FP8: the Linear layers become ampc.fp8.Linear at prepare(), and run in FP8 there
    acc = use_ampc(_fresh_accelerator("bf16"), fp8=ampc.fp8.Float8CurrentScaling())
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))
    ref = ampc.fp8.convert(nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16)))
    ref.load_state_dict(model.state_dict())
    model = acc.prepare(model)
    assert isinstance(model[0], ampc.fp8.Linear)
    x = torch.randn(8, 16)
    with ampc.autocast("cpu", dtype=torch.bfloat16), \
            ampc.fp8.autocast(recipe=ampc.fp8.Float8CurrentScaling()):
        expected = ref(x).float()
    assert torch.equal(model(x), expected)


def test_bad_calls():
    with pytest.raises(ValueError, match="mixed_precision is 'no'"):
        use_ampc(_fresh_accelerator("no"))
    with pytest.raises(TypeError, match="must be an accelerate.Accelerator"):
        use_ampc(object())
    acc = _fresh_accelerator("bf16")
    acc.prepare(_net())
    with pytest.raises(RuntimeError, match="before accelerator.prepare"):
        use_ampc(acc)
    with pytest.raises(TypeError, match="master_weights=True\\): the optimizer is AdamW"):
        acc = use_ampc(_fresh_accelerator("bf16"), master_weights=True)
        net = _net()
        acc.prepare(net, torch.optim.AdamW(net.parameters()))


# ---- the transformers Trainer ----

class _Data(torch.utils.data.Dataset):
    def __init__(self, n=32, seq=8, vocab=64):
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, vocab, (n, seq), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _tiny_gpt2(seed=0):
    torch.manual_seed(seed)
    config = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2,
                                     n_head=2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(config)


class _Losses(transformers.TrainerCallback):
    def __init__(self):
        self.skipped, self.lrs = [], []

    def on_step_end(self, args, state, control, **kw):
        self.lrs.append(kw["lr_scheduler"].get_last_lr()[0])


def _trainer(tmp_path, precision, use, plant_inf=False, max_steps=8, seed=0, optim=None,
             ampc_kw=None, opt_kw=None, **args):
    ampc_kw = ampc_kw or {}
    losses = []

    class T(transformers.Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            if plant_inf and self.state.global_step == INF_STEP:
                loss = loss * float("inf")
            losses.append(loss.detach().clone())
            return loss

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    settings = dict(output_dir=str(tmp_path), use_cpu=True, per_device_train_batch_size=4,
                    max_steps=max_steps, learning_rate=1e-2, lr_scheduler_type="linear",
                    warmup_steps=0, logging_strategy="no", save_strategy="no", report_to=[],
                    seed=seed, data_seed=0, dataloader_num_workers=0, disable_tqdm=True)
    settings.update({precision: True}, **args)
    targs = transformers.TrainingArguments(**settings)
    kw = {}
    if use:
        kw["optimizer_cls_and_kwargs"] = (ampc.optim.AdamW, {"lr": 1e-2, **(opt_kw or {})})
    else:
        targs.optim = optim or "adamw_torch_fused"
    callback = _Losses()
    trainer = T(model=_tiny_gpt2(seed), args=targs, train_dataset=_Data(), callbacks=[callback],
                **kw)
    if use:
        use_ampc(trainer.accelerator, **({"scaler": use} if use is not True else {}), **ampc_kw)
    return trainer, losses, callback


def test_trainer_bf16_same_losses_as_trainer_bf16(tmp_path):
    trainer, ours, _ = _trainer(tmp_path / "a", "bf16", True)
    trainer.train()
    assert isinstance(trainer.optimizer.optimizer, ampc.optim.AdamW)
    t_trainer, theirs, _ = _trainer(tmp_path / "b", "bf16", False)
    t_trainer.train()
    assert torch.equal(torch.stack(ours), torch.stack(theirs))
    for p, q in zip(trainer.model.parameters(), t_trainer.model.parameters()):
        assert torch.equal(p, q)


def test_trainer_steps_in_the_backward_with_accumulation_as_after_it(tmp_path):
    # the Trainer clips by default (max_grad_norm=1.0), which freed gradients cannot serve
    runs = []
    for i, in_backward in enumerate((True, False)):
        trainer, losses, _ = _trainer(tmp_path / str(i), "bf16", True, max_steps=4,
                                      opt_kw={"step_in_backward": in_backward},
                                      gradient_accumulation_steps=2, max_grad_norm=0.0)
        trainer.train()
        assert trainer.optimizer.optimizer.step_in_backward == in_backward
        runs.append((torch.stack(losses), [p.detach().clone() for p in trainer.model.parameters()]))
        if in_backward:         # the norm the Trainer logs: unknown, not zero
            assert math.isnan(trainer.accelerator.clip_grad_norm_(
                trainer.model.parameters(), float("inf")))
    assert len(runs[0][0]) == 8                     # 4 steps of 2 micro-batches
    assert torch.equal(runs[0][0], runs[1][0])
    assert all(torch.equal(p, q) for p, q in zip(runs[0][1], runs[1][1]))


def test_trainer_refuses_its_default_clipping_with_freed_gradients(tmp_path):
    trainer, _, _ = _trainer(tmp_path, "bf16", True, max_steps=2,
                             opt_kw={"step_in_backward": True})
    with pytest.raises(RuntimeError, match=r"clip_grad_norm_: .*step_in_backward=True"):
        trainer.train()


def test_trainer_fp16_skips_and_resumes(tmp_path):
    def scaler():
        return ampc.GradScaler("cpu", init_scale=2.0 ** 12, growth_interval=2)

    whole, w_losses, w_cb = _trainer(tmp_path / "whole", "fp16", scaler(), plant_inf=True)
    whole.train()
    assert torch.isinf(w_losses[INF_STEP])
    # the skipped step leaves the learning-rate schedule where it was
    assert w_cb.lrs[INF_STEP] == w_cb.lrs[INF_STEP - 1]
    assert int(whole.accelerator.scaler.skipped_steps()) == 1
    first, f_losses, _ = _trainer(tmp_path / "run", "fp16", scaler(), plant_inf=True,
                                  save_strategy="steps", save_steps=4)
    first.train()
    ckpt = tmp_path / "run" / "checkpoint-4"
    assert (ckpt / "scaler.pt").exists()
    rest, r_losses, _ = _trainer(tmp_path / "run", "fp16", scaler(), plant_inf=True, seed=1)
    rest.train(resume_from_checkpoint=str(ckpt))
    assert torch.equal(torch.stack(f_losses[:4] + r_losses), torch.stack(w_losses))
    for p, q in zip(rest.model.parameters(), whole.model.parameters()):
        assert torch.equal(p, q)
    assert rest.accelerator.scaler.state_dict() == whole.accelerator.scaler.state_dict()


def test_trainer_master_weights(tmp_path):
    trainer, ours, _ = _trainer(tmp_path / "a", "bf16", True, ampc_kw={"master_weights": True})
    trainer.train()
    model, opt = trainer.model, trainer.optimizer.optimizer
    assert model.transformer.h[0].attn.c_attn.weight.dtype == torch.bfloat16
    assert model.transformer.h[0].ln_1.weight.dtype == torch.float32       # norms stay fp32
    assert opt.state[model.transformer.h[0].attn.c_attn.weight]["master"].dtype == torch.float32
    t_trainer, theirs, _ = _trainer(tmp_path / "b", "bf16", False)
    t_trainer.train()
    # bf16 embeddings here (autocast keeps them fp32): close from the first step on, not equal
    torch.testing.assert_close(torch.stack(ours), torch.stack(theirs), rtol=2e-2, atol=2e-2)


def test_gradient_accumulation_as_accelerate():
    def run(acc, optimizer):
        torch.manual_seed(0)
        net = _net()
        opt = (ampc.optim.AdamW(net.parameters(), lr=1e-2) if optimizer == "ampc"
               else torch.optim.AdamW(net.parameters(), lr=1e-2, fused=True))
        net, opt, loader = acc.prepare(net, opt, _loader())
        losses = []
        for x, y in loader:
            with acc.accumulate(net):
                loss = nn.functional.mse_loss(net(x), y)
                losses.append(loss.detach().clone())
                acc.backward(loss)
                if acc.sync_gradients:
                    acc.clip_grad_norm_(net.parameters(), CLIP)
                opt.step()
                opt.zero_grad()
        return torch.stack(losses), [p.detach().clone() for p in net.parameters()]

    ours, w_ours = run(use_ampc(_fresh_accelerator("fp16", gradient_accumulation_steps=2)), "ampc")
    theirs, w_theirs = run(_fresh_accelerator("fp16", torch_fp16=True,
                                              gradient_accumulation_steps=2), "fused")
    assert torch.equal(ours, theirs), (ours, theirs)
    for a, b in zip(w_ours, w_theirs):
        assert torch.equal(a, b)


def test_a_model_prepared_twice_is_wrapped_once_and_unwraps():
    acc = use_ampc(_fresh_accelerator("bf16"))
    net = _net()
    plain_forward = net.forward
    prepared = acc.prepare(net)
    wrapped = prepared.forward
    assert acc.prepare(prepared) is prepared and prepared.forward is wrapped
    x = torch.randn(4, 16)
    assert prepared(x).dtype == torch.float32
    with ampc.autocast("cpu", dtype=torch.bfloat16):
        expected = net._original_forward(x).float()
    assert torch.equal(prepared(x), expected)
    # Accelerate's unwrap_model takes ampc's region off as it takes its own autocast off
    unwrapped = acc.unwrap_model(prepared, keep_fp32_wrapper=False)
    assert unwrapped.forward == plain_forward
    assert unwrapped(x).dtype == torch.float32 and not torch.equal(unwrapped(x), expected)


def test_bf16_optimizer_reports_no_skip():
    acc = use_ampc(_fresh_accelerator("bf16"))
    _, skipped, _, opt = _train(acc)
    assert skipped == [False] * 6 and opt.step_was_skipped is False
