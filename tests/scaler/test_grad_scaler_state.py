"""The scaler's whole state in checkpoints, and the per-step record, on the CPU.

Resume: a run with hysteresis, scale bounds and the stuck-at-min watch is checkpointed
after every step in turn (model, optimizer, scaler through torch.save/torch.load), loaded
into fresh objects built with default arguments, and continued: every counter and every
parameter equals the uninterrupted run's at every later step, and both raise the
stuck-at-min error at the same step. Records: what read_step_records() reads in one
transfer equals the values read step by step. All exact.
"""
import copy
import io
import math
import pickle

import pytest
import torch

import ampc
from test_grad_scaler import INF, NAN, PLANTS, backward, make_model
from test_grad_scaler_extras import FoldingSGD, SyncCounter

SETTINGS = dict(init_scale=64.0, growth_interval=2, hysteresis=2, min_scale=4.0,
                max_scale=128.0, min_scale_patience=4)
# clean steps grow 64 -> 128 (max); the runs of overflows back off to 4 (min) with
# hysteresis, skip at the minimum, recover once, then overflow until the watch raises
RESUME_PLANTS = {s: [(NAN if s % 2 else INF, s % 4, 0)]
                 for s in (2, 3, 6, 7, 8, 9, 10, 11, 12, 13, 14, 18, 19, 20, 21, 22, 23)}
STEPS = 26


def _state(scaler, model):
    """Everything the scaler decides and reports by, and the params, after one step."""
    sd = scaler.state_dict()
    return ({k: sd[k] for k in ("scale", "_growth_tracker", "_hysteresis_tracker",
                                "_skips_at_min")},
            int(scaler.skipped_steps()), bool(scaler.last_step_skipped()),
            [p.detach().clone() for p in model.parameters()])


def _run(model, opt, scaler, first, last):
    """Steps first..last-1; returns the states and the step that raised (or None)."""
    states = []
    for step in range(first, last):
        opt.zero_grad()
        backward(scaler, model, step, RESUME_PLANTS)
        scaler.clip_grad_norm_(opt, 0.5)
        scaler.step(opt)
        try:
            scaler.update()
        except RuntimeError as e:
            assert "steps in a row had inf or nan" in str(e)
            return states, step
        states.append(_state(scaler, model))
    return states, None


def _fresh(**settings):
    model = make_model()
    return (model, ampc.optim.AdamW(model.parameters(), lr=1e-2),
            ampc.GradScaler("cpu", **settings))


def _save(model, opt, scaler):
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(),
                "scaler": scaler.state_dict()}, buf)
    buf.seek(0)
    return torch.load(buf)               # weights_only: the state is plain values


def _assert_same_states(got, want, what):
    assert len(got) == len(want), what
    for i, (g, w) in enumerate(zip(got, want)):
        assert g[:3] == w[:3], f"{what}, step {i}: {g[:3]} vs {w[:3]}"
        assert all(a.equal(b) for a, b in zip(g[3], w[3])), f"{what}, step {i}: params"


def _uninterrupted():
    return _run(*_fresh(**SETTINGS), 0, STEPS)


def test_the_run_exercises_every_counter():
    states, raised = _uninterrupted()
    assert raised is not None and raised < STEPS
    scales = [s[0]["scale"] for s in states]
    assert max(scales) == 128.0 and min(scales) == 4.0
    assert {s[0]["_hysteresis_tracker"] for s in states} >= {0, 1, 2}
    assert max(s[0]["_skips_at_min"] for s in states) >= 2
    assert states[-1][1] >= 10 and any(s[2] for s in states) and not all(s[2] for s in states)


def test_resume_after_any_step_equals_the_uninterrupted_run():
    want, want_raised = _uninterrupted()
    for stop in range(1, want_raised):
        model, opt, scaler = _fresh(**SETTINGS)
        head, _ = _run(model, opt, scaler, 0, stop)
        checkpoint = _save(model, opt, scaler)
        model, opt, scaler = _fresh()                  # default settings: all from the file
        model.load_state_dict(checkpoint["model"])
        opt.load_state_dict(checkpoint["opt"])
        scaler.load_state_dict(checkpoint["scaler"])
        assert scaler.state_dict() == checkpoint["scaler"]
        tail, raised = _run(model, opt, scaler, stop, STEPS)
        _assert_same_states(head + tail, want, f"resumed after step {stop - 1}")
        assert raised == want_raised, f"resumed after step {stop - 1}"


