"""ampc.validate: compare() trains what it says and measures what it says; layers() finds
the module that loses precision, and its suggestion, pasted, fixes it."""
import json
import math
import os
import sys

import pytest
import torch
from torch import nn

import ampc
from ampc import validate
from ampc.validate import __main__ as cli
from ampc import _outputs
from ampc._numerics.model import expression

VOCAB = 16


def make_model():
    return nn.Sequential(nn.Embedding(VOCAB, 16), nn.Linear(16, 32), nn.GELU(),
                         nn.LayerNorm(32), nn.Linear(32, VOCAB))


def make_batch(step):
    g = torch.Generator().manual_seed(step)
    x = torch.randint(0, VOCAB, (8, 6), generator=g)
    return x, (3 * x + 1) % VOCAB


def test_compare_fp32_run_is_plain_torch_training():
    report = validate.compare(make_model, make_batch, steps=6, setups=(), seeds=(0,),
                              lr=1e-2, progress=False)
    torch.manual_seed(0)
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, norms = [], []
    for k in range(6):
        x, y = make_batch(k)
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1))
        loss.backward()
        norms.append(torch.nn.utils.get_total_norm(
            [p.grad.double() for p in model.parameters()]).item())
        losses.append(loss.item())
        opt.step()
    assert report.base.losses == pytest.approx(losses, rel=1e-5)
    assert report.base.grad_norms == pytest.approx(norms, rel=1e-5)
    assert report.spread is None and report.rows == []


def test_compare_bf16_setups_track_fp32_and_report(tmp_path):
    val = [make_batch(1000 + k) for k in range(2)]
    report = validate.compare(make_model, make_batch, steps=20, lr=1e-2, device="cpu",
                              val_batches=val, progress=False)
    assert [r.name for r in report.runs] == ["torch.amp bf16", "ampc bf16", "ampc.master bf16"]
    # all runs of seed 0 start from the same weights and batches: the same first loss
    first = report.base.losses[0]
    assert all(r.losses[0] == pytest.approx(first, rel=2e-2) for r in report.runs)
    assert report.spread > 0                      # a second seed starts elsewhere
    for row in report.rows:
        assert row["final_gap"] < 0.02 and row["val_gap"] < 0.02
        assert 0.9 < row["grad_norm_ratio_median"] < 1.1
        assert row["skipped_steps"] == 0 and row["final_scale"] is None
    assert report.base.losses[-1] < 0.7 * first   # it learned
    text = report.table()
    assert "ampc.master bf16" in text and "within spread" in text
    paths = report.save(tmp_path)
    data = json.load(open(paths["txt"].replace(".txt", ".json")))
    assert [r["setup"] for r in data["summary"]] == [r.name for r in report.runs]
    assert len(data["runs"]) == 5 and len(data["runs"][0]["losses"]) == 20
    assert open(paths["txt"]).read().strip() == text
    if _outputs.pyplot() is not None:
        assert os.path.getsize(paths["png"]) > 10_000


def test_compare_fp16_skipped_steps_match_torch():
    """A loss large enough that fp16 grads overflow at the first scales: torch's and
    ampc's scalers skip the same steps and end at the same scale."""
    def loss_fn(out, y):
        return 1e4 * nn.functional.cross_entropy(out.float().reshape(-1, VOCAB), y.reshape(-1))

    report = validate.compare(make_model, make_batch, loss_fn, steps=12, seeds=(0,),
                              setups=("torch.amp@fp16", "ampc@fp16", "ampc.master@fp16"),
                              device="cpu", lr=1e-3, progress=False)
    torch_run, ampc_run, master_run = report.runs
    assert torch_run.skipped, "the planted overflow must skip steps"
    assert ampc_run.skipped == torch_run.skipped
    assert ampc_run.scales == torch_run.scales
    assert master_run.skipped                     # 16-bit grads overflow there too
    for run in report.runs:
        assert run.scales[0] == 65536.0 and run.scales[-1] < 65536.0
        # after a skip the scale halves
        for k in run.skipped[:-1]:
            assert run.scales[k + 1] == run.scales[k] / 2
    row = report.rows[1]
    assert row["skipped_steps"] == len(ampc_run.skipped) and row["final_scale"] < 65536


def dropout_model():
    return nn.Sequential(nn.Embedding(VOCAB, 16), nn.Dropout(0.3), nn.Linear(16, VOCAB))


