"""The "too slow here" cut of ampc.autoprecision's measurement compares warm times: a
candidate's first call (kernel selection, allocation, fp8's first amax) is not its cost."""
import time

import pytest
import torch
from torch import nn

from ampc.autoprecision import _measure, search


class SlowFirstCall(nn.Linear):
    """A Linear whose first forward, in every copy, takes 50 ms longer."""

    def __init__(self, n):
        super().__init__(n, n)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        if self.calls == 1:
            time.sleep(0.05)
        return super().forward(x)


def test_first_call_is_not_timed():
    torch.manual_seed(0)
    model = nn.Sequential(SlowFirstCall(32))
    batches = [(torch.randn(8, 32), torch.randint(0, 32, (8,))) for _ in range(2)]
    units = {"0": model[0]}
    measured, _ = _measure.measure(model, batches, _measure_loss, units, {"0": ["fp32", "bf16"]},
                                   "cpu", None, repeats=1, slow=4.0)
    bf16 = measured["0"]["bf16"]
    assert "too_slow" not in bf16 and bf16["wgrad_err"] is not None


def _measure_loss(out, target):
    return nn.functional.cross_entropy(out.float(), target)


def test_three_identical_linears_same_verdict():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(),
                          nn.Linear(128, 128))
    batches = [(torch.randn(64, 128), torch.randint(0, 128, (64,))) for _ in range(2)]
    plan = search(model, batches, candidates=("fp32", "bf16", "fp16"), objective="time",
                  repeats=2)
    tried = [c for c in ("bf16", "fp16") if c in plan.unit("0").options]
    if not tried:
        pytest.skip("neither bf16 nor fp16 is tried on this CPU (its matmul probe is too slow)")
    for c in tried:
        verdicts = {n: "too_slow" in plan.unit(n).options[c] for n in ("0", "2", "4")}
        assert len(set(verdicts.values())) == 1, (c, verdicts, plan.table())
