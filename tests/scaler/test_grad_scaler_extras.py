"""Tests of what ampc.GradScaler adds to torch.amp.GradScaler's contract, on the CPU:
no host sync with optimizers that unscale in their step, clipping folded into the step,
fp16 gradients, skipped-step counters, hysteresis and scale bounds, the min-scale error,
enabled="auto". The CUDA tests at the end run only on a machine with a GPU.

The optimizer side of the contract is played by FoldingSGD below, plain torch code that
follows it literally: grad_scale, found_inf and grad_clip_coef are read on the device.

Tolerances: exact wherever both sides do the same arithmetic. A clipped step depends on
the total norm, which ampc measures in one read-only pass (|inv_scale| * ||grads||, wide
accumulation) and torch after unscaling (fp32 norm of fp32 products): norms agree to
rel 1e-6, so clipped parameters agree to rel 1e-5.
"""
import math
import re
import warnings

import pytest
import torch

import ampc
import reference as ref
from test_grad_scaler import INF, NAN, PLANTS, backward, make_model, plant, train

SYNCS = ("item", "tolist", "__bool__", "__float__", "__int__", "__index__", "cpu", "numpy")


class FoldingSGD(torch.optim.Optimizer):
    """SGD over fp32 master weights that follows ampc's optimizer contract: the grad used
    is (grad * inv_scale) * clip_coef in fp32, and found_inf != 0 skips the step, all on
    the device."""

    _step_supports_amp_scaling = True
    _ampc_supports_clip_coef = True

    def __init__(self, params, lr):
        super().__init__(params, {"lr": lr})
        self.seen = []

    @torch.no_grad()
    def step(self, closure=None):
        scale = getattr(self, "grad_scale", None)
        coef = getattr(self, "grad_clip_coef", None)
        found = getattr(self, "found_inf", None)
        self.seen.append((scale, coef, found))
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad.float()
                if scale is not None:
                    g = g * scale.double().reciprocal().float()
                if coef is not None:
                    g = g * coef
                master = self.state[p].setdefault("master", p.detach().float().clone())
                stepped = master - group["lr"] * g
                if found is not None:
                    stepped = torch.where(found != 0, master, stepped)
                master.copy_(stepped)
                p.copy_(master)
        return "stepped"


class SyncCounter:
    """Counts calls of the Tensor methods that read a value back to the host."""

    def __init__(self, monkeypatch):
        self.calls = []
        self.paused = False
        for name in SYNCS:
            original = getattr(torch.Tensor, name)

            def counted(t, *args, _name=name, _original=original, **kwargs):
                if not self.paused:
                    self.calls.append(_name)
                return _original(t, *args, **kwargs)

            monkeypatch.setattr(torch.Tensor, name, counted)


def _sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.05)


# ---- host syncs ----

@pytest.mark.parametrize("make_opt,syncs_per_step", [
    (lambda m: FoldingSGD(m.parameters(), lr=0.05), 0),
    (lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2, fused=True), 0),
    (_sgd, 1),
    (lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2, foreach=True), 1),
], ids=["folding", "torch-fused", "sgd", "adamw-foreach"])
@pytest.mark.parametrize("clip", [False, True])
def test_host_syncs_per_step(monkeypatch, make_opt, syncs_per_step, clip):
    model = make_model()
    opt = make_opt(model)
    scaler = ampc.GradScaler("cpu", init_scale=1024.0, growth_interval=2, hysteresis=2,
                             max_scale=2.0 ** 20)
    folds = clip and isinstance(opt, FoldingSGD)
    counter = SyncCounter(monkeypatch)
    step_of_opt = opt.step

    def uncounted_step(*args, **kwargs):     # the optimizer's own reads are not ours
        counter.paused = True
        try:
            return step_of_opt(*args, **kwargs)
        finally:
            counter.paused = False

    opt.step = uncounted_step
    for step in range(6):
        opt.zero_grad()
        counter.paused = True
        backward(scaler, model, step, {3: [(INF, 0, 0)]})
        counter.paused = False
        counter.calls.clear()
        if clip:
            scaler.clip_grad_norm_(opt, 0.1)
        scaler.step(opt)
        scaler.update()
        want = 0 if folds else syncs_per_step
        assert len(counter.calls) == want, f"step {step}: host reads {counter.calls}"
    counter.paused = True
    # grows at steps 1 and 5; hysteresis 2 holds the scale through the inf at step 3
    assert scaler.get_scale() == 4096.0 and int(scaler.skipped_steps()) == 1