def test_lockstep_gives_the_runs_of_one_after_another():
    """Lockstep keeps each run's random draws (dropout) apart: the same curves."""
    common = dict(steps=6, setups=("ampc", "ampc.master"), lr=1e-2, device="cpu",
                  progress=False)
    one = validate.compare(dropout_model, make_batch, **common)
    lock = validate.compare(dropout_model, make_batch, time_limit=600, **common)
    assert lock.config["lockstep"] and lock.config["steps"] == 6
    for a, b in zip([one.base] + one.spread_runs + one.runs,
                    [lock.base] + lock.spread_runs + lock.runs):
        assert a.name == b.name and a.losses == b.losses and a.grad_norms == b.grad_norms
        assert b.peak_mib is not None


def test_lockstep_stops_every_run_at_the_same_step():
    report = validate.compare(make_model, make_batch, steps=10_000, setups=("ampc",),
                              device="cpu", progress=False, time_limit=1.0)
    n = report.config["steps"]
    assert 3 <= n < 10_000 and report.config["steps_planned"] == 10_000
    assert all(len(r.losses) == n for r in [report.base] + report.spread_runs + report.runs)


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(steps=0), ValueError, "steps must be a positive int"),
    (dict(setups=("apex",)), ValueError, "unknown setup 'apex'"),
    (dict(setups=("ampc@fp8",)), ValueError, "dtype must be fp16 or bf16"),
    (dict(dtype=torch.float32), ValueError, "dtype must be torch.float16"),
    (dict(seeds=()), ValueError, "seeds must be"),
    (dict(device="tpu"), ValueError, "device must be 'cpu' or 'cuda'"),
])
def test_compare_bad_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        validate.compare(make_model, make_batch, **{"steps": 2, "progress": False, **kwargs})


def test_compare_refuses_a_16_bit_model():
    with pytest.raises(ValueError, match="must return an fp32 model; parameter 0.weight"):
        validate.compare(lambda: make_model().bfloat16(), make_batch, steps=2, progress=False)


class Cancel(nn.Module):
    """x -> [x, x] -> (256 I + w) x - 256 x = w x: in bf16, 256 + w[i, i] rounds to 256
    (spacing 2), so ``bad`` loses the diagonal of w: an ill-conditioned layer."""

    def __init__(self, width):
        super().__init__()
        self.dup = nn.Linear(width, 2 * width, bias=False)
        self.bad = nn.Linear(2 * width, width, bias=False)
        eye = torch.eye(width)
        with torch.no_grad():
            self.dup.weight.copy_(torch.cat([eye, eye]))
            w = 0.5 * torch.randn(width, width)
            self.bad.weight.copy_(torch.cat([256 * eye + w, -256 * eye], 1))

    def forward(self, x):
        return self.bad(self.dup(x))


def cancel_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 4), nn.Tanh(), Cancel(4), nn.Linear(4, 4))


def test_layers_finds_the_module_that_loses_precision_and_its_fix_works():
    model = cancel_model()
    batch = (torch.randn(32, 8), torch.randint(0, 4, (32,)))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    report = validate.layers(model, batch)
    worst = {r["module"]: r for r in report.rows}
    assert "2.bad" in [r["module"] for r in report.rows[:3]]
    assert worst["2.bad"]["added_err"] > 0.1 > 10 * worst["0"]["added_err"]
    assert report.suggestions == ["ampc.policy.module_scope(model[2].bad, dtype=torch.float32)"]
    assert "model[2].bad" in report.table()
    # the model itself is untouched
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())
    # paste the suggestion: the error goes
    exec(report.suggestions[0], {"ampc": ampc, "torch": torch, "model": model})
    fixed = {r["module"]: r for r in validate.layers(model, batch).rows}
    assert fixed["2.bad"]["output_err"] < worst["2.bad"]["output_err"] / 20
    assert fixed["(model)"]["output_err"] < worst["(model)"]["output_err"] / 10


def test_layers_matches_a_direct_measurement():
    """Output error of the last Linear against fp32 and bf16 runs done by hand."""
    model = cancel_model()
    batch = (torch.randn(16, 8), torch.randint(0, 4, (16,)))
    report = validate.layers(model, batch, dtype=torch.bfloat16)
    ref = model(batch[0])
    with ampc.autocast("cpu", dtype=torch.bfloat16):
        low = model(batch[0]).float()
    expect = (torch.linalg.vector_norm(low - ref) / torch.linalg.vector_norm(ref)).item()
    got = next(r for r in report.rows if r["module"] == "(model)")["output_err"]
    assert got == pytest.approx(expect, rel=1e-4)


