"""Numbers the README states that no other test pins: the default min_scale_patience of
ampc.GradScaler, and the calls ampc.autocast saves by casting MultiheadAttention's inputs
once on the CPU instead of following it call by call (counted on torch 2.14's
MultiheadAttention; the smoke run under other torches leaves them out)."""
import sys

import pytest
import torch
from torch import nn

import ampc

AC = sys.modules["ampc.autocast"]   # the module (ampc.autocast the attribute is the class)


def test_min_scale_patience_defaults_to_10():
    # 8 -> 4 -> 2 -> 1 (= min_scale) in three skipped steps, then the 10th overflow at the
    # minimum raises, not the 9th
    p = nn.Parameter(torch.zeros(4))
    opt = ampc.optim.AdamW([p], lr=0.1)
    scaler = ampc.GradScaler("cpu", init_scale=8.0, min_scale=1.0)

    def overflowing_step():
        opt.zero_grad()
        scaler.scale(p.sum()).backward()
        p.grad[0] = float("nan")
        scaler.step(opt)
        scaler.update()
    for _ in range(3 + 9):
        overflowing_step()
    assert scaler.get_scale() == 1.0 and int(scaler.skipped_steps()) == 12
    with pytest.raises(RuntimeError, match=r"^ampc.GradScaler: 10 steps in a row had inf or nan "
                                           r"gradients with the loss scale already at min_scale=1.0"):
        overflowing_step()


def calls_seen(mha, x, kwargs, follow):
    """Calls ampc's mode intercepts in one forward of mha (after a first, warming one), with
    multi_head_attention_forward cast once (follow=False) or followed call by call."""
    saved = AC._EFFECTIVE["cpu"]
    if follow:
        AC._EFFECTIVE["cpu"] = {k: v for k, v in saved.items() if k != "multi_head_attention_forward"}
    real = AC._Mode.__torch_function__
    n = [0]

    def counting(*args, **kw):
        n[0] += 1
        return real(*args, **kw)
    try:
        with ampc.autocast("cpu"):
            mha(x, x, x, **kwargs)
            AC._Mode.__torch_function__ = counting
            out = mha(x, x, x, **kwargs)[0]
    finally:
        AC._Mode.__torch_function__ = real
        AC._EFFECTIVE["cpu"] = saved
    return n[0], out


@pytest.mark.parametrize("kwargs,fewer", [({}, 42), (dict(need_weights=False), 38)],
                         ids=["need_weights", "no_weights"])
def test_multihead_attention_cast_once_saves_about_40_calls(kwargs, fewer):
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(16, 4, batch_first=True)
    x = torch.randn(2, 5, 16)
    once, got = calls_seen(mha, x, kwargs, follow=False)
    followed, got_followed = calls_seen(mha, x, kwargs, follow=True)
    assert followed - once == fewer, (once, followed)
    with torch.autocast("cpu"):
        want = mha(x, x, x, **kwargs)[0]
    assert got.dtype is want.dtype is torch.bfloat16
    assert torch.equal(got, want) and torch.equal(got_followed, want)