def test_kernels_do_the_work(monkeypatch):
    calls = []
    for name in ("unscale_check", "update_scale"):
        original = getattr(ampc.ops, name)

        def counted(*args, _name=name, _original=original, **kwargs):
            calls.append((_name, kwargs.get("check_only", False)))
            return _original(*args, **kwargs)

        monkeypatch.setattr(ampc.ops, name, counted)
    for make_opt, clip in ((_sgd, False), (lambda m: FoldingSGD(m.parameters(), 0.1), False),
                           (lambda m: FoldingSGD(m.parameters(), 0.1), True)):
        calls.clear()
        model = make_model()
        opt = make_opt(model)
        scaler = ampc.GradScaler("cpu")
        backward(scaler, model, 0, {})
        scaler.clip_grad_norm_(opt, 1.0) if clip else None
        scaler.step(opt)
        scaler.update()
        fused = isinstance(opt, FoldingSGD)
        assert calls == [("unscale_check", fused), ("update_scale", False)], calls


# ---- clipping ----

def _clip_runs(max_norm, steps=8, plants=PLANTS, dtype=torch.float32):
    """ampc: clip_grad_norm_ folded into FoldingSGD; torch: unscale_, clip_grad_norm_,
    the same optimizer. Returns both traces and both lists of norms."""
    out = {}
    for name, cls in {"ampc": ampc.GradScaler, "torch": torch.amp.GradScaler}.items():
        model = make_model(dtype=dtype)
        opt = FoldingSGD(model.parameters(), lr=0.05)
        scaler = cls("cpu", init_scale=2.0 ** 12, growth_interval=3)
        norms = []

        def clip(s, step):
            if name == "ampc":
                norms.append(s.clip_grad_norm_(opt, max_norm))
            else:
                s.unscale_(opt)
                norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm))

        out[name] = (train(scaler, model, opt, steps, plants, before_step=clip), norms, opt)
    return out


def test_clip_folded_without_clipping_is_exact():
    runs = _clip_runs(max_norm=1e6)
    (ours, our_norms, opt), (theirs, their_norms, _) = runs["ampc"], runs["torch"]
    for step, (o, t) in enumerate(zip(ours, theirs)):
        assert o[:3] == t[:3], f"step {step}: {o[:3]} vs {t[:3]}"
        assert all(a.equal(b) for a, b in zip(o[3], t[3])), f"step {step}: params differ"
    for step, (a, b) in enumerate(zip(our_norms, their_norms)):
        assert a.dtype == b.dtype == torch.float32 and a.shape == b.shape == ()
        if math.isfinite(b):
            assert math.isclose(a, b, rel_tol=1e-6), f"step {step}: norm {a} vs {b}"
        else:
            assert not math.isfinite(a), f"step {step}: norm {a} vs {b}"
    scale, coef, found = opt.seen[0]
    assert scale is not None and coef.dtype == torch.float32 and float(coef) == 1.0
    assert [float(f) for _, _, f in opt.seen] == [0, 0, 1, 1, 1, 0, 0, 0]


def test_clip_folded_matches_torch_clip_grad_norm():
    runs = _clip_runs(max_norm=0.05)
    (ours, our_norms, opt), (theirs, their_norms, _) = runs["ampc"], runs["torch"]
    clipped = 0
    for step, (o, t) in enumerate(zip(ours, theirs)):
        assert o[:3] == t[:3], f"step {step}: {o[:3]} vs {t[:3]}"
        for a, b in zip(o[3], t[3]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
        if math.isfinite(their_norms[step]):
            assert math.isclose(our_norms[step], their_norms[step], rel_tol=1e-6)
            clipped += float(their_norms[step]) > 0.05
    assert clipped >= 3, "max_norm never clipped: the test is not testing"
    assert float(opt.seen[0][1]) < 1.0


def test_clip_leaves_grads_untouched_until_the_step():
    model = make_model()
    opt = FoldingSGD(model.parameters(), lr=0.05)
    scaler = ampc.GradScaler("cpu", init_scale=64.0)
    backward(scaler, model, 0, {})
    before = [p.grad.clone() for p in model.parameters()]
    norm = scaler.clip_grad_norm_(opt, 0.01)
    assert all(b.equal(p.grad) for b, p in zip(before, model.parameters()))
    want = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.double() / 64)
                                                 for g in before]))
    assert math.isclose(norm, want, rel_tol=1e-6)


