"""ampc.memory.report: a training step's peak and what it is made of, on models whose saved
tensors are known from the ops' backward formulas (exp saves its output, sin its input)."""
import copy

import pytest
import torch
from torch import nn

import ampc
import ampc.memory as mem

N = 64 * 1024          # elements of the activations: 256 KiB in fp32


class Exp(nn.Module):          # saves its output
    def forward(self, x):
        return torch.exp(x)


class Sin(nn.Module):           # saves its input
    def forward(self, x):
        return torch.sin(x)


class SinOfViews(nn.Module):   # saves its input: two views of one storage
    def forward(self, x):
        a, b = x[: N // 2], x[N // 2:]
        return torch.cat([torch.sin(a), torch.sin(b)])


class Scaled(nn.Module):       # saves a view of its own parameter: not an activation
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(4, N // 4))

    def forward(self, x):
        return torch.sin(x * self.w.reshape(-1))


def total(r):
    return sum(r.saved.values())


def make():
    torch.manual_seed(0)
    model = nn.Sequential(Scaled(), Exp(), SinOfViews(), Exp())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(N)
    return model, opt, (x, None)


def sum_loss(out, target):
    return out.sum()


def test_saved_activations_by_module_each_storage_once_no_params_no_batch():
    model, opt, batch = make()
    r = mem.report(model, opt, batch, sum_loss)
    # 0: mul saves the batch and a view of the param (neither counted), sin its input;
    # 1 saves its output; 2 saves that same storage again, as two views: counted once,
    # under 1; 3 saves its output; the loss (a sum) saves no tensor
    assert r.saved == {"0": 4 * N, "1": 4 * N, "3": 4 * N}


def test_parts_add_up_to_the_peak_and_state_is_measured():
    model, opt, batch = make()
    r = mem.report(model, opt, batch, sum_loss)
    params = sum(p.numel() * 4 for p in model.parameters())
    assert sum(r.parts.values()) == r.peak
    assert r.parts["weights"] == params
    assert r.parts["optimizer state"] == 2 * params + 4        # exp_avg, exp_avg_sq, step
    assert r.parts["batch"] == 4 * N
    assert 0 <= r.parts["grads"] <= params and r.parts["other"] >= 0
    # every saved tensor is alive at the end of the forward, so the peak is at least that
    assert r.peak >= params * 3 + 4 * N + total(r)
    assert r.phase in ("forward", "backward", "step")


def test_the_peak_counts_what_is_alive_then():
    # a deep chain of sins: the end of the forward, with every input saved, is the peak
    torch.manual_seed(0)
    model = nn.Sequential(Scaled(), *[Sin() for _ in range(8)])
    opt = torch.optim.SGD(model.parameters(), lr=1e-6)
    r = mem.report(model, opt, (torch.randn(N), None), sum_loss)
    assert total(r) == 9 * 4 * N
    assert sum(r.saved_at_peak.values()) >= 8 * 4 * N       # freed only from the backward on
    assert r.peak >= r.parts["weights"] + r.parts["batch"] + 9 * 4 * N


def test_the_forward_floor_is_the_forward_alone_and_bounds_the_step_s_peak():
    """forward_floor: the bytes alive before the step plus the running peak up to the loss,
    the backward not run. The step's peak is at least that, and at the end of the forward
    every saved tensor is alive."""
    def sins():
        torch.manual_seed(0)
        model = nn.Sequential(Scaled(), *[Sin() for _ in range(8)])
        return model, torch.optim.SGD(model.parameters(), lr=1e-6), (torch.randn(N), None)

    model, opt, batch = sins()
    floor = mem.forward_floor(model, opt, batch, sum_loss)
    assert all(p.grad is None for p in model.parameters())        # no backward ran
    r = mem.report(*sins(), sum_loss)
    assert r.parts["weights"] + r.parts["batch"] + total(r) <= floor <= r.peak
    with pytest.raises(ValueError, match="warmup"):
        mem.forward_floor(model, opt, batch, sum_loss, warmup=-1)


def test_table_and_plot(tmp_path):
    pytest.importorskip("matplotlib")
    model, opt, batch = make()
    r = mem.report(model, opt, batch, sum_loss, top=2)
    text = r.table(top=2)
    assert "saved activations by module" in text and "(2 others)" in text and "peak" in text
    path = r.plot(str(tmp_path / "m.png"), top=2)
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_plot_without_matplotlib_says_what_to_install(monkeypatch, tmp_path):
    model, opt, batch = make()
    r = mem.report(model, opt, batch, sum_loss, warmup=0)
    monkeypatch.setitem(__import__("sys").modules, "matplotlib.figure", None)
    with pytest.raises(ImportError, match="pip install matplotlib"):
        r.plot(str(tmp_path / "m.png"))


@pytest.mark.parametrize("kwargs, err, msg", [
    (dict(model="m"), TypeError, "model is str"),
    (dict(optimizer=None), TypeError, "optimizer is NoneType"),
    (dict(batch=torch.ones(3)), TypeError, "batch must be an"),
    (dict(loss_fn=3), TypeError, "loss_fn is int"),
    (dict(autocast=torch.float64), ValueError, "autocast is torch.float64"),
    (dict(warmup=-1), ValueError, "warmup is -1"),
    (dict(top=0), ValueError, "top is 0"),
])
def test_bad_input_is_refused_before_any_step(kwargs, err, msg):
    model, opt, batch = make()
    before = [p.detach().clone() for p in model.parameters()]
    args = dict(model=model, optimizer=opt, batch=batch, loss_fn=sum_loss)
    args.update(kwargs)
    with pytest.raises(err, match=f"ampc.memory.report: {msg}"):
        mem.report(**args)
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters())) and not opt.state