def test_layers_fp16_underflow_and_overflow_at_the_loss_scale():
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4))
    torch.manual_seed(1)
    x, y = torch.randn(16, 8), torch.randint(0, 4, (16,))

    def tiny(out, t):
        return 1e-7 * nn.functional.cross_entropy(out.float(), t)

    low = validate.layers(model, (x, y), tiny, dtype=torch.float16, loss_scale=1.0)
    high = validate.layers(model, (x, y), tiny, dtype=torch.float16, loss_scale=2.0 ** 24)
    under_low = {r["module"]: r["underflow"] for r in low.rows}
    under_high = {r["module"]: r["underflow"] for r in high.rows}
    assert under_low["0"] > 0.5 and under_high["0"] == 0
    over = validate.layers(model, (x, y), lambda o, t: 1e9 * tiny(o, t), dtype=torch.float16,
                           loss_scale=2.0 ** 24)
    assert max(r["overflow"] for r in over.rows) > 0.5
    assert "underflow %" in low.table() and "loss scale 1" in low.table()
    bf16 = validate.layers(model, (x, y), dtype=torch.bfloat16)
    assert all(r["underflow"] is None for r in bf16.rows)
    assert "underflow" not in bf16.table()


def test_layers_takes_the_scale_of_a_scaler():
    scaler = ampc.GradScaler("cpu", init_scale=1024.0)
    model = nn.Sequential(nn.Linear(4, 4))
    report = validate.layers(model, (torch.randn(2, 4), torch.randint(0, 4, (2,))),
                             dtype=torch.float16, scaler=scaler)
    assert report.config["loss_scale"] == 1024.0


@pytest.mark.parametrize("model, batch, kwargs, error, match", [
    (nn.Linear(4, 4).bfloat16(), None, {}, ValueError, "parameter weight is torch.bfloat16"),
    (nn.Linear(4, 4), "x", {}, TypeError, "batch must be a pair"),
    (nn.Linear(4, 4), None, {"dtype": torch.float32}, ValueError, "dtype must be torch.float16"),
    ("model", None, {}, TypeError, "model must be an nn.Module"),
])
def test_layers_bad_arguments(model, batch, kwargs, error, match):
    batch = batch or (torch.randn(2, 4), torch.randint(0, 4, (2,)))
    with pytest.raises(error, match=f"ampc.validate.layers: {match}"):
        validate.layers(model, batch, **kwargs)


def test_expression_is_pasteable():
    assert expression("blocks.0.attn") == "model.blocks[0].attn"
    assert expression("3") == "model[3]"
    assert expression("(model)") == "model"