def test_clip_falls_back_silently_and_exactly():
    """Optimizers that cannot fold the clip, and norms other than 2: unscale_ then torch's
    clip_grad_norm_, bit for bit, with no warning."""
    cases = [(_sgd, 2.0), (lambda m: torch.optim.AdamW(m.parameters(), fused=True), 2.0),
             (lambda m: FoldingSGD(m.parameters(), lr=0.05), math.inf),
             (lambda m: FoldingSGD(m.parameters(), lr=0.05), 1.0)]
    for make_opt, norm_type in cases:
        grads = {}
        for name in ("ampc", "torch"):
            model = make_model()
            opt = make_opt(model)
            scaler = ampc.GradScaler("cpu", init_scale=2.0 ** 20 + 5)
            backward(scaler, model, 0, {})
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                if name == "ampc":
                    norm = scaler.clip_grad_norm_(opt, 0.01, norm_type)
                else:
                    scaler.unscale_(opt)
                    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01, norm_type)
            grads[name] = (norm, [p.grad.clone() for p in model.parameters()])
        what = f"{type(opt).__name__} norm_type {norm_type}"
        assert grads["ampc"][0].equal(grads["torch"][0]), what
        assert all(a.equal(b) for a, b in zip(grads["ampc"][1], grads["torch"][1])), what


def test_clip_misuse():
    model = make_model()
    opt = FoldingSGD(model.parameters(), lr=0.05)
    scaler = ampc.GradScaler("cpu")
    backward(scaler, model, 0, {})
    scaler.clip_grad_norm_(opt, 1.0)
    with pytest.raises(RuntimeError, match=r"^unscale_\(\) cannot follow clip_grad_norm_\(\)"):
        scaler.unscale_(opt)
    with pytest.raises(RuntimeError, match=r"^clip_grad_norm_\(\) cannot follow"):
        scaler.clip_grad_norm_(opt, 1.0)
    scaler.step(opt)
    with pytest.raises(RuntimeError, match=r"^clip_grad_norm_\(\) is being called after step"):
        scaler.clip_grad_norm_(opt, 1.0)
    scaler.update()
    # after unscale_, the clip is torch's on the unscaled grads
    backward(scaler, model, 1, {})
    scaler.unscale_(opt)
    twins = [torch.nn.Parameter(torch.zeros_like(p)) for p in model.parameters()]
    for t, p in zip(twins, model.parameters()):
        t.grad = p.grad.clone()
    norm = scaler.clip_grad_norm_(opt, 1e-3)
    assert norm > 1e-3 and norm.equal(torch.nn.utils.clip_grad_norm_(twins, 1e-3))
    assert all(t.grad.equal(p.grad) for t, p in zip(twins, model.parameters()))


# ---- fp16 gradients ----

def test_fp16_model_with_folded_clip_trains_where_torch_refuses():
    """fp16 weights and grads, fp32 masters in the optimizer: torch's scaler refuses to
    unscale them for clipping; ampc's folds unscale and clip into the fp32 step."""
    def run(cls, steps):
        model = make_model(dtype=torch.float16)
        opt = FoldingSGD(model.parameters(), lr=0.2)
        scaler = cls("cpu", init_scale=2.0 ** 16, growth_interval=5)
        losses = []
        for step in range(steps):
            opt.zero_grad()
            x, y = batch16(step)
            loss = torch.nn.functional.mse_loss(model(x).float(), y)
            scaler.scale(loss).backward()
            scaler.clip_grad_norm_(opt, 1.0) if cls is ampc.GradScaler else scaler.unscale_(opt)
            scaler.step(opt)
            scaler.update()
            losses.append(loss.item())
        return losses, scaler

    with pytest.raises(ValueError, match="^Attempting to unscale FP16 gradients.$"):
        run(torch.amp.GradScaler, 1)
    losses, scaler = run(ampc.GradScaler, 60)
    assert all(math.isfinite(v) for v in losses)
    assert sum(losses[-5:]) < 0.5 * sum(losses[:5]), f"no convergence: {losses[:5]} {losses[-5:]}"


TARGET = torch.randn(6, 3, generator=torch.Generator().manual_seed(99)) * 0.5


def batch16(step):
    """A linear target the model can learn: x in fp16, y in fp32."""
    x = torch.randn(16, 6, generator=torch.Generator().manual_seed(step))
    return x.half(), x @ TARGET


def test_fp16_grads_checked_and_skipped_in_the_fused_path():
    model = make_model(dtype=torch.float16)
    opt = FoldingSGD(model.parameters(), lr=0.1)
    scaler = ampc.GradScaler("cpu", init_scale=1024.0)
    backward16 = [p.detach().clone() for p in model.parameters()]
    x, y = batch16(0)
    scaler.scale(torch.nn.functional.mse_loss(model(x).float(), y)).backward()
    plant(model, INF, 2, 0)
    scaler.step(opt)
    scaler.update()
    assert all(a.equal(b) for a, b in zip(backward16, model.parameters()))
    assert bool(scaler.last_step_skipped()) and scaler.get_scale() == 512.0


