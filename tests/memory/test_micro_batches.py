"""A batch as micro-batches: the pieces and their shares, gradients that add up to the whole
batch's (with torch's AdamW and with ampc's stepping in the backward), a step's peak measured
split, and bad input refused by name."""
import copy

import pytest
import torch
from torch import nn

import ampc
from ampc.memory import micro_batches
from ampc.memory import micro_batch_backward as backward, why_not_split as why_not


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 128), nn.GELU(), nn.Linear(128, 128), nn.GELU(),
                         nn.Linear(128, 10))


def _batch(n=64, seed=0):
    x = torch.randn(n, 16, generator=torch.Generator().manual_seed(seed))
    return x, x[:, :10].argmax(1)         # learnable: the training below must lower the loss


def test_the_pieces_hold_every_example_once_with_their_shares():
    x, y = _batch(10)
    table = torch.arange(4.0)            # not batch-major: goes to every piece whole
    inputs = {"x": x, "extra": (table, "label")}
    pieces = micro_batches((inputs, y), 4)
    assert [share for _, share in pieces] == [0.3, 0.3, 0.2, 0.2]
    assert torch.equal(torch.cat([p[0]["x"] for p, _ in pieces]), x)
    assert torch.equal(torch.cat([p[1] for p, _ in pieces]), y)
    assert all(p[0]["extra"][0] is table and p[0]["extra"][1] == "label" for p, _ in pieces)
    assert all(p[0]["x"].data_ptr() == x[i].data_ptr()        # views, not copies
               for (p, _), i in zip(pieces, (0, 3, 6, 8)))
    whole = ((x, x[:, 0]), None)
    assert micro_batches(whole, 1) == [(whole, 1.0)] and micro_batches(whole, 1)[0][0] is whole


@pytest.mark.parametrize("batch, k, error, match", [
    (_batch(8), 0, ValueError, r"ampc.memory.micro_batches: k is 0, expected an int >= 1"),
    (_batch(8), True, ValueError, r"k is True"),
    (_batch(8), 9, ValueError, r"k is 9, more than the batch's 8 examples"),
    (torch.zeros(8, 3), 2, TypeError, r"batch must be an \(inputs, target\) pair"),
    (("text", None), 2, ValueError, r"batch holds no tensor with a batch dimension"),
])
def test_bad_input_is_refused_by_name(batch, k, error, match):
    with pytest.raises(error, match=match):
        micro_batches(batch, k)


def _grads(model):
    return [p.grad.clone() for p in model.parameters()]


def _loss_of(model):
    return lambda piece: nn.functional.cross_entropy(model(piece[0]), piece[1])


def test_the_gradients_add_up_to_the_whole_batchs():
    whole, split = _model(), _model()
    batch = _batch(50)                  # 50 in 4: pieces of 13, 13, 12, 12
    l1 = backward(None, batch, 1, _loss_of(whole))
    l4 = backward(None, batch, 4, _loss_of(split))
    assert abs(l4.item() - l1.item()) <= 1e-6 * l1.item()
    for a, b in zip(_grads(whole), _grads(split)):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("in_backward", [False, True])
def test_training_on_split_follows_the_whole_batch(in_backward):
    """Ten AdamW steps on batches split in 4 beside the same steps on whole batches; ampc's
    AdamW stepping in the backward steps once a batch, on the sum."""
    runs = []
    for k in (1, 4):
        model = _model()
        opt = ampc.optim.AdamW(model.parameters(), lr=1e-2, step_in_backward=in_backward)
        losses = []
        for step in range(10):
            opt.zero_grad(set_to_none=True)
            losses.append(backward(opt, _batch(64, seed=step), k, _loss_of(model)).item())
            if not in_backward:
                opt.step()
        runs.append((model, losses))
    (whole, l1), (split, l4) = runs
    assert max(abs(a - b) for a, b in zip(l1, l4)) <= 1e-4 and l1[-1] < l1[0]
    for a, b in zip(whole.parameters(), split.parameters()):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5)


def test_a_step_measured_split_saves_a_kth_of_the_activations():
    model, batch = _model(), _batch(256)
    reps = {k: ampc.memory.report(copy.deepcopy(model), torch.optim.AdamW(model.parameters()),
                                  batch, micro_batches=k) for k in (1, 4)}
    acts = {k: r.by_kind()["activations"] for k, r in reps.items()}
    assert acts[4] <= 0.3 * acts[1] and reps[4].peak < reps[1].peak
    with pytest.raises(ValueError, match=r"ampc.memory.report: micro_batches is 0"):
        ampc.memory.report(model, torch.optim.AdamW(model.parameters()), batch, micro_batches=0)
    with pytest.raises(ValueError, match=r"micro_batches is 300, more than the batch's 256"):
        ampc.memory.report(model, torch.optim.AdamW(model.parameters()), batch, micro_batches=300)


def test_a_batchnorm_model_is_not_the_same_model_split():
    assert why_not(_model()) is None
    bn = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    assert "1 is a BatchNorm1d: in training it would take its statistics" in why_not(bn)
