"""ampc.validate's FP8 setup: named "ampc.fp8", not run by default, it trains what it says
(ampc.autocast with the nn.Linear GEMMs in FP8, ampc's AdamW) and tracks fp32."""
import pytest
import torch
from torch import nn

import ampc
from ampc import fp8, validate
from ampc.validate._compare import parse_setup


from test_validate import VOCAB, make_batch


def make_model():
    return nn.Sequential(nn.Embedding(VOCAB, 32), nn.Linear(32, 32), nn.GELU(),
                         nn.LayerNorm(32), nn.Linear(32, VOCAB))


def test_fp8_setup_is_named_and_not_a_default():
    assert parse_setup("ampc.fp8", torch.bfloat16) == ("ampc.fp8", torch.bfloat16)
    assert parse_setup("ampc.fp8@fp16", torch.bfloat16) == ("ampc.fp8", torch.float16)
    assert "ampc.fp8" not in validate.SETUPS and "ampc.fp8" in validate.ALL_SETUPS


def test_fp8_setup_trains_what_it_says_and_tracks_fp32():
    steps = 30
    report = validate.compare(make_model, make_batch, steps=steps, setups=("ampc.fp8",),
                              seeds=(0,), lr=1e-2, device="cpu", progress=False)
    (run,) = report.runs
    assert run.name == "ampc.fp8 bf16"
    assert all(type(m) is fp8.Linear for m in run.model.modules() if isinstance(m, nn.Linear))
    # the same training written out by hand gives the same losses
    torch.manual_seed(0)
    model = fp8.convert(make_model())
    opt = ampc.optim.AdamW(model.parameters(), lr=1e-2)
    torch.manual_seed(0)
    losses = []
    for k in range(steps):
        x, y = make_batch(k)
        opt.zero_grad(set_to_none=True)
        with ampc.autocast("cpu", dtype=torch.bfloat16), fp8.autocast(recipe=fp8.DelayedScaling()):
            out = model(x)
        loss = validate.default_loss(out, y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert run.losses == losses
    assert (model[1].fp8_fwd_scale != 1).all()
    # and it learns as fp32 does (bf16 elsewhere, FP8 GEMMs: a few percent)
    assert run.losses[-1] < 0.5 * run.losses[0]
    row = report.rows[0]
    assert row["final_gap"] < 0.10, row