# ---- skipped steps ----

@pytest.mark.parametrize("make_opt", [_sgd, lambda m: FoldingSGD(m.parameters(), lr=0.05)],
                         ids=["sgd", "folding"])
def test_skipped_steps_counted_on_the_device(make_opt):
    model = make_model()
    opt = make_opt(model)
    scaler = ampc.GradScaler("cpu", init_scale=2.0 ** 12, growth_interval=3)
    assert int(scaler.skipped_steps()) == 0 and not bool(scaler.last_step_skipped())
    skipped = []
    for step in range(10):
        opt.zero_grad()
        backward(scaler, model, step, PLANTS)
        scaler.step(opt)
        scaler.update()
        last = scaler.last_step_skipped()
        assert last.dtype == torch.bool and last.shape == ()
        skipped.append(bool(last))
    assert [s for s, v in enumerate(skipped) if v] == sorted(PLANTS)
    count = scaler.skipped_steps()
    assert count.dtype == torch.int64 and int(count) == len(PLANTS)


# ---- hysteresis, bounds, the min-scale error ----

SCALE_RULES = [dict(hysteresis=2), dict(hysteresis=3, min_scale=256.0, max_scale=8192.0),
               dict(min_scale=1000.0), dict(max_scale=5000.0)]


@pytest.mark.parametrize("rule", SCALE_RULES,
                         ids=lambda r: "-".join(f"{k}{v:g}" for k, v in r.items()))
def test_scale_rules_follow_the_reference(rule):
    plants = {s: [(INF, 0, 0)] for s in (2, 3, 5, 6, 7, 8, 14, 15, 16, 17, 18)}
    model = make_model()
    opt = _sgd(model)
    scaler = ampc.GradScaler("cpu", init_scale=2048.0, growth_interval=2, **rule)
    trace = train(scaler, model, opt, 22, plants)
    state = (2048.0, 0, rule.get("hysteresis", 1))
    for step, (scale, tracker, ran, _) in enumerate(trace):
        state = ref.update_scale(*state, 1.0 if step in plants else 0.0, 2.0, 0.5, 2,
                                 min_scale=rule.get("min_scale", 0.0),
                                 max_scale=rule.get("max_scale", math.inf),
                                 hysteresis=rule.get("hysteresis", 1))
        assert (scale, tracker) == state[:2], f"{rule} step {step}: {(scale, tracker)} vs {state}"
        assert (ran is None) == (step in plants), f"{rule} step {step}: every inf step skips"
    assert len({t[0] for t in trace}) > 2, "the scale never moved: the test is not testing"
    sd = scaler.state_dict()
    assert {k: sd[k] for k in rule} == rule
    twin = ampc.GradScaler("cpu")
    twin.load_state_dict(sd)
    assert twin.state_dict() == sd
    torch_twin = torch.amp.GradScaler("cpu")
    torch_twin.load_state_dict(sd)          # torch ignores ampc's extra keys
    assert torch_twin.get_scale() == trace[-1][0]


def _overflow_forever(scaler, steps, clean=()):
    model = make_model()
    opt = FoldingSGD(model.parameters(), lr=0.05)
    for step in range(steps):
        opt.zero_grad()
        backward(scaler, model, step, {} if step in clean else {step: [(NAN, 0, 0)]})
        scaler.step(opt)
        scaler.update()


def test_scale_stuck_at_min_raises():
    # 8 -> 4 -> 2 -> 1 (= min), then overflows at the min: the 3rd one raises
    scaler = ampc.GradScaler("cpu", init_scale=8.0, min_scale=1.0, min_scale_patience=3)
    with pytest.raises(RuntimeError, match=r"^ampc.GradScaler: 3 steps in a row had inf or "
                                           r"nan gradients with the loss scale already at "
                                           r"min_scale=1.0") as info:
        _overflow_forever(scaler, 20)
    assert int(scaler.skipped_steps()) == 6 and scaler.get_scale() == 1.0, str(info.value)


def test_scale_at_min_with_clean_steps_between_does_not_raise():
    scaler = ampc.GradScaler("cpu", init_scale=8.0, min_scale=1.0, min_scale_patience=3)
    _overflow_forever(scaler, 30, clean=range(5, 30, 3))
    scaler = ampc.GradScaler("cpu", init_scale=8.0, min_scale=1.0, min_scale_patience=None)
    _overflow_forever(scaler, 30)
    assert scaler.get_scale() == 1.0


