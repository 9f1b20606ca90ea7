"""The lean state options of ampc.optim.Adam/AdamW: layouts, the preset, options refused
before anything is allocated, the GradScaler protocol without host syncs, checkpoints
(bit-exact round trips, torch's AdamW state in and out, layout conversions),
fp32_state_dict with Kahan, and the bytes report."""
import copy
import io

import pytest
import torch
from torch import nn

import ampc
import ampc.optim
from ampc.lean_state import decode_moments, state_bytes, to_torch_state
from reference import assert_same
from test_grad_scaler import backward, make_model, INF
from test_grad_scaler_extras import SyncCounter
from test_optim import batch, train as train_mlp

f32, f16, bf16, u8 = torch.float32, torch.float16, torch.bfloat16, torch.uint8


def net(seed=0, width=256, dtype=bf16):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(20, width), nn.LayerNorm(width), nn.GELU(),
                         nn.Linear(width, 1)).to(dtype)


def train(model, opt, steps, start=0, scaler=None):
    return train_mlp(model, opt, steps, start, next(model.parameters()).dtype, scaler)


# ---- layouts and the preset ----

def test_preset_layout_small_and_1d_params_keep_fp32_moments():
    model = net()
    opt = ampc.optim.AdamW(model.parameters(), lr=1e-3, state="lean")
    g = opt.param_groups[0]
    assert (g["master_weights"], g["stochastic_rounding"], g["moments"]) == (False, True, "8bit")
    train(model, opt, 2)
    big, bias, norm, small = model[0].weight, model[0].bias, model[1].weight, model[3].weight
    s = opt.state[big]
    assert s["exp_avg_codes"].dtype == u8 and s["exp_avg_sq_codes"].dtype == u8
    assert "exp_avg" not in s and "exp_avg_sq" not in s      # not under torch's names
    assert s["exp_avg_scale"].shape == (-(-big.numel() // 256),)
    assert "master" not in s and "compensation" not in s
    for p in (bias, norm, small):       # 1-d, or under 4096 elements
        assert opt.state[p]["exp_avg"].dtype == f32 and "exp_avg_scale" not in opt.state[p]
    assert all(p.dtype == bf16 for p in model.parameters())


@pytest.mark.parametrize("moments,dtype", [("bf16", bf16), ("8bit", u8)])
def test_explicit_options_and_min_numel(moments, dtype):
    model = net()
    opt = ampc.optim.AdamW(model.parameters(), lr=1e-3, moments=moments, moments_min_numel=0,
                           kahan_summation=True)
    train(model, opt, 2)
    s = opt.state[model[3].weight]                                      # 256 elements
    assert s["exp_avg_codes" if moments == "8bit" else "exp_avg"].dtype == dtype
    assert opt.state[model[3].weight]["compensation"].dtype == bf16
    assert opt.state[model[0].bias]["exp_avg"].dtype == f32           # 1-d


def test_small_tensors_take_exactly_torchs_fused_adamw():
    """moments="8bit" on params all under the threshold: fp32 moments, and the step is
    torch.optim.AdamW(fused=True)'s bit for bit (sizes of whole vectors, Note [tails])."""
    torch.manual_seed(0)
    ours = [nn.Parameter(torch.randn(32, 32)) for _ in range(3)]
    theirs = [nn.Parameter(p.detach().clone()) for p in ours]
    a = ampc.optim.AdamW(ours, lr=1e-2, moments="8bit")
    t = torch.optim.AdamW(theirs, lr=1e-2, fused=True)
    for k in range(4):
        for p, q in zip(ours, theirs):
            p.grad = torch.randn(32, 32, generator=torch.Generator().manual_seed(k))
            q.grad = p.grad.clone()
        a.step()
        t.step()
    for p, q in zip(ours, theirs):
        assert_same(p.detach(), q.detach(), "param")
        assert_same(a.state[p]["exp_avg_sq"], t.state[q]["exp_avg_sq"], "exp_avg_sq")


# ---- refused before anything is allocated ----

REFUSED = {
    "moments": (dict(moments="int4"), "moments must be one of"),
    "moments_min_numel": (dict(moments="8bit", moments_min_numel=-1), "moments_min_numel"),
    "kahan with masters": (dict(kahan_summation=True, master_weights=True),
                           "kahan_summation=True keeps a bf16 compensation"),
    "kahan with sr": (dict(kahan_summation=True, stochastic_rounding=True),
                      "kahan_summation=True and stochastic_rounding=True"),
    "amsgrad": (dict(moments="bf16", amsgrad=True), "amsgrad=True is not supported"),
    "preset": (dict(state="tiny"), "state must be one of"),
    "preset with masters": (dict(state="lean", master_weights=True),
                            "state='lean' keeps no master weights"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_bad_options_are_refused(case):
    kwargs, pattern = REFUSED[case]
    with pytest.raises(ValueError, match=r"ampc\.optim\.AdamW: .*" + pattern):
        ampc.optim.AdamW(net().parameters(), lr=1e-3, **kwargs)


def test_kahan_refuses_fp16_params_and_steps_fp32_params_as_they_are():
    with pytest.raises(ValueError, match=r"kahan_summation=True needs torch.bfloat16 params; "
                                         r"param 0 of group 0 is torch.float16"):
        ampc.optim.AdamW(net(dtype=f16).parameters(), lr=1e-3, kahan_summation=True)
    with pytest.raises(ValueError, match=r"ampc.prepare: kahan_summation=True .* dtype is"):
        ampc.prepare(net(dtype=f32), ampc.optim.AdamW, f16, lr=1e-3, kahan_summation=True)
    # prepare keeps the norms fp32: they are their own weight, no compensation
    model, opt = ampc.prepare(net(dtype=f32), ampc.optim.AdamW, bf16, lr=1e-3,
                              kahan_summation=True)
    train(model, opt, 1)
    assert "compensation" in opt.state[model[0].weight]
    assert model[1].weight.dtype == f32 and "compensation" not in opt.state[model[1].weight]
    # an fp16 param added after the checks: refused at the step, before any allocation
    half = nn.Parameter(torch.randn(4, 4).to(f16))
    opt.param_groups[0]["params"].append(half)
    half.grad = torch.randn(4, 4).to(f16)
    before = half.detach().clone()
    with pytest.raises(ValueError, match=r"param \d+ is torch.float16"):
        opt.step()
    assert not opt.state[half] and torch.equal(half.detach(), before)


# ---- GradScaler protocol, folded clip, no host sync ----

def test_scaler_skips_inf_steps_and_folds_clip_without_host_syncs(monkeypatch):
    model = make_model()
    opt = ampc.optim.AdamW(model.parameters(), lr=1e-2, moments="8bit", moments_min_numel=0)
    scaler = ampc.GradScaler("cpu", init_scale=1024.0, growth_interval=2, hysteresis=1)
    counter = SyncCounter(monkeypatch)
    counter.paused = True
    for step in range(4):
        opt.zero_grad()
        backward(scaler, model, step, {2: [(INF, 0, 0)]} if step == 2 else {})
        before = {id(p): {k: v.clone() for k, v in opt.state[p].items()}
                  for p in model.parameters() if opt.state[p]}
        weights = [p.detach().clone() for p in model.parameters()]
        counter.paused = False
        counter.calls.clear()
        scaler.clip_grad_norm_(opt, 0.1)
        scaler.step(opt)
        scaler.update()
        counter.paused = True
        assert counter.calls == [], f"step {step}: host reads {counter.calls}"
        if step == 2:           # skipped on the device: nothing moved
            for p, w in zip(model.parameters(), weights):
                assert_same(p.detach(), w, "weight after a skipped step")
                for k, v in before[id(p)].items():
                    assert_same(opt.state[p][k], v, f"{k} after a skipped step")
    assert int(scaler.skipped_steps()) == 1
    p = next(model.parameters())
    assert opt.state[p]["step"].item() == 3 and opt.state[p]["exp_avg_codes"].dtype == u8


def test_folded_unscale_and_clip_equal_doing_them_first():
    """The scaler's unscale and the clip coefficient folded into the lean step give the
    bits of the same step on grads unscaled and clipped beforehand by ampc's kernels."""
    a, b = net(), net()
    oa = ampc.optim.AdamW(a.parameters(), lr=1e-3, state="lean", seed=3)
    ob = ampc.optim.AdamW(b.parameters(), lr=1e-3, state="lean", seed=3)
    x, y = batch(0, bf16)
    for m in (a, b):
        (((m(x).float() - y) ** 2).mean() * 64).backward()
    oa.grad_scale = torch.tensor(64.0)
    oa.grad_clip_coef = torch.tensor(0.5)
    oa.step()
    for p in b.parameters():
        p.grad = (p.grad.float() * (1 / 64) * 0.5).to(p.dtype)
    ob.step()
    for p, q in zip(a.parameters(), b.parameters()):
        assert_same(p.detach(), q.detach(), "weight")


# ---- checkpoints ----

def roundtrip(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


@pytest.mark.parametrize("kwargs", [dict(state="lean"), dict(moments="bf16", kahan_summation=True),
                                    dict(moments="8bit", master_weights=True)],
                         ids=["lean", "bf16-kahan", "8bit-master"])
def test_checkpoint_resumes_bit_exactly(kwargs):
    kwargs = dict(kwargs, moments_min_numel=0) if "state" not in kwargs else kwargs
    ref, ref_opt = net(), None
    ref_opt = ampc.optim.AdamW(ref.parameters(), lr=1e-3, **kwargs)
    train(ref, ref_opt, 5)
    model = net()
    opt = ampc.optim.AdamW(model.parameters(), lr=1e-3, **kwargs)
    train(model, opt, 3)
    saved = roundtrip({"model": model.state_dict(), "opt": opt.state_dict()})
    resumed = net(seed=5)
    resumed.load_state_dict(saved["model"])
    ropt = ampc.optim.AdamW(resumed.parameters(), lr=1e-3, **kwargs)
    ropt.load_state_dict(saved["opt"])
    for p in resumed.parameters():
        for k, v in ropt.state[p].items():
            assert v.dtype == opt.state[dict(zip(map(id, resumed.parameters()),
                                                 model.parameters()))[id(p)]][k].dtype, k
    train(resumed, ropt, 2, start=3)
    for p, q in zip(resumed.parameters(), ref.parameters()):
        assert_same(p.detach(), q.detach(), "weight after resuming")


def test_torch_adamw_state_loads_converted_and_lean_exports_to_torch():
    fp = net(dtype=f32)
    topt = torch.optim.AdamW(fp.parameters(), lr=1e-3)
    train(fp, topt, 3)
    lean = net(dtype=f32)
    lean.load_state_dict(fp.state_dict())
    lean = lean.to(bf16)
    lopt = ampc.optim.AdamW(lean.parameters(), lr=1e-3, state="lean")
    lopt.load_state_dict(roundtrip(topt.state_dict()))
    w = lean[0].weight
    s = lopt.state[w]
    assert s["exp_avg_codes"].dtype == u8 and s["step"].item() == 3
    m, v = decode_moments(s)
    tm, tv = topt.state[fp[0].weight]["exp_avg"], topt.state[fp[0].weight]["exp_avg_sq"]
    assert ((m - tm).abs() <= tm.abs() * 2 ** -4 + s["exp_avg_scale"].max() * 2 ** -9).all()
    # sqrt(v) within a whole code step: its code rounds stochastically
    assert ((v.sqrt() - tv.sqrt()).abs() <= tv.sqrt() * 2 ** -4
            + s["exp_avg_sq_scale"].max() * 2 ** -10).all()
    # export: torch's AdamW takes it, and holds the decoded moments
    exported = roundtrip(to_torch_state(lopt))
    back = net(dtype=f32)
    bopt = torch.optim.AdamW(back.parameters(), lr=1e-3)
    bopt.load_state_dict(exported)
    assert_same(bopt.state[back[0].weight]["exp_avg"], m, "exported exp_avg")
    assert_same(bopt.state[back[0].weight]["exp_avg_sq"], v, "exported exp_avg_sq")
    assert bopt.state[back[0].weight]["exp_avg"].dtype == f32


def test_lean_checkpoint_into_fp32_moments_is_decoded_not_misread():
    model = net()
    opt = ampc.optim.AdamW(model.parameters(), lr=1e-3, moments="8bit", master_weights=True)
    train(model, opt, 2)
    saved = roundtrip(opt.state_dict())
    other = net()
    plain = ampc.optim.AdamW(other.parameters(), lr=1e-3)
    plain.load_state_dict(saved)
    s = plain.state[other[0].weight]
    m, v = decode_moments(opt.state[model[0].weight])
    assert s["exp_avg"].dtype == f32 and "exp_avg_scale" not in s
    assert_same(s["exp_avg"], m, "exp_avg")
    assert_same(s["exp_avg_sq"], v, "exp_avg_sq")
    train(other, plain, 1, start=2)     # and it steps


def test_checkpoint_layouts_that_cannot_convert_are_refused_before_loading():
    model = net()
    kahan = ampc.optim.AdamW(model.parameters(), lr=1e-3, kahan_summation=True)
    train(model, kahan, 1)
    saved = roundtrip(kahan.state_dict())
    target = net()
    sr = ampc.optim.AdamW(target.parameters(), lr=1e-3, state="lean")
    train(target, sr, 1)
    before = copy.deepcopy(sr.state_dict())
    with pytest.raises(ValueError, match=r"param 0 has a Kahan compensation in the checkpoint"):
        sr.load_state_dict(saved)
    after = sr.state_dict()
    for k, st in before["state"].items():
        for key, v in st.items():
            assert_same(after["state"][k][key], v, key)
    bad = copy.deepcopy(saved)
    bad["state"][0]["exp_avg"] = bad["state"][0]["exp_avg"].to(torch.int32)
    with pytest.raises(ValueError, match=r"not a moments layout ampc knows"):
        sr.load_state_dict(bad)
    short = roundtrip(sr.state_dict())
    short["state"][0]["exp_avg_scale"] = short["state"][0]["exp_avg_scale"][:1]
    with pytest.raises(ValueError, match=r"param 0 has 8-bit moments but its 'exp_avg_scale'"):
        sr.load_state_dict(short)


def test_kahan_master_conversions_and_fp32_state_dict():
    model = net()
    opt = ampc.optim.AdamW(model.parameters(), lr=1e-2, kahan_summation=True)
    train(model, opt, 3)
    fp = ampc.fp32_state_dict(model, opt)
    w = model[0].weight
    want = w.detach().float() + opt.state[w]["compensation"].float()
    assert_same(fp["0.weight"], want, "fp32 weight with Kahan")
    assert not torch.equal(want, w.detach().float())
    other = net()
    other.load_state_dict(model.state_dict())
    mopt = ampc.optim.AdamW(other.parameters(), lr=1e-2)        # fp32 masters
    mopt.load_state_dict(roundtrip(opt.state_dict()))
    assert_same(mopt.state[other[0].weight]["master"], want, "master from Kahan")


# ---- memory ----

def test_state_bytes_measure_the_tensors():
    torch.manual_seed(0)
    big = nn.Sequential(nn.Linear(1024, 1024, bias=False), nn.Linear(1024, 1024, bias=False))
    results = {}
    for name, kw in (("master", {}), ("lean", dict(state="lean")),
                     ("kahan8", dict(moments="8bit", kahan_summation=True))):
        model = copy.deepcopy(big)
        model, opt = ampc.prepare(model, ampc.optim.AdamW, bf16, lr=1e-3, **kw)
        x = torch.randn(4, 1024, dtype=bf16)
        model(x).float().sum().backward()
        opt.step()
        results[name] = state_bytes(model, opt)
    per = {k: r["per_param"] for k, r in results.items()}
    assert per["master"]["masters"] == 4 and per["master"]["moments"] == 8
    assert per["lean"]["masters"] == 0 and per["lean"]["moments"] == 2
    assert per["lean"]["scales"] == 8 / 256
    assert per["kahan8"]["compensation"] == 2
    assert abs(results["lean"]["total_per_param"] - (2 + 2 + 2 + 8 / 256)) < 1e-3
    assert abs(results["master"]["total_per_param"] - 16) < 1e-3


class _Codes(torch.Tensor):
    """A tensor subclass that stands for fp32 values but holds uint8 codes and an fp32
    scale a block of 256, as other libraries' 8-bit optimizer states do."""

    @staticmethod
    def __new__(cls, codes, scales):
        return torch.Tensor._make_wrapper_subclass(cls, codes.shape, dtype=torch.float32)

    def __init__(self, codes, scales):
        self.codes, self.scales = codes, scales

    def __tensor_flatten__(self):
        return ["codes", "scales"], None

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise NotImplementedError(f"{func} on 8-bit codes")


def test_state_bytes_count_tensor_subclasses_by_what_they_hold():
    model = nn.Linear(1024, 1024, bias=False)
    opt = torch.optim.AdamW(model.parameters())
    n = model.weight.numel()
    opt.state[model.weight] = {
        "step": torch.tensor(1.0),
        "exp_avg": _Codes(torch.zeros(1024, 1024, dtype=u8), torch.zeros(n // 256)),
        "exp_avg_sq": _Codes(torch.zeros(1024, 1024, dtype=u8), torch.zeros(n // 256))}
    per = state_bytes(model, opt)["per_param"]
    # 1 B of codes and 4/256 B of scales a parameter each, not the 4 B of their dtype
    assert per["moments"] == pytest.approx(2 * (1 + 4 / 256))