def test_save_without_matplotlib_says_so(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(_outputs, "pyplot", lambda: None)
    model_dir = _write_module(tmp_path)
    monkeypatch.syspath_prepend(str(model_dir))
    rc = cli.main(["tinymodel:make_model", "--steps", "3", "--setups", "ampc", "--seeds", "0",
                   "--out", str(tmp_path / "out")])
    out = capsys.readouterr().out
    assert rc == 0
    assert "matplotlib is not installed: no picture" in out
    assert sorted(os.listdir(tmp_path / "out")) == ["compare.json", "compare.txt"]


def _write_module(tmp_path):
    d = tmp_path / "mods"
    d.mkdir()
    (d / "tinymodel.py").write_text(
        "import torch\nfrom torch import nn\n"
        "def make_model():\n    return nn.Sequential(nn.Embedding(16, 16), nn.Linear(16, 16))\n"
        "def make_batch(step):\n    g = torch.Generator().manual_seed(step)\n"
        "    x = torch.randint(0, 16, (4, 5), generator=g)\n    return x, (x + 1) % 16\n"
        "def mse(out, target):\n    return (out.float() ** 2).mean()\n")
    sys.modules.pop("tinymodel", None)
    return d


def test_command_line(tmp_path, monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(_write_module(tmp_path)))
    out_dir = tmp_path / "out"
    rc = cli.main(["tinymodel:make_model", "--steps", "4", "--setups", "ampc,ampc.master@fp16",
                   "--layers", "--out", str(out_dir)])
    out = capsys.readouterr().out
    assert rc in (0, 1)            # 1 only if a setup ended outside fp32's spread
    assert "ampc.master fp16" in out and "weight-grad err" in out
    for name in ("compare.txt", "compare.json", "layers.txt", "layers.json"):
        assert (out_dir / name).exists()
    data = json.loads((out_dir / "compare.json").read_text())
    assert data["config"]["steps"] == 4 and len(data["summary"]) == 2


@pytest.mark.parametrize("argv, match", [
    (["nosuchmodule_xyz:f"], "cannot import 'nosuchmodule_xyz'"),
    (["tinymodel"], "model must be MODULE:NAME"),
    (["tinymodel:nothing"], "tinymodel has no callable 'nothing'"),
    (["tinymodel:make_model", "--steps", "0"], "--steps must be at least 1"),
    (["tinymodel:make_model", "--setups", "apex"], "unknown setup 'apex'"),
    (["tinymodel:make_model", "--seeds", "a"], "--seeds must be comma-separated ints"),
    (["tinymodel:make_model", "--dtype", "fp8"], "invalid choice: 'fp8'"),
])
def test_command_line_bad_arguments(argv, match, tmp_path, monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(_write_module(tmp_path)))
    with pytest.raises(SystemExit) as e:
        cli.main(argv + ["--out", str(tmp_path / "out")])
    assert e.value.code == 2
    assert match in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_smooth_and_gap():
    assert validate._run.smooth([1.0, 3.0, 5.0, 7.0], 2) == [1.0, 2.0, 4.0, 6.0]
    assert validate._run.rel_gap([1.1, 2.0], [1.0, 2.0]) == pytest.approx([0.1, 0.0])
    assert math.isnan(validate._run.smooth([1.0, float("nan")], 2)[1])


def test_the_cpu_peak_is_that_of_live_tensors_as_the_memory_report_counts_it():
    # fp32 weights, grads and AdamW's two moments: 16 bytes a parameter, ~16.8 MB here,
    # against a few hundred kB of activations; the batch exists before either measures
    def make():
        return nn.Sequential(nn.Linear(512, 1024), nn.ReLU(), nn.Linear(1024, 512))

    def mse(out, y):
        return nn.functional.mse_loss(out, y)
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(32, 512, generator=g), torch.randn(32, 512, generator=g))
               for _ in range(4)]
    report = validate.compare(make, lambda k: batches[k], steps=4, setups=("torch.amp",),
                              seeds=(0,), loss_fn=mse, progress=False, device="cpu")
    params = sum(p.numel() for p in make().parameters())
    model = make()
    measured = ampc.memory.report(model, torch.optim.AdamW(model.parameters(), fused=True),
                                  batches[0], mse).peak
    fp32 = report.base.peak_mib * 2**20
    assert 16 * params <= fp32 <= 1.1 * 16 * params
    assert abs(fp32 - measured) / measured < 0.05, (fp32, measured)
    # torch.amp: the same state; its bf16 copies of the weights add at most 2 bytes a param
    amp = report.runs[0].peak_mib * 2**20
    assert 16 * params <= amp <= fp32 + 2 * params + 2**20


def test_a_run_that_fails_leaves_no_measurement_running():
    # the CPU peak is measured under torch's profiler: a failure while building or in the
    # first steps must end it (left on, it records every op the process runs after)
    def half():
        return make_model().half()

    with pytest.raises(ValueError, match="must return an fp32 model"):
        validate.compare(half, make_batch, steps=3, setups=("ampc",), progress=False)
    assert not torch.autograd._profiler_enabled()

    def bad_batch(step):
        x, y = make_batch(step)
        return x, y[:, :3] if step == 1 else y
    with pytest.raises(Exception, match="step 1"):
        validate.compare(make_model, bad_batch, steps=3, setups=("ampc",), progress=False)
    assert not torch.autograd._profiler_enabled()
    model = make_model()
    rep = ampc.memory.report(model, torch.optim.AdamW(model.parameters()), make_batch(0))
    assert rep.peak > 0


def test_under_the_callers_profiler_the_cpu_peak_is_not_measured():
    # measuring would start and stop a profiler of its own, ending the caller's
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        report = validate.compare(make_model, make_batch, steps=4, setups=("ampc",),
                                  progress=False)
        assert torch.autograd._profiler_enabled()
    assert report.base.peak_mib is None and report.runs[0].peak_mib is None
    assert any(e.name == "aten::addmm" for e in prof.events())
