"""Differential tests of ampc.GradScaler against torch.amp.GradScaler on the CPU.

Both scalers train copies of one model on the same data with the same optimizer, with
infs and nans planted in chosen gradients at chosen steps. Everything is exact: the scale
after every update() (compared as a float), the growth tracker, which steps ran (the
value step() returned), every parameter after every step (torch.equal), state_dicts.
Misuse raises the same exception type with the same message.
"""
import copy
import io
import math
import pickle
import warnings
from collections import namedtuple

import pytest
import torch

import ampc

INF, NAN = math.inf, math.nan
SCALERS = {"torch": torch.amp.GradScaler, "ampc": ampc.GradScaler}


def make_model(seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(),
                               torch.nn.Linear(8, 3)).to(dtype)


def batch(step, dtype=torch.float32):
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(5, 6, generator=g, dtype=dtype), torch.randn(5, 3, generator=g,
                                                                    dtype=dtype)


def plant(model, value, param=0, index=1):
    """Writes value into one element of one parameter's gradient."""
    grad = list(model.parameters())[param].grad
    grad.view(-1)[index] = value


def backward(scaler, model, step, plants, divide=1):
    x, y = batch(step)
    loss = torch.nn.functional.mse_loss(model(x), y) / divide
    scaler.scale(loss).backward()
    for value, param, index in plants.get(step, ()):
        plant(model, value, param, index)
    return loss


def train(scaler, model, opt, steps, plants, *, unscale=False, clip=None, accumulate=1,
          before_step=None):
    """Runs steps; returns the trace of (scale, growth tracker, stepped, params)."""
    trace = []
    for step in range(steps):
        opt.zero_grad(set_to_none=step % 2 == 0)
        for micro in range(accumulate):
            backward(scaler, model, step * accumulate + micro, plants, divide=accumulate)
        if unscale:
            scaler.unscale_(opt)
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        if before_step is not None:
            before_step(scaler, step)
        ran = scaler.step(opt, lambda: "stepped")         # a closure's value comes back
        scaler.update()
        trace.append((scaler.get_scale(), scaler._get_growth_tracker(), ran,
                      [p.detach().clone() for p in model.parameters()]))
    return trace


def assert_same_trace(ours, theirs, what):
    assert len(ours) == len(theirs)
    for step, (o, t) in enumerate(zip(ours, theirs)):
        assert o[:3] == t[:3], f"{what} step {step}: ampc (scale, tracker, step) {o[:3]}, " \
                               f"torch {t[:3]}"
        for i, (po, pt) in enumerate(zip(o[3], t[3])):
            assert torch.equal(po, pt), f"{what} step {step} param {i}: max diff " \
                                        f"{(po.double() - pt.double()).abs().max()}"


def side_by_side(make_opt, steps=14, plants=None, scaler_kw=None, **train_kw):
    """Trains the same model with each scaler; returns {"torch": trace, "ampc": trace}."""
    out = {}
    for name, cls in SCALERS.items():
        model = make_model()
        scaler = cls("cpu", **(scaler_kw or dict(init_scale=2.0 ** 12, growth_interval=3)))
        out[name] = train(scaler, model, make_opt(model), steps, plants or {}, **train_kw)
    return out


PLANTS = {2: [(INF, 0, 1)], 3: [(NAN, 2, 0)], 4: [(-INF, 3, 2), (NAN, 1, 0)], 9: [(NAN, 0, 47)]}
OPTIMIZERS = {
    "sgd": lambda m: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9),
    "sgd-fused": lambda m: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9, fused=True),
    "adamw-foreach": lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2, foreach=True),
    "adamw-fused": lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2, fused=True),
    "adam-single": lambda m: torch.optim.Adam(m.parameters(), lr=1e-2, foreach=False),
}


@pytest.mark.smoke
@pytest.mark.parametrize("opt", OPTIMIZERS)
def test_trajectory_matches_torch(opt):
    runs = side_by_side(OPTIMIZERS[opt], plants=PLANTS)
    assert_same_trace(runs["ampc"], runs["torch"], opt)
    skipped = [s for s, t in enumerate(runs["ampc"]) if t[2] is None]
    fused = getattr(OPTIMIZERS[opt](make_model()), "_step_supports_amp_scaling", False)
    # fused optimizers skip on the device, so step() returns their value every time
    assert skipped == ([] if fused else [2, 3, 4, 9]), f"{opt}: skipped steps {skipped}"