def test_pickled_scaler_resumes_with_its_counters():
    want, want_raised = _uninterrupted()
    model, opt, scaler = _fresh(**SETTINGS)
    head, _ = _run(model, opt, scaler, 0, 13)
    back = pickle.loads(pickle.dumps(scaler))
    assert back._scale is None and back.state_dict() == scaler.state_dict()
    tail, raised = _run(model, opt, back, 13, STEPS)
    _assert_same_states(head + tail, want, "unpickled after step 12")
    assert raised == want_raised


def test_unpickles_a_scaler_pickled_before_the_counters_were_kept():
    state = ampc.GradScaler("cpu", init_scale=8.0).__getstate__()
    for key in ("_init_skipped", "_init_last_skipped", "_init_skips_at_min", "_records"):
        del state[key]
    back = ampc.GradScaler.__new__(ampc.GradScaler)
    back.__setstate__(state)
    back.scale(torch.ones(()))
    assert int(back.skipped_steps()) == 0 and back.step_records() == []
    assert back.state_dict()["scale"] == 8.0 and back.state_dict()["_skipped_steps"] == 0


def test_checkpoint_keys():
    sd = ampc.GradScaler("cpu", **SETTINGS).state_dict()
    assert sd == {"scale": 64.0, "growth_factor": 2.0, "backoff_factor": 0.5,
                  "growth_interval": 2, "_growth_tracker": 0, "hysteresis": 2,
                  "_hysteresis_tracker": 2, "min_scale": 4.0, "max_scale": 128.0,
                  "min_scale_patience": 4, "_skipped_steps": 0, "_last_step_skipped": None,
                  "_skips_at_min": 0}
    torch_scaler = torch.amp.GradScaler("cpu")
    torch_scaler.load_state_dict(sd)                # torch reads its five keys
    assert torch_scaler.state_dict() == {k: sd[k] for k in list(sd)[:5]}


def test_torch_checkpoint_keeps_settings_and_restarts_counters():
    model, opt, scaler = _fresh(**SETTINGS)
    _run(model, opt, scaler, 0, 10)
    assert int(scaler.skipped_steps()) > 0
    source = torch.amp.GradScaler("cpu", init_scale=32.0)
    scaler.load_state_dict(source.state_dict())
    sd = scaler.state_dict()
    assert (sd["scale"], sd["hysteresis"], sd["min_scale"], sd["min_scale_patience"]) == \
        (32.0, 2, 4.0, 4)
    assert (sd["_skipped_steps"], sd["_last_step_skipped"], sd["_skips_at_min"],
            sd["_hysteresis_tracker"]) == (0, None, 0, 2)
    assert int(scaler.skipped_steps()) == 0


@pytest.mark.parametrize("key,value,message", [
    ("_skipped_steps", -1, "_skipped_steps must be an int >= 0, got -1"),
    ("_skips_at_min", 1.5, "_skips_at_min must be an int >= 0, got 1.5"),
    ("_last_step_skipped", 2, "_last_step_skipped must be None or a bool, got 2"),
    ("_hysteresis_tracker", "1", "_hysteresis_tracker must be an int"),
    ("hysteresis", 0, "hysteresis must be an int >= 1"),
    ("min_scale_patience", 0, "min_scale_patience must be None or an int >= 1"),
])
def test_bad_checkpoint_is_refused_before_anything_changes(key, value, message):
    model, opt, scaler = _fresh(**SETTINGS)
    _run(model, opt, scaler, 0, 4)
    before = scaler.state_dict()
    bad = {**ampc.GradScaler("cpu", init_scale=8.0).state_dict(), key: value}
    with pytest.raises(ValueError, match=message):
        scaler.load_state_dict(bad)
    assert scaler.state_dict() == before


# ---- the per-step record ----

def _same(a, b):
    """Equal, a nan matching a nan (the norm of a step with a planted nan)."""
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(map(_same, a, b))
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a):
        return math.isnan(b)
    return a == b and type(a) is type(b)


def _recorded_run(make_opt, steps, clip_at, scaler_kw):
    """Trains; returns the scaler and the record of each step read on the spot."""
    model = make_model()
    opts = make_opt(model)
    scaler = ampc.GradScaler("cpu", init_scale=2.0 ** 12, growth_interval=2, **scaler_kw)
    want = []
    for step in range(steps):
        for opt in opts:
            opt.zero_grad()
        backward(scaler, model, step, PLANTS)
        scale = scaler.get_scale()
        norms = [float(scaler.clip_grad_norm_(opt, 0.1)) for opt in opts] \
            if step in clip_at else []
        for opt in opts:
            scaler.step(opt)
        scaler.update()
        norm = None if not norms else norms[0] if len(norms) == 1 else norms
        want.append({"scale": scale, "skipped": bool(scaler.last_step_skipped()),
                     "grad_norm": norm})
    return scaler, want


