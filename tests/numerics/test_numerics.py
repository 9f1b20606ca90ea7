"""ampc._numerics: relative errors against a float64 reference, fp16's range by hand, the
capture of a step against what the modules really saw, the model helpers on nested values."""
import collections
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ampc._numerics.capture import capture
from ampc._numerics.errors import fp16_range, loss_error, rel_error
from ampc._numerics.model import call_model, default_loss, expression, first_float, to_device
from ampc._numerics.unit import run_unit


def test_rel_error_is_the_float64_norm_ratio_over_the_whole_list():
    g = torch.Generator().manual_seed(0)
    b = [torch.randn(300, generator=g), torch.randn(7, 5, generator=g)]
    a = [t + 1e-3 * torch.randn(t.shape, generator=g) for t in b]
    num = sum(((x.double() - y.double()) ** 2).sum().item() for x, y in zip(a, b))
    den = sum((y.double() ** 2).sum().item() for y in b)
    assert rel_error(a, b) == pytest.approx(math.sqrt(num / den), rel=1e-12)
    # bf16 inputs are compared in float64 too: the measured error is bf16's, not the sum's
    x = torch.randn(4096, generator=g)
    xb = x.bfloat16()
    exact = ((xb.double() - x.double()).norm() / x.double().norm()).item()
    assert rel_error([xb], [x]) == pytest.approx(exact, rel=1e-12)
    assert 2 ** -11 < exact < 2 ** -8


def test_rel_error_edges():
    z = torch.zeros(3)
    assert rel_error([torch.ones(3)], [z]) == pytest.approx(math.sqrt(3))  # ||a - b|| when b is 0
    assert rel_error([None, torch.ones(2)], [torch.ones(2), None]) is None  # nothing to compare
    assert rel_error([torch.ones(2)], [torch.ones(3)]) is None               # shapes differ
    assert rel_error([torch.tensor([1.0, math.nan])], [torch.ones(2)]) == math.inf
    assert rel_error([torch.tensor([2.0]), None], [torch.tensor([1.0]), torch.ones(1)]) == 1.0
    # a non-finite value in a later pair, and infinities that would cancel in a difference
    assert rel_error([torch.ones(2), torch.tensor([math.inf])],
                     [torch.ones(2), torch.tensor([1.0])]) == math.inf
    assert rel_error([torch.tensor([-math.inf])], [torch.tensor([1.0])]) == math.inf
    # float64 tensors are compared in float64: a difference fp32 cannot hold is still seen
    y = torch.ones(4, dtype=torch.float64)
    assert rel_error([y + 1e-12], [y]) == pytest.approx(1e-12, rel=1e-3)
    assert rel_error([(y + 1e-12).float()], [y]) == 0.0


def test_loss_error_sums_per_example_magnitudes():
    grad = torch.tensor([[1.0, 1.0], [1.0, -1.0]])
    ref = torch.zeros(2, 2)
    y = torch.tensor([[1.0, -1.0], [1.0, 1.0]])    # each example's changes cancel: 0 + 0
    assert loss_error(y, ref, grad, 2.0) == 0.0
    y = torch.tensor([[1.0, 1.0], [-1.0, 1.0]])    # |2| + |-2| over |loss| = 2
    assert loss_error(y, ref, grad, -2.0) == 2.0
    assert loss_error(None, ref, grad, 1.0) is None
    assert loss_error(torch.full((2, 2), math.inf), ref, grad, 1.0) == math.inf
    assert loss_error(torch.tensor([[math.nan, 0.0], [0.0, 0.0]]), ref, grad, 1.0) == math.inf
    # a bf16 output against its fp32 reference: the float64 sum of the exact products
    g = torch.Generator().manual_seed(1)
    ref, grad = torch.randn(8, 64, generator=g), torch.randn(8, 64, generator=g)
    y = ref.bfloat16()
    exact = (grad.double() * (y.double() - ref.double())).sum(1).abs().sum().item() / 3.0
    assert loss_error(y, ref, grad, 3.0) == pytest.approx(exact, rel=1e-6)


def test_fp16_range_counts_by_hand():
    g = torch.tensor([1e-9, 0.0, 1.0, 1e5, -3e4])
    under, over = fp16_range([g], 2.0)
    # 2e-9 rounds to zero (under); 0 stays zero (not counted); 2e5 > 65504 (over); -6e4 fits
    assert (under, over) == (1 / 5, 1 / 5)
    act = torch.tensor([70000.0, 1.0, -65505.0])        # unscaled activations: overflow only
    assert fp16_range([], 1.0, [act]) == (0.0, 2 / 3)
    assert fp16_range([g], 2.0, [act]) == (1 / 8, 3 / 8)
    assert fp16_range([], 1.0) == (None, None)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 6)
        self.b = nn.Linear(6, 3)

    def forward(self, x, scale=1.0):
        return self.b(torch.relu(self.a(x)) * scale)