def test_bf16_model_matches_torch():
    """bf16 weights and grads through unscale_ (torch's CPU kernel takes bf16 too)."""
    out = {}
    for name, cls in SCALERS.items():
        model = make_model(dtype=torch.bfloat16)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        scaler = cls("cpu", init_scale=2.0 ** 12 + 1, growth_interval=3)
        trace = []
        for step in range(8):
            opt.zero_grad()
            x, y = batch(step, torch.bfloat16)
            scaler.scale(torch.nn.functional.mse_loss(model(x).float(), y.float())).backward()
            for value, param, index in PLANTS.get(step, ()):
                plant(model, value, param, index)
            ran = scaler.step(opt, lambda: True)
            scaler.update()
            trace.append((scaler.get_scale(), scaler._get_growth_tracker(), ran,
                          [p.detach().clone() for p in model.parameters()]))
        out[name] = trace
    assert_same_trace(out["ampc"], out["torch"], "bf16 model")


@pytest.mark.parametrize("opt", ["sgd", "adamw-fused"])
def test_unscale_then_clip_matches_torch(opt):
    runs = side_by_side(OPTIMIZERS[opt], plants=PLANTS, unscale=True, clip=0.05)
    assert_same_trace(runs["ampc"], runs["torch"], f"{opt} unscale_ + clip")


@pytest.mark.parametrize("opt", ["sgd", "adamw-fused"])
def test_gradient_accumulation_matches_torch(opt):
    plants = {5: [(INF, 0, 3)], 6: [(NAN, 1, 0)]}      # micro-batches 5 and 6: steps 1, 2
    runs = side_by_side(OPTIMIZERS[opt], steps=8, plants=plants, accumulate=3)
    assert_same_trace(runs["ampc"], runs["torch"], f"{opt} accumulation")


@pytest.mark.smoke
def test_defaults_and_growth_match_torch():
    # torch's defaults, with setters changing the rule mid-run
    def before_step(scaler, step):
        if step == 3:
            scaler.set_growth_interval(2)
            scaler.set_growth_factor(3.0)
        if step == 8:
            scaler.set_backoff_factor(0.25)

    runs = side_by_side(OPTIMIZERS["sgd"], steps=16, plants={1: [(INF, 0, 0)], 9: [(NAN, 3, 1)]},
                        scaler_kw={}, before_step=before_step)
    assert_same_trace(runs["ampc"], runs["torch"], "defaults")
    assert runs["ampc"][-1][0] != 2.0 ** 16, "the scale never moved: the test is not testing"


def test_update_new_scale_matches_torch():
    out = {}
    for name, cls in SCALERS.items():
        model = make_model()
        scaler = cls("cpu", init_scale=256.0, growth_interval=2)
        opt = OPTIMIZERS["sgd"](model)
        scales = []
        for step in range(6):
            opt.zero_grad()
            backward(scaler, model, step, {})
            scaler.step(opt)
            scaler.update(new_scale=[None, 100.0, None, torch.tensor(7.5), None, None][step])
            scales.append(scaler.get_scale())
        out[name] = scales
    # new_scale leaves the growth tracker counting: growth at the 2nd and 4th clean steps
    assert out["ampc"] == out["torch"] == [256.0, 100.0, 200.0, 7.5, 7.5, 15.0]


def test_several_optimizers_skip_independently():
    """One scaler, two optimizers; an inf in one optimizer's grads skips only its step,
    and the scale backs off once."""
    out = {}
    for name, cls in SCALERS.items():
        model = make_model()
        params = list(model.parameters())
        opts = [torch.optim.SGD(params[:2], lr=0.1),
                torch.optim.AdamW(params[2:], lr=1e-2, fused=True)]
        scaler = cls("cpu", init_scale=1024.0, growth_interval=2)
        trace = []
        for step in range(6):
            for o in opts:
                o.zero_grad()
            backward(scaler, model, step, {1: [(INF, 0, 0)], 3: [(NAN, 3, 0)]})
            ran = [scaler.step(o, lambda: step) for o in opts]
            scaler.update()
            trace.append((scaler.get_scale(), ran, [p.detach().clone() for p in params]))
        out[name] = trace
    for step, (o, t) in enumerate(zip(out["ampc"], out["torch"])):
        assert o[:2] == t[:2], f"step {step}: ampc {o[:2]}, torch {t[:2]}"
        assert all(torch.equal(a, b) for a, b in zip(o[2], t[2])), f"step {step}: params"
    assert out["ampc"][1][1] == [None, 1], "an inf in SGD's grads must skip SGD only"
    assert out["ampc"][1][2][0].equal(out["ampc"][0][2][0]), "SGD's weight moved on a skip"