def test_reachable_from_ampc():
    import ampc
    assert ampc.memory.report is mem.report


class ExpThenChanged(nn.Module):
    def forward(self, x):
        y = torch.exp(x)
        y.add_(1)              # changes what exp saved for its backward
        return y


def test_a_saved_tensor_changed_in_place_raises_as_torch_does():
    model = nn.Sequential(Scaled(), ExpThenChanged())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        mem.report(model, opt, (torch.randn(N), None), sum_loss, warmup=0)
    assert model[0].w.grad is None


def test_a_peak_in_the_optimizer_step_holds_every_grad_and_no_activation():
    # large weights, a one-row batch: the step's temporaries, with every grad alive, top the forward
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, 512), nn.Tanh(), nn.Linear(512, 512))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    r = mem.report(model, opt, (torch.randn(1, 512), None), sum_loss)
    params = sum(p.numel() * 4 for p in model.parameters())
    assert r.phase == "step"
    assert r.parts["grads"] == params and r.saved_at_peak == {} and r.parts["saved activations"] == 0
    # tanh saves its output and the next Linear the same tensor, its input: one storage, under tanh
    assert r.saved == {"1": 512 * 4}


def test_the_profiler_s_own_lines_stay_off_stderr(capfd):
    # kineto prints a line each time torch's profiler starts and stops (and, in a CUDA
    # build without a GPU, an error it ignores); what Python wrote before is kept
    import sys
    m = torch.nn.Linear(8, 8)
    print("before", file=sys.stderr)
    mem.report(m, torch.optim.SGD(m.parameters(), lr=0.1),
               (torch.randn(4, 8), torch.randint(0, 8, (4,))))
    err = capfd.readouterr().err
    assert "before" in err
    assert "profiler_start" not in err and "profiler_stop" not in err, err


@pytest.mark.parametrize("make_opt", [
    lambda ps: torch.optim.AdamW(ps), lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    lambda ps: ampc.optim.AdamW(ps, state="lean"),
    lambda ps: ampc.optim.AdamW(ps, step_in_backward=True)])
def test_no_warmup_step_measures_the_peak_of_one(make_opt):
    # warmup=0: the optimizer's state made by a step on zero gradients, not a training step
    torch.manual_seed(0)
    base = nn.Sequential(nn.Embedding(64, 128), nn.Linear(128, 512), nn.GELU(),
                         nn.Linear(512, 64))
    batch = (torch.randint(0, 64, (16, 32)), torch.randint(0, 64, (16, 32)))
    peaks = []
    for warmup in (1, 0):
        m = copy.deepcopy(base)
        r = mem.report(m, make_opt(list(m.parameters())), batch, warmup=warmup)
        peaks.append((r.peak, r.parts["optimizer state"]))
    assert peaks[0] == peaks[1] and peaks[0][1] > 0
