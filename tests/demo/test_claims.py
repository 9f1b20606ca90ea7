"""Numbers the docs state (docs/grad-scaler.md) that no other test pins: the default min_scale_patience of
ampc.GradScaler. (The calls ampc.autocast saved by casting MultiheadAttention's inputs once
went with the composite entry: torch's own autocast handles the ops inside it now.)"""
import pytest
import torch
from torch import nn

import ampc


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