def test_sparse_grads_match_torch():
    out = {}
    for name, cls in SCALERS.items():
        torch.manual_seed(3)
        emb = torch.nn.Embedding(20, 4, sparse=True)
        opt = torch.optim.SGD(emb.parameters(), lr=0.1)
        scaler = cls("cpu", init_scale=512.0, growth_interval=2)
        trace = []
        for step in range(6):
            opt.zero_grad()
            idx = torch.tensor([1, 5, 5, 7 + step])          # a repeated index
            loss = emb(idx).square().sum()
            if step == 2:
                loss = loss * INF
            scaler.scale(loss).backward()
            ran = scaler.step(opt, lambda: True)
            scaler.update()
            trace.append((scaler.get_scale(), ran, emb.weight.detach().clone()))
        out[name] = trace
    for step, (o, t) in enumerate(zip(out["ampc"], out["torch"])):
        assert o[:2] == t[:2] and torch.equal(o[2], t[2]), f"sparse step {step}: {o[:2]} {t[:2]}"
    assert out["ampc"][2][1] is None


def test_non_contiguous_and_float64_grads_match_torch():
    """Grads ampc's kernels cannot take directly: a channels_last conv weight's grad (not
    contiguous) and float64 grads."""
    out = {}
    for name, cls in SCALERS.items():
        torch.manual_seed(4)
        conv = torch.nn.Conv2d(3, 4, 3).to(memory_format=torch.channels_last)
        lin = torch.nn.Linear(4, 2).double()
        opt = torch.optim.SGD([*conv.parameters(), *lin.parameters()], lr=0.1)
        scaler = cls("cpu", init_scale=2.0 ** 20 + 3, growth_interval=2)   # 1/scale rounds
        trace = []
        for step in range(5):
            opt.zero_grad()
            x = torch.randn(2, 3, 5, 5, generator=torch.Generator().manual_seed(step))
            y = conv(x.to(memory_format=torch.channels_last)).mean((2, 3)).double()
            scaler.scale(lin(y).square().sum()).backward()
            assert not conv.weight.grad.is_contiguous()
            if step == 3:
                lin.weight.grad[0, 0] = NAN
            ran = scaler.step(opt, lambda: True)
            scaler.update()
            params = opt.param_groups[0]["params"]
            trace.append((scaler.get_scale(), scaler._get_growth_tracker(), ran,
                          [p.detach().clone() for p in params]))
        out[name] = trace
    assert_same_trace(out["ampc"], out["torch"], "channels_last + float64")


def test_grads_on_several_devices_recorded_per_device():
    """Grads on two devices (cpu and meta, the only two here) get one found_inf each, on
    their own device, like torch; reading a meta flag is impossible, so no step runs."""
    for name, cls in SCALERS.items():
        a = torch.nn.Parameter(torch.ones(3))
        b = torch.nn.Parameter(torch.ones(3, device="meta"))
        a.grad, b.grad = torch.full((3,), 4.0), torch.ones(3, device="meta")
        opt = torch.optim.SGD([a, b], lr=0.1)
        scaler = cls("cpu", init_scale=4.0)
        scaler.scale(torch.ones(()))
        scaler.unscale_(opt)
        found = scaler._found_inf_per_device(opt)
        assert sorted(str(d) for d in found) == ["cpu", "meta"], f"{name}: {found}"
        assert all(f.device == d and f.shape == () for d, f in found.items()), name
        assert float(found[torch.device("cpu")]) == 0.0 and a.grad.eq(1.0).all(), name


# ---- scale() ----

def test_scale_structures_match_torch():
    t = torch.tensor([1.0, -2.0])
    h = torch.tensor([3.0], dtype=torch.float16)
    outputs = [t, (h, [t, t * 2]), [[h]]]
    got = ampc.GradScaler("cpu", init_scale=8.0).scale(outputs)
    want = torch.amp.GradScaler("cpu", init_scale=8.0).scale(outputs)

    def flat(x):
        return [x] if isinstance(x, torch.Tensor) else [y for v in x for y in flat(v)]

    assert type(got[1]) is tuple and type(got[2][0]) is list
    assert [(v.dtype, v.tolist()) for v in flat(got)] == [(v.dtype, v.tolist()) for v in flat(want)]
    gen_got = ampc.GradScaler("cpu", init_scale=8.0).scale(v for v in [t, t])
    assert [v.tolist() for v in gen_got] == [[8.0, -16.0]] * 2


