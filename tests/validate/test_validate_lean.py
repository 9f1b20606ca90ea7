"""compare()'s "ampc.lean" setup, asked for by name: ampc.prepare with
ampc.optim.AdamW(state="lean"), trained as the hand-written loop trains it."""
import pytest
import torch
from torch import nn

import ampc
from ampc import validate


def make_model():
    # the first weight (64 x 128) is large enough for 8-bit moments; the rest keep fp32 ones
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.LayerNorm(128), nn.Linear(128, 8))


def make_batch(k):
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(k))
    return x, x[:, :8].argmax(1)         # learnable: the class is where x[:, :8] peaks


def test_lean_is_asked_for_by_name():
    assert "ampc.lean" in validate.ALL_SETUPS and "ampc.lean" not in validate.SETUPS


def test_lean_setup_is_prepare_with_the_lean_preset():
    report = validate.compare(make_model, make_batch, steps=6, lr=1e-2, device="cpu",
                              setups=("ampc.lean@bf16",), seeds=(0,), progress=False)
    run = report.runs[0]
    assert run.name == "ampc.lean bf16" and run.kind == "ampc.lean"
    opt = run.optimizer
    assert type(opt) is ampc.optim.AdamW
    group = opt.param_groups[0]
    assert group["moments"] == "8bit" and group["stochastic_rounding"]
    assert not group["master_weights"]
    first = run.model[0].weight
    assert first.dtype == torch.bfloat16
    assert opt.state[first]["exp_avg_codes"].dtype == torch.uint8 and "master" not in opt.state[first]
    assert run.scales == [1.0] * 6          # bf16: no loss scaling

    torch.manual_seed(0)
    model, opt = ampc.prepare(make_model(), ampc.optim.AdamW, torch.bfloat16, lr=1e-2,
                              state="lean")
    losses = []
    for k in range(6):
        x, y = make_batch(k)
        opt.zero_grad(set_to_none=True)
        loss = nn.functional.cross_entropy(model(x).float(), y)
        loss.backward()
        losses.append(loss.item())
        opt.step()
    assert run.losses == losses
    for a, b in zip(run.model.parameters(), model.parameters()):
        assert torch.equal(a, b)
    # it trains, and it is not the master-weight setup under another name
    assert run.losses[-1] < run.losses[0]
    assert report.base.losses[1] != run.losses[1]


def test_lean_fp16_runs_with_ampc_grad_scaler():
    report = validate.compare(make_model, make_batch, steps=3, lr=1e-2, device="cpu",
                              setups=("ampc.lean@fp16",), seeds=(0,), progress=False)
    run = report.runs[0]
    assert run.name == "ampc.lean fp16" and run.model[0].weight.dtype == torch.float16
    assert run.scales[0] > 1.0 and all(map(lambda v: v == v, run.losses))


def test_lean_bad_dtype_suffix():
    with pytest.raises(ValueError, match="dtype must be fp16 or bf16"):
        validate.compare(make_model, make_batch, steps=1, setups=("ampc.lean@fp8",),
                         progress=False)