@pytest.mark.parametrize("kwargs,message", [
    (dict(hysteresis=0), "hysteresis must be an int >= 1"),
    (dict(hysteresis=1.5), "hysteresis must be an int >= 1"),
    (dict(min_scale=-1.0), "need 0 <= min_scale <= max_scale"),
    (dict(min_scale=10.0, max_scale=1.0), "need 0 <= min_scale <= max_scale"),
    (dict(max_scale=0.0), "need 0 <= min_scale <= max_scale and max_scale > 0"),
    (dict(min_scale_patience=0), "min_scale_patience must be None or an int >= 1"),
    (dict(enabled="yes"), "enabled must be a bool or 'auto'"),
])
def test_bad_settings(kwargs, message):
    with pytest.raises(ValueError, match="^" + re.escape("ampc.GradScaler: " + message)):
        ampc.GradScaler("cpu", **kwargs)


# ---- enabled="auto" ----

def test_auto_enables_only_for_float16():
    assert not ampc.GradScaler("cpu", enabled="auto").is_enabled()          # cpu: bf16
    assert ampc.GradScaler("cpu", enabled="auto", dtype=torch.float16).is_enabled()
    assert not ampc.GradScaler("cpu", enabled="auto", dtype=torch.bfloat16).is_enabled()
    with warnings.catch_warnings():
        warnings.simplefilter("error")                  # bf16 on cuda: off, and no warning
        assert not ampc.GradScaler("cuda", enabled="auto", dtype=torch.bfloat16).is_enabled()
    if torch.cuda.is_available():
        assert ampc.GradScaler("cuda", enabled="auto").is_enabled()          # cuda: fp16


# ---- CUDA ----

@pytest.mark.cuda
def test_no_host_sync_on_cuda():
    model = make_model().cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    scaler = ampc.GradScaler("cuda", init_scale=1024.0, growth_interval=2, hysteresis=2,
                             min_scale=1.0)
    x, y = torch.randn(5, 6, device="cuda"), torch.randn(5, 3, device="cuda")
    for step in range(4):
        opt.zero_grad()
        torch.cuda.set_sync_debug_mode("error")
        try:
            loss = torch.nn.functional.mse_loss(model(x), y)
            scaler.scale(loss).backward()
            scaler.clip_grad_norm_(opt, 1.0) if step % 2 else None
            scaler.step(opt)
            scaler.update()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    assert int(scaler.skipped_steps()) == 0


@pytest.mark.cuda
@pytest.mark.parametrize("fused", [False, True])
def test_trajectory_matches_torch_on_cuda(fused):
    traces = {}
    for name, cls in {"ampc": ampc.GradScaler, "torch": torch.amp.GradScaler}.items():
        model = make_model().cuda()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=fused)
        scaler = cls("cuda", init_scale=2.0 ** 12, growth_interval=3)
        trace = []
        for step in range(10):
            opt.zero_grad()
            x, y = (t.cuda() for t in _batch_cpu(step))
            scaler.scale(torch.nn.functional.mse_loss(model(x), y)).backward()
            if step in (2, 5):
                list(model.parameters())[0].grad[0, 0] = NAN
            scaler.step(opt)
            scaler.update()
            trace.append((scaler.get_scale(), [p.detach().cpu() for p in model.parameters()]))
        traces[name] = trace
    for (sa, pa), (sb, pb) in zip(traces["ampc"], traces["torch"]):
        assert sa == sb and all(a.equal(b) for a, b in zip(pa, pb))


@pytest.mark.cuda
def test_scale_stuck_at_min_raises_on_cuda_a_little_late():
    scaler = ampc.GradScaler("cuda", init_scale=8.0, min_scale=1.0, min_scale_patience=3)
    model = make_model().cuda()
    opt = torch.optim.AdamW(model.parameters(), fused=True)
    with pytest.raises(RuntimeError, match="steps in a row had inf or nan"):
        for step in range(40):
            opt.zero_grad()
            x, y = (t.cuda() for t in _batch_cpu(step))
            scaler.scale(torch.nn.functional.mse_loss(model(x), y) * INF).backward()
            scaler.step(opt)
            scaler.update()
            torch.cuda.synchronize()        # lets each host copy land before the next look
    assert step <= 8


def _batch_cpu(step):
    g = torch.Generator().manual_seed(step)
    return torch.randn(5, 6, generator=g), torch.randn(5, 3, generator=g)