def test_scale_is_lazy_and_on_the_first_tensors_device():
    s = ampc.GradScaler("cpu", init_scale=3.0)
    assert s._scale is None and s.get_scale() == 3.0
    out = s.scale(torch.ones(2, device="meta"))
    assert out.device.type == "meta" and s._scale.device.type == "meta"


def test_scale_namedtuple_and_strings():
    # torch fails on namedtuples (and recurses forever on a str); ampc keeps the type
    Pair = namedtuple("Pair", "a b")
    s = ampc.GradScaler("cpu", init_scale=2.0)
    got = s.scale(Pair(torch.ones(1), torch.ones(1)))
    assert isinstance(got, Pair) and got.b.item() == 2.0
    with pytest.raises(ValueError, match="^outputs must be a Tensor or an iterable of Tensors$"):
        s.scale(["loss"])


# ---- errors: same type, same message ----

def _opt_with_grads(dtype=torch.float32):
    p = torch.nn.Parameter(torch.ones(3, dtype=dtype))
    p.grad = torch.ones(3, dtype=dtype)
    return torch.optim.SGD([p], lr=0.1)


def _ready(cls, **kw):
    s = cls("cpu", **kw)
    s.scale(torch.ones(()))
    return s


def _unscale_twice(cls):
    s, o = _ready(cls), _opt_with_grads()
    s.unscale_(o)
    s.unscale_(o)


def _unscale_after_step(cls):
    s, o = _ready(cls), _opt_with_grads()
    s.step(o)
    s.unscale_(o)


def _step_twice(cls):
    s, o = _ready(cls), _opt_with_grads()
    s.step(o)
    s.step(o)


def _update_without_step(cls):
    _ready(cls).update()


def _step_without_grads(cls):
    _ready(cls).step(torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1))


def _pickle_mid_iteration(cls):
    s, o = _ready(cls), _opt_with_grads()
    s.unscale_(o)
    pickle.dumps(s)


def _bad_new_scale(value):
    def run(cls):
        s, o = _ready(cls), _opt_with_grads()
        s.step(o)
        s.update(new_scale=value)
    return run


ERRORS = {
    "unscale twice": _unscale_twice,
    "unscale after step": _unscale_after_step,
    "step twice": _step_twice,
    "closure": lambda cls: _ready(cls).step(_opt_with_grads(), closure=lambda: 0),
    "unscale before scale": lambda cls: cls("cpu").unscale_(_opt_with_grads()),
    "step before scale": lambda cls: cls("cpu").step(_opt_with_grads()),
    "update before scale": lambda cls: cls("cpu").update(),
    "update without step": _update_without_step,
    "step without grads": _step_without_grads,
    "fp16 grads": lambda cls: _ready(cls).unscale_(_opt_with_grads(torch.float16)),
    "fp16 grads in step": lambda cls: _ready(cls).step(_opt_with_grads(torch.float16)),
    "scale a string": lambda cls: cls("cpu").scale([torch.ones(1), 3]),
    "growth factor": lambda cls: cls("cpu", growth_factor=1.0),
    "backoff factor": lambda cls: cls("cpu", backoff_factor=1.0),
    "empty state dict": lambda cls: cls("cpu").load_state_dict({}),
    "pickle mid-iteration": _pickle_mid_iteration,
    "new_scale with 2 elements": _bad_new_scale(torch.ones(2)),
    "new_scale on another device": _bad_new_scale(torch.ones((), device="meta")),
    "new_scale requiring grad": _bad_new_scale(torch.ones((), requires_grad=True)),
}


def _raised(fn, cls):
    with pytest.raises(Exception) as info:
        fn(cls)
    return type(info.value), str(info.value)


@pytest.mark.parametrize("case", ERRORS)
def test_errors_match_torch(case):
    ours = _raised(ERRORS[case], ampc.GradScaler)
    theirs = _raised(ERRORS[case], torch.amp.GradScaler)
    assert ours == theirs, f"{case}: ampc raised {ours}, torch raised {theirs}"


def test_step_error_leaves_state_like_torch():
    # after a refused second unscale_, step still runs, on both
    for cls in SCALERS.values():
        s, o = _ready(cls, init_scale=2.0), _opt_with_grads()
        s.unscale_(o)
        with pytest.raises(RuntimeError):
            s.unscale_(o)
        s.step(o)
        s.update()
        assert o.param_groups[0]["params"][0].detach().allclose(torch.full((3,), 0.95))