def test_capture_records_first_calls_grads_and_leaves_the_model_alone():
    torch.manual_seed(0)
    model = Net()
    x, y = torch.randn(5, 4), torch.randint(0, 3, (5,))
    model.a.weight.grad = marker = torch.full_like(model.a.weight, 7.0)
    step = capture(model, ((x,), y), default_loss, ["", "a", "b"])
    assert model.a.weight.grad is marker and model.b.weight.grad is None   # restored
    # the same step by hand
    h = model.a(x).detach().requires_grad_(True)
    hid = torch.relu(h)
    out = model.b(hid)
    loss = default_loss(out, y)
    assert step.loss == pytest.approx(loss.item())
    torch.testing.assert_close(step.calls["a"].input, x)
    torch.testing.assert_close(step.calls["b"].out, out.detach())
    g_out, = torch.autograd.grad(loss, out, retain_graph=True)
    torch.testing.assert_close(step.calls["b"].grad, g_out)
    torch.testing.assert_close(step.calls[""].out, out.detach())
    ref = Net()
    ref.load_state_dict(model.state_dict())
    default_loss(ref(x), y).backward()
    torch.testing.assert_close(step.grads["a.weight"], ref.a.weight.grad)
    torch.testing.assert_close(step.module_grads(model, "b"), [ref.b.weight.grad, ref.b.bias.grad])
    assert step.module_grads(model, "") == []      # the model holds no parameter itself


def test_capture_of_a_module_called_twice_keeps_its_first_call():
    lin = nn.Linear(3, 3)
    model = nn.Sequential(lin, nn.ReLU(), lin)       # one module, two calls
    x = torch.randn(2, 3)
    step = capture(model, (x, torch.tensor([0, 1])), default_loss, ["0"])
    torch.testing.assert_close(step.calls["0"].input, x)
    torch.testing.assert_close(step.calls["0"].out, lin(x).detach())


def test_run_unit_gives_the_grads_of_the_recorded_call():
    torch.manual_seed(0)
    model = Net()
    x, y = torch.randn(5, 4), torch.randint(0, 3, (5,))
    step = capture(model, ((x,), y), default_loss, ["b"])
    out, dx, dw, seconds = run_unit(model.b, step.calls["b"], scale=8.0)
    torch.testing.assert_close(out, step.calls["b"].out)
    torch.testing.assert_close(dw, step.module_grads(model, "b"))   # unscaled again
    assert dx[0].shape == (5, 6) and seconds >= 0.0


def test_model_helpers_on_nested_values():
    Pair = collections.namedtuple("Pair", "x mask")
    batch = (Pair(torch.ones(2), torch.zeros(2, dtype=torch.bool)), {"t": torch.ones(1)}, "s")
    moved = to_device(batch, "cpu")
    assert isinstance(moved[0], Pair) and moved[2] == "s"             # namedtuple rebuilt
    moved = to_device(batch, torch.device("meta"))
    assert moved[0].x.device.type == "meta" and moved[1]["t"].device.type == "meta"
    assert first_float(({"a": torch.arange(3)}, [torch.ones(2)])) is not None
    assert first_float((torch.arange(3),)) is None
    assert call_model(lambda a, b: a + b, (1, 2)) == 3 and call_model(lambda a: -a, 4) == -4
    assert expression("blocks.0.attn") == "model.blocks[0].attn" and expression("") == "model"


def test_default_loss_takes_what_models_return():
    g = torch.Generator().manual_seed(0)
    logits, y = torch.randn(4, 5, generator=g), torch.randint(0, 5, (4,), generator=g)
    want = F.cross_entropy(logits, y)
    own = torch.tensor(0.25)
    Out = collections.namedtuple("Out", "logits hidden")
    Output = type("Output", (), {"loss": None, "logits": logits})   # attributes, as a ModelOutput
    assert torch.equal(default_loss(logits, y), want)
    assert torch.equal(default_loss({"logits": logits, "hidden": torch.ones(4, 2)}, y), want)
    assert torch.equal(default_loss({"hidden": logits.bfloat16()}, y),
                       F.cross_entropy(logits.bfloat16().float(), y))
    assert torch.equal(default_loss(Out(logits, torch.ones(3)), y), want)
    assert torch.equal(default_loss(Output(), y), want)
    assert default_loss({"loss": own, "logits": logits}, y) == own   # the model's own loss
    assert default_loss({"loss": own}, None) == own
    with pytest.raises(TypeError, match="no loss, logits or floating tensor"):
        default_loss({"ids": torch.ones(2, dtype=torch.long)}, y)
    with pytest.raises(TypeError, match="needs a target"):
        default_loss({"logits": logits}, None)
    assert call_model(lambda a, mask=None: a * mask, {"a": 2, "mask": 3}) == 6   # keyword inputs
