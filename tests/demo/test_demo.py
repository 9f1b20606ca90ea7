"""python -m ampc.demo: a shortened, seeded run trains, tracks fp32 and writes its
outputs; bad flags stop with a message."""
import json
import os
import subprocess
import sys

import pytest
import torch

from ampc import demo
from ampc.demo import _report, _sizing, _text
from ampc import _outputs


def test_short_demo_tracks_fp32_and_writes_outputs(tmp_path, capsys):
    out = tmp_path / "out"
    assert demo.main(["--device", "cpu", "--size", "micro", "--steps", "30", "--seed", "0",
                      "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    data = json.loads((out / "demo.json").read_text())
    rows = {r["setup"]: r for r in data["table"]}
    names = list(rows)
    assert names[:4] == ["fp32", "torch.amp bf16", "ampc drop-in bf16",
                         "ampc master weights bf16"]
    # the plan's region: a 16-bit type where some module measured faster in it, else fp32
    auto = names[4]
    assert auto in ("ampc auto bf16", "ampc auto fp16", "ampc auto fp32")
    memory = names[5]
    assert memory in ("ampc memory bf16", "ampc memory fp16", "ampc memory fp32")
    assert names[6:] == ["ampc lean bf16"]
    fp32 = rows["fp32"]["val_loss"]
    for name in ("ampc drop-in bf16", "ampc master weights bf16", auto, memory,
                 "ampc lean bf16"):
        assert abs(rows[name]["val_loss"] - fp32) / fp32 < 0.02, name
    # the memory arm: searched for half torch.amp's peak; met or not, its trained step's
    # peak (live tensors) is under torch.amp's and the line says what it reached
    peak = data["memory_plan"]["peak"]
    assert rows[memory]["peak_mib"] < rows["torch.amp bf16"]["peak_mib"]
    assert rows[memory]["memory_vs_torch_amp"] < 1
    assert 'objective="memory": a step\'s peak asked at 0.5x torch.amp\'s' in printed
    assert f"{peak['bytes'] / 2**20:.1f} MiB" in printed
    assert data["memory_search_s"] > 0 and (out / "memory_plan.json").stat().st_size > 100
    plan = data["plan"]
    assert {u["choice"] for u in plan["units"]} <= {"fp32", "bf16", "fp16", "fp8"}
    assert data["search_s"] > 0 and "ampc.autoprecision:" in printed
    assert f"ampc auto's search took {data['search_s']:.1f} s" in printed
    assert (out / "plan.json").stat().st_size > 100
    # the plan's code: the scopes to paste, or, for an all-fp32 plan, that there are none
    pasted = (out / "plan.txt").read_text()
    if any(u["choice"] != "fp32" for u in plan["units"]):
        assert "module_scope" in pasted
    else:
        assert "every module computes in fp32: nothing to set" in pasted
    # it learned: the first step's loss is about ln(98) = 4.6
    first = data["compare"]["runs"][0]["losses"][0]
    assert first > 4 and rows["fp32"]["train_loss"] < first - 0.8
    assert data["config"]["steps"] == 30 and data["config"]["size"] == "micro"
    assert all(r["tokens_per_s"] > 0 and r["peak_mib"] is not None for r in rows.values())
    # state bytes a parameter, measured: 16 for fp32 and torch.amp (fp32 weights, grads and
    # two moments) and ampc master (bf16 weight and grad, fp32 master and moments); most of
    # the micro model's tensors are under 4,096 elements and keep fp32 moments in the lean
    # arm too: its saving is the master's 4 bytes and some more
    per = {name: r["state_bytes_per_param"] for name, r in rows.items()}
    for name in ("fp32", "torch.amp bf16", "ampc master weights bf16"):
        assert abs(per[name] - 16) < 0.1, (name, per[name])
    assert per["ampc lean bf16"] < per["ampc master weights bf16"] - 3.5
    assert "state B/param" in printed
    assert "speed vs torch.amp" in printed and "within spread" in printed
    assert "sample from the ampc master-weight model" in printed
    for name in ("demo.txt", "demo.json", "layers.txt", "layers.json", "plan.txt"):
        assert (out / name).stat().st_size > 100
    if _outputs.pyplot() is not None:
        assert (out / "demo.png").stat().st_size > 10_000
        assert f"picture: {out / 'demo.png'}" in printed
    else:
        assert "matplotlib is not installed" in printed


@pytest.mark.parametrize("argv, match", [
    (["--steps", "3"], "argument --steps: must be at least 10"),
    (["--dtype", "fp8"], "argument --dtype: invalid choice: 'fp8'"),
    (["--size", "huge"], "argument --size: invalid choice: 'huge'"),
    (["--device", "tpu"], "argument --device: invalid choice: 'tpu'"),
    (["--budget", "5"], "argument --budget: must be between 30 and 3600"),
    (["--steps", "ten"], "argument --steps: invalid int value: 'ten'"),
])
def test_bad_flags_exit_with_a_message(argv, match, capsys):
    with pytest.raises(SystemExit) as e:
        demo.main(argv)
    assert e.value.code == 2
    assert match in capsys.readouterr().err


def test_out_must_be_a_folder(tmp_path, capsys):
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(SystemExit):
        demo.main(["--out", str(f)])
    assert "exists and is not a folder" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
def test_cuda_without_a_gpu(capsys):
    with pytest.raises(SystemExit):
        demo.main(["--device", "cuda"])
    assert "torch sees no GPU" in capsys.readouterr().err


def test_command_line_bad_flag():
    """The real command line: a bad value, exit status 2 and the message on stderr."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    out = subprocess.run([sys.executable, "-m", "ampc.demo", "--steps", "-1"],
                         capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 2
    assert "argument --steps: must be at least 10" in out.stderr


def test_text_comes_from_the_standard_library():
    lib, files = _text.stdlib_files()
    assert any(f.endswith(os.sep + "os.py") for f in files)
    train, val, vocab, described = _text.load_text(max_chars=200_000)
    assert len(train) > 40_000 and len(val) > 2_000 and lib in described
    # the characters first, then the most frequent longer pieces: a vocabulary of thousands
    assert vocab.pieces[:len(_text.CHARS)] == _text.CHARS
    assert 1_000 < len(vocab.pieces) <= _text.VOCAB_SIZE and len(set(vocab.pieces)) == len(vocab.pieces)
    assert "def" in vocab.index and "self" in vocab.index
    assert int(train.max()) < _text.VOCAB_SIZE and train.dtype == torch.int16
    text = vocab.decode(train.tolist())
    assert set(text) <= set(_text.CHARS) and vocab.encode(text).equal(train)
    # every tenth file is held out: the validation text is not inside the training text
    assert vocab.decode(val[:200].tolist()) not in text
    # one character a token, on request (the benchmarks' character-level models)
    chars, _, by_char, _ = _text.load_text(max_chars=200_000, vocab_size=len(_text.CHARS))
    assert by_char.pieces == _text.CHARS and by_char.decode(chars.tolist()) == text


def test_the_search_is_weighed_against_the_time_its_plan_saves():
    def rows(fp32, amp, auto):
        return [{"kind": k, "step_ms": ms} for k, ms in
                (("fp32", fp32), ("torch.amp", amp), ("ampc.auto", auto))]
    # 6 s of search, 5 ms a step saved against torch.amp (faster than fp32): 1,200 steps
    line, steps = _report.search_payback(rows(80.0, 58.0, 53.0), 6.0, 263, all_fp32=False)
    assert steps == 1201 and "saves 5.0 ms a step against torch.amp" in line
    assert "after 1,201 steps (this demo trains 263)" in line
    line, steps = _report.search_payback(rows(80.0, 58.0, 60.0), 6.0, 263, all_fp32=False)
    assert steps is None and "does not pay for itself" in line
    # an all-fp32 plan 0.1 ms under fp32's step is fp32's step: nothing to pay back
    line, steps = _report.search_payback(rows(4.4, 11.8, 4.3), 0.7, 400, all_fp32=True)
    assert steps is None and "found nothing faster than fp32" in line


def test_choose_takes_the_largest_size_that_fits():
    class Args:
        size, steps, device = "auto", 0, "cpu"

    per_step = {"micro": 0.01, "tiny": 0.05, "small": 0.4, "medium": 5.0, "large": 50.0}
    speeds = {"fp32": 1e9, "low": 1e9}         # no lower bound rules a size out
    probed = []

    def probe(size):
        probed.append(size)
        return per_step[size], 2.0, 1.5          # 2 s of search; torch.amp 1.5x fp32
    size, steps = _sizing.choose(Args, speeds, probe, lambda: 100.0, lambda line: None)
    # small: 100 s less the reserve and the search over 1.1 x 0.4 s -> 186 steps; medium 14
    per_small = _sizing.SAFETY * 0.4
    assert size == "small" and steps == int((100 - _sizing.AFTER_S - 2.0) / per_small
                                            - _sizing.VAL_BATCHES / 3)
    assert probed == ["small", "medium"]        # from the floor up: micro and tiny not sized
    # a busy machine: small's steps slow, still small (for fewer steps), never a smaller size
    per_step["small"] = 1.0
    probed.clear()
    size, steps = _sizing.choose(Args, speeds, probe, lambda: 100.0, lambda line: None)
    assert size == "small" and probed == ["small"] and _sizing.FLOOR_STEPS <= steps < 150
    # where 16-bit matmuls are many times slower than fp32's, no floor: the smaller sizes
    probed.clear()
    size, _ = _sizing.choose(Args, {"fp32": 1e9, "low": 1e7}, probe, lambda: 100.0,
                             lambda line: None)
    assert probed[0] == "micro" and size == "tiny"
    Args.size, Args.steps = "tiny", 25
    assert _sizing.choose(Args, speeds, probe, lambda: 100.0, lambda line: None) == ("tiny", 25)
    Args.size, Args.steps = "large", 0                # too slow: the floor of steps, said so
    lines = []
    assert _sizing.choose(Args, speeds, probe, lambda: 100.0, lines.append) == ("large", 20)
    assert "slow" in lines[-1]


def test_qat_after_amp_example():
    """examples/qat_after_amp.py on its tiny model: the fp32 export of the master weights
    and the int8 model after QAT both keep the accuracy of the mixed-precision model."""
    import importlib.util
    path = os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, "examples", "qat_after_amp.py")
    spec = importlib.util.spec_from_file_location("qat_after_amp", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    acc = example.main(["--steps", "150", "--qat-steps", "30"])
    assert acc["fp32 export"] > 0.85                  # chance is 0.25
    assert abs(acc["fp32 export"] - acc["bf16 (ampc master weights)"]) < 0.03
    assert acc["int8 after QAT"] > acc["fp32 export"] - 0.03