# ---- state_dict, pickling ----

def _trained(cls, steps, **kw):
    model = make_model()
    scaler = cls("cpu", init_scale=2.0 ** 10, growth_interval=3, **kw)
    opt = OPTIMIZERS["sgd"](model)
    train(scaler, model, opt, steps, {1: [(INF, 0, 0)]})
    return scaler, model, opt


def torch_keys(sd):
    return {k: sd[k] for k in ("scale", "growth_factor", "backoff_factor", "growth_interval",
                               "_growth_tracker")}


@pytest.mark.smoke
@pytest.mark.parametrize("src,dst", [("torch", "ampc"), ("ampc", "torch"), ("ampc", "ampc")])
def test_state_dict_round_trip(src, dst):
    scaler, model, opt = _trained(SCALERS[src], 5)
    sd = scaler.state_dict()
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    loaded = torch.load(buf)                            # weights_only: plain values only
    assert loaded == sd
    # torch's keys with torch's values; ampc's state is under keys of its own
    assert torch_keys(loaded) == _trained(torch.amp.GradScaler, 5)[0].state_dict(), \
        "torch's keys or values differ"
    fresh, warm = SCALERS[dst]("cpu"), SCALERS[dst]("cpu", init_scale=3.0)
    warm.scale(torch.ones(()))                          # already holding a scale
    traces = []
    for target in (fresh, warm, scaler):
        if target is not scaler:
            target.load_state_dict(loaded)
        assert torch_keys(target.state_dict()) == torch_keys(sd)
        if src == dst:
            assert target.state_dict() == sd
        m, o = copy.deepcopy(model), None
        o = OPTIMIZERS["sgd"](m)
        o.load_state_dict(copy.deepcopy(opt.state_dict()))
        traces.append(train(target, m, o, 7, {2: [(NAN, 1, 1)]}))
    assert_same_trace(traces[0], traces[2], f"{src} -> fresh {dst}")
    assert_same_trace(traces[1], traces[2], f"{src} -> initialized {dst}")


def test_pickle_round_trip():
    scaler = _trained(ampc.GradScaler, 4, hysteresis=2, min_scale=1.0)[0]
    back = pickle.loads(pickle.dumps(scaler))
    assert back.state_dict() == scaler.state_dict() and back._scale is None
    assert back.state_dict()["hysteresis"] == 2


# ---- disabled, legacy form ----

def test_disabled_is_a_pass_through():
    for enabled in (False, "auto"):                     # "auto" on cpu: bf16, off
        s = ampc.GradScaler("cpu", enabled=enabled)
        model = make_model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        x, y = batch(0)
        loss = torch.nn.functional.mse_loss(model(x), y)
        assert s.scale(loss) is loss
        loss.backward()
        grads = [p.grad.clone() for p in model.parameters()]
        s.unscale_(opt)
        assert all(g.equal(p.grad) for g, p in zip(grads, model.parameters()))
        assert s.step(opt, lambda: "ran") == "ran"
        s.update()
        assert (s.get_scale(), s.state_dict(), s.is_enabled(), s._scale) == (1.0, {}, False, None)
        s.load_state_dict({})
        assert int(s.skipped_steps()) == 0 and not bool(s.last_step_skipped())


def test_cuda_without_gpu_warns_like_torch():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    messages = {}
    for name, make in {"ampc": lambda: ampc.GradScaler(), "torch": lambda: torch.amp.GradScaler(),
                       "ampc-legacy": lambda: ampc.GradScaler(1024.0, growth_interval=5)}.items():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            s = make()
        messages[name] = [str(w.message) for w in caught]
        assert not s.is_enabled()
    assert messages["ampc"] == messages["torch"] == messages["ampc-legacy"]


def test_legacy_form_without_device():
    s = ampc.GradScaler(1024.0, growth_interval=5, enabled=False)
    assert (s._device, s._init_scale, s.get_growth_interval()) == ("cuda", 1024.0, 5)
    s = ampc.GradScaler(init_scale=8.0, growth_factor=4.0, enabled=False)
    assert (s._device, s._init_scale, s.get_growth_factor()) == ("cuda", 8.0, 4.0)
    with pytest.raises(TypeError, match="by keyword"):
        ampc.GradScaler(1024.0, 3.0)
    assert ampc.GradScaler(torch.device("cuda:0"), enabled=False)._device == "cuda"
    assert ampc.GradScaler("cpu", enabled=False).get_growth_interval() == 2000