OPTS = {"ampc-adamw": lambda m: [ampc.optim.AdamW(m.parameters(), lr=1e-2)],
        "sgd": lambda m: [torch.optim.SGD(m.parameters(), lr=0.05)],
        "two": lambda m: [torch.optim.SGD(list(m.parameters())[:2], lr=0.05),
                          FoldingSGD(list(m.parameters())[2:], lr=0.05)]}


@pytest.mark.parametrize("opt", OPTS)
def test_records_read_at_once_equal_the_step_values(monkeypatch, opt):
    scaler, want = _recorded_run(OPTS[opt], 12, clip_at=set(range(12)) - {5, 6},
                                 scaler_kw=dict(step_records=100))
    records = scaler.step_records()
    assert len(records) == 12 and all(isinstance(r, ampc.grad_scaler.StepRecord)
                                      for r in records)
    assert records[0].scale.dtype == torch.float32 and records[0].skipped.dtype == torch.bool
    counter = SyncCounter(monkeypatch)
    got = scaler.read_step_records()
    assert counter.calls == ["tolist"], counter.calls        # one read for the window
    counter.paused = True
    assert len(got) == len(want)
    for step, (g, w) in enumerate(zip(got, want)):
        assert _same(list(g.values()), list(w.values())) and list(g) == list(w), \
            f"step {step}: read {g}, step by step {w}"
    assert len({w["scale"] for w in want}) > 2 and sum(w["skipped"] for w in want) == 4
    assert scaler.read_step_records() == [] and scaler.step_records() == []   # cleared


def test_records_keep_the_last_window_and_cost_no_host_sync(monkeypatch):
    model = make_model()
    opt = FoldingSGD(model.parameters(), lr=0.05)
    scaler = ampc.GradScaler("cpu", init_scale=2.0 ** 12, growth_interval=2, step_records=4)
    counter = SyncCounter(monkeypatch)
    for step in range(10):
        counter.paused = True
        opt.zero_grad()
        backward(scaler, model, step, PLANTS)
        counter.paused = False
        scaler.clip_grad_norm_(opt, 0.1)
        scaler.step(opt)
        scaler.update()
    assert counter.calls == [], counter.calls
    counter.paused = True
    got = scaler.read_step_records(clear=False)
    assert [r["skipped"] for r in got] == [False, False, False, True]   # steps 6-9
    again = scaler.read_step_records()
    assert len(got) == 4 and all(_same(list(a.values()), list(b.values()))
                                 for a, b in zip(got, again))
    assert ampc.grad_scaler.read_step_records([]) == []


def test_records_off_by_default_and_checked():
    scaler, _ = _recorded_run(OPTS["sgd"], 3, clip_at=(), scaler_kw={})
    assert scaler.step_records() == [] and scaler.read_step_records() == []
    with pytest.raises(ValueError, match="^ampc.GradScaler: step_records must be an int >= 0"):
        ampc.GradScaler("cpu", step_records=-1)
    scaler, _ = _recorded_run(OPTS["sgd"], 3, clip_at=(), scaler_kw=dict(step_records=2))
    back = copy.deepcopy(scaler)                      # records are a log: not carried
    assert back.step_records() == [] and back._records.maxlen == 2


@pytest.mark.cuda
def test_static_scaling_and_records_without_host_sync_on_cuda():
    model = make_model().cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    scaler = ampc.GradScaler("cuda", init_scale=1024.0, dynamic=False, step_records=8)
    x, y = torch.randn(5, 6, device="cuda"), torch.randn(5, 3, device="cuda")
    norms = []
    for step in range(4):
        opt.zero_grad()
        torch.cuda.set_sync_debug_mode("error")
        try:
            loss = torch.nn.functional.mse_loss(model(x), y) * (math.inf if step == 2 else 1)
            scaler.scale(loss).backward()
            norms.append(scaler.clip_grad_norm_(opt, 1.0))
            scaler.step(opt)
            scaler.update()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    got = scaler.read_step_records()
    assert [(r["scale"], r["skipped"]) for r in got] == [(1024.0, s == 2) for s in range(4)]
    assert _same([r["grad_norm"] for r in got], [float(n) for n in norms])
    assert int(scaler.skipped_steps()) == 1 and scaler.get_scale() == 1024.0
