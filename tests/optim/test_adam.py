"""The fused Adam/AdamW step (ampc.ops.adam_master and ampc.optim) against torch's fused
AdamW, against torch's AdamW on fp32 copies for master weights, and against a float64
reference.

Note [tails]: torch's fused CPU kernel runs the last numel % 16 elements of each tensor
(numel % 8 on AVX2) through a scalar loop that its compiler contracts into FMAs
differently from its vector loop (v = fma(v, beta2, ...) instead of fma(..., v * beta2)).
ampc computes every element the way torch's vector loop does, on every CPU path and on
CUDA. So the comparisons with torch are bit for bit except those last elements, which
may differ by an ulp of v per step: they are compared as bit patterns, at most one ulp
apart per step taken.
"""
import math
import os
import subprocess
import sys

import pytest
import torch

import ampc
import ampc.optim
from reference import assert_same

f32, f16, bf16 = torch.float32, torch.float16, torch.bfloat16
ODD_SIZES = [1, 7, 16, 17, 100, 1000, 4099, 65536 + 3]


def ulp(x):
    """The spacing of fp32 values at |x|, elementwise."""
    x = x.abs().float()
    return torch.nextafter(x, torch.full_like(x, float("inf"))) - x


def assert_matches_torch(got, want, what, steps, lr=0.0):
    """Bit for bit except each tensor's last numel % 16 elements (Note [tails]), which may
    drift apart by at most one ulp per step taken: an ulp of the larger value, or of lr
    for a weight smaller than lr (the step rounds differently, and the weight moves by up
    to about lr per step)."""
    floor = ulp(torch.tensor(lr))
    for i, (a, b) in enumerate(zip(got, want)):
        a, b = a.detach().reshape(-1), b.detach().reshape(-1)
        body = a.numel() - a.numel() % 16
        assert_same(a[:body], b[:body], f"{what}[{i}]")
        if body < a.numel():
            ta, tb = a[body:], b[body:]
            allowed = steps * torch.maximum(torch.maximum(ulp(ta), ulp(tb)), floor)
            over = (ta - tb).abs() > allowed
            assert not bool(over.any()), (
                f"{what}[{i}] tail: {ta[over].tolist()} vs {tb[over].tolist()}, more than one "
                f"ulp per step apart after {steps} steps")


def make_params(sizes, dtype=f32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(n, generator=g).to(dtype)) for n in sizes]


def grads_for(params, step, scale=1.0, dtype=None):
    g = torch.Generator().manual_seed(1000 + step)
    return [(torch.randn(p.shape, generator=g) * scale).to(dtype or p.dtype) for p in params]


def run_pair(sizes, steps, torch_cls, ampc_cls, groups_kwargs):
    """Runs torch's fused optimizer and ampc's on equal params with equal grads."""
    tp, ap = make_params(sizes), make_params(sizes)
    half = len(sizes) // 2
    mk = lambda ps: [dict(params=ps[:half], **groups_kwargs[0]),  # noqa: E731
                     dict(params=ps[half:], **groups_kwargs[1])]
    topt = torch_cls(mk(tp), fused=True)
    aopt = ampc_cls(mk(ap))
    for k in range(steps):
        for ps in (tp, ap):
            for p, g in zip(ps, grads_for(ps, k)):
                p.grad = g
        topt.step()
        aopt.step()
    return tp, ap, topt, aopt


@pytest.mark.smoke
@pytest.mark.parametrize("decoupled", [True, False], ids=["AdamW", "Adam"])
@pytest.mark.parametrize("amsgrad", [False, True], ids=["", "amsgrad"])
@pytest.mark.parametrize("maximize", [False, True], ids=["", "maximize"])
def test_fp32_matches_torch_fused(decoupled, amsgrad, maximize):
    torch_cls = torch.optim.AdamW if decoupled else torch.optim.Adam
    ampc_cls = ampc.optim.AdamW if decoupled else ampc.optim.Adam
    groups = [dict(lr=1e-2, betas=(0.9, 0.999), weight_decay=0.05, amsgrad=amsgrad,
                   maximize=maximize),
              dict(lr=3e-3, betas=(0.3, 0.98), eps=1e-6, weight_decay=0.0, amsgrad=amsgrad,
                   maximize=maximize)]
    tp, ap, topt, aopt = run_pair(ODD_SIZES, 6, torch_cls, ampc_cls, groups)
    assert_matches_torch(ap, tp, "params", 6, lr=1e-2)
    for key in ["exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if amsgrad else []):
        assert_matches_torch([aopt.state[p][key] for p in ap],
                             [topt.state[p][key] for p in tp], key, 6)
    for a, t in zip(ap, tp):
        assert aopt.state[a]["step"].item() == topt.state[t]["step"].item() == 6
        assert "master" not in aopt.state[a]


def test_thousand_small_tensors_match_torch_fused():
    g = torch.Generator().manual_seed(5)
    sizes = torch.randint(1, 3000, (1000,), generator=g).tolist()
    tp, ap, topt, aopt = run_pair(sizes, 3, torch.optim.AdamW, ampc.optim.AdamW,
                                  [dict(lr=1e-3), dict(lr=2e-3, weight_decay=0.1)])
    assert_matches_torch(ap, tp, "params", 3, lr=2e-3)


def test_adam_without_weight_decay_matches_torch_fused():
    # its own specialised loop in adam.c, like AdamW's
    tp, ap, topt, aopt = run_pair(ODD_SIZES, 4, torch.optim.Adam, ampc.optim.Adam,
                                  [dict(lr=1e-3), dict(lr=2e-3, betas=(0.8, 0.99))])
    assert_matches_torch(ap, tp, "params", 4, lr=2e-3)


def adam_reference(p, grads, lr, beta1, beta2, eps, wd, decoupled):
    """Adam/AdamW in float64, textbook order."""
    p = p.double()
    m = torch.zeros_like(p)
    v = torch.zeros_like(p)
    for t, g in enumerate(grads, start=1):
        g = g.double()
        if decoupled:
            p = p * (1 - lr * wd)
        else:
            g = g + wd * p
        m = beta1 * m + (1 - beta1) * g
        v = beta2 * v + (1 - beta2) * g * g
        denom = (v / (1 - beta2 ** t)).sqrt() + eps
        p = p - lr / (1 - beta1 ** t) * m / denom
    return p


@pytest.mark.smoke
@pytest.mark.parametrize("decoupled", [True, False], ids=["AdamW", "Adam"])
def test_matches_float64_reference(decoupled):
    p0 = torch.randn(5000, generator=torch.Generator().manual_seed(3))
    grads = [torch.randn(5000, generator=torch.Generator().manual_seed(10 + k)) for k in range(20)]
    p = p0.clone()
    m, v, step = torch.zeros(5000), torch.zeros(5000), torch.zeros(1)
    for g in grads:
        ampc.ops.adam_master([p], [g], [m], [v], [step], lr=1e-2, weight_decay=0.1,
                             decoupled=decoupled)
    want = adam_reference(p0, grads, 1e-2, 0.9, 0.999, 1e-8, 0.1, decoupled)
    torch.testing.assert_close(p.double(), want, rtol=0, atol=2e-6)
    assert step.item() == 20


@pytest.mark.smoke
@pytest.mark.parametrize("dtype", [bf16, f16], ids=["bf16", "fp16"])
def test_master_weights_match_adamw_on_fp32_copies(dtype):
    """100 steps: the masters follow torch's AdamW run on fp32 copies fed the same
    (upcast) grads, and the model weights are the masters rounded to nearest."""
    sizes = [1, 31, 1000, 4099]
    ref = make_params(sizes)
    model = [torch.nn.Parameter(p.detach().to(dtype)) for p in ref]
    topt = torch.optim.AdamW(ref, lr=1e-3, weight_decay=0.01, fused=True)
    aopt = ampc.optim.AdamW(model, lr=1e-3, weight_decay=0.01)
    for p, r in zip(model, ref):          # masters start from the fp32 values
        aopt._init_state(aopt.param_groups[0], p, master=r.detach().clone())
    for k in range(100):
        grads = grads_for(ref, k, dtype=dtype)
        for p, r, g in zip(model, ref, grads):
            p.grad = g
            r.grad = g.float()
        topt.step()
        aopt.step()
    masters = [aopt.state[p]["master"] for p in model]
    assert_matches_torch(masters, ref, "masters", 100, lr=1e-3)
    for p, m in zip(model, masters):
        assert_same(p.detach(), m.to(dtype), "model weights")
        assert aopt.state[p]["exp_avg"].dtype == f32


@pytest.mark.smoke
def test_unscale_and_clip_fold_into_the_step():
    """inv_scale and clip_coef inside the step equal torch's unscale, then clip_grad_norm_,
    then the step."""
    sizes = [33, 1000, 4099]
    tp, ap = make_params(sizes), make_params(sizes)
    topt = torch.optim.AdamW(tp, lr=1e-2, fused=True)
    aopt = ampc.optim.AdamW(ap, lr=1e-2)
    scale = torch.full((1,), 1024.0 * 3)     # not a power of two: the rounding counts
    for k in range(4):
        grads = grads_for(tp, k, scale=scale.item())
        for p, g in zip(tp, grads):
            p.grad = g.clone()
        found = torch.zeros(1)
        torch._amp_foreach_non_finite_check_and_unscale_(
            [p.grad for p in tp], found, scale.double().reciprocal().float())
        total = torch.nn.utils.clip_grad_norm_(tp, max_norm=1.0)
        topt.step()
        for p, g in zip(ap, grads):
            p.grad = g.clone()
        inv = scale.double().reciprocal().float()
        norm = ampc.ops.unscale_check([p.grad for p in ap], torch.zeros(1), inv, check_only=True)
        torch.testing.assert_close(norm, total, rtol=1e-6, atol=0)
        # the clip coefficient from torch's norm: the fold is under test, not the norm
        aopt.grad_scale, aopt.found_inf = scale, torch.zeros(1)
        aopt.grad_clip_coef = torch.clamp(1.0 / (total + 1e-6), max=1.0)
        aopt.step()
        del aopt.grad_scale, aopt.found_inf, aopt.grad_clip_coef
    assert_matches_torch(ap, tp, "params", 4, lr=1e-2)


@pytest.mark.parametrize("where", ["first", "middle", "last"])
@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
def test_found_inf_skips_the_whole_step(where, bad):
    sizes = [10, 5000, 77]
    tp, ap = make_params(sizes), make_params(sizes)
    topt = torch.optim.AdamW(tp, lr=1e-2, fused=True)
    aopt = ampc.optim.AdamW(ap, lr=1e-2)
    for k in range(5):
        grads = grads_for(ap, k)
        planted = k == 2
        if planted:
            g = grads[1]
            g[{"first": 0, "middle": g.numel() // 2, "last": -1}[where]] = bad
        else:
            for p, gr in zip(tp, grads):
                p.grad = gr.clone()
            topt.step()             # torch's run simply never sees the bad step
        for p, gr in zip(ap, grads):
            p.grad = gr
        found = torch.zeros(1)
        ampc.ops.unscale_check(grads, found, torch.ones(1), check_only=True)
        assert found.item() == (1.0 if planted else 0.0)
        before = {id(p): {k2: v.clone() for k2, v in aopt.state[p].items()} for p in ap
                  if aopt.state[p]}
        weights = [p.detach().clone() for p in ap]
        aopt.found_inf = found
        aopt.step()
        del aopt.found_inf
        if planted:
            for p, w in zip(ap, weights):
                assert torch.equal(p.detach(), w)
                for key, v in before[id(p)].items():
                    assert torch.equal(aopt.state[p][key], v), key
    assert_matches_torch(ap, tp, "params", 4, lr=1e-2)
    assert aopt.state[ap[0]]["step"].item() == 4


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


@pytest.mark.smoke
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("gdtype", [f32, bf16, f16], ids=["fp32", "bf16", "fp16"])
def test_grads_are_only_read_by_adam_master(device, gdtype):
    """With the unscale, the clip factor and master weights folded in, the grads come out
    as they went in, bit for bit (torch's fused step writes unscaled grads back)."""
    sizes = [1, 17, 1000, 65536 + 3]
    gen = torch.Generator().manual_seed(4)
    masters = [torch.randn(n, generator=gen).to(device) for n in sizes]
    params = [m.to(gdtype) for m in masters]
    grads = [(torch.randn(n, generator=gen) * 1024).to(device=device, dtype=gdtype)
             for n in sizes]
    before = [g.clone() for g in grads]
    moments = [[torch.zeros(n, device=device) for n in sizes] for _ in range(2)]
    steps = [torch.zeros(1, device=device) for _ in sizes]
    ampc.ops.adam_master(params, grads, *moments, steps, lr=1e-2,
                         masters=None if gdtype == f32 else masters,
                         inv_scale=torch.full((1,), 1 / 1024, device=device),
                         clip_coef=torch.full((1,), 0.5, device=device))
    assert all(s.item() == 1 for s in steps)
    for g, b in zip(grads, before):
        assert_same(g, b, "grads after adam_master")


@pytest.mark.smoke
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [f32, bf16], ids=["fp32", "bf16-masters"])
def test_grads_are_only_read_by_step_under_a_grad_scaler(device, dtype):
    """opt.step() through torch's GradScaler (grads unscaled inside the step): p.grad is
    still the scaled grad the backward pass made; torch's fused AdamW unscales it in place."""
    model = torch.nn.Linear(64, 33).to(device=device, dtype=dtype)
    opt = ampc.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler(device, init_scale=2.0 ** 10)
    x = torch.randn(8, 64, device=device, dtype=dtype)
    scaler.scale(model(x).float().square().mean()).backward()
    before = [p.grad.clone() for p in model.parameters()]
    weights = [p.detach().clone() for p in model.parameters()]
    scaler.step(opt)
    scaler.update()
    assert not any(torch.equal(p.detach(), w) for p, w in zip(model.parameters(), weights))
    for p, b in zip(model.parameters(), before):
        assert_same(p.grad, b, "p.grad after opt.step()")


@pytest.mark.parametrize("value", [2.0, math.nan, -1.0])
def test_any_nonzero_found_inf_skips(value):
    p = torch.randn(100)
    before = p.clone()
    m, v, step = torch.zeros(100), torch.zeros(100), torch.zeros(1)
    ampc.ops.adam_master([p], [torch.randn(100)], [m], [v], [step], lr=0.1,
                         found_inf=torch.full((1,), value))
    assert torch.equal(p, before) and step.item() == 0 and not m.any() and not v.any()


def test_lr_tensor_and_scheduler_match_torch():
    sizes = [100, 1000]
    tp, ap = make_params(sizes), make_params(sizes)
    # a tensor lr is fp32, so torch is given one too (a float lr would be a double)
    topt = torch.optim.AdamW(tp, lr=torch.tensor(1e-2), fused=True)
    aopt = ampc.optim.AdamW(ap, lr=torch.tensor(1e-2))
    tsched = torch.optim.lr_scheduler.StepLR(topt, step_size=2, gamma=0.5)
    asched = torch.optim.lr_scheduler.StepLR(aopt, step_size=2, gamma=0.5)
    for k in range(7):
        for ps in (tp, ap):
            for p, g in zip(ps, grads_for(ps, k)):
                p.grad = g
        topt.step()
        aopt.step()
        tsched.step()
        asched.step()
    assert isinstance(aopt.param_groups[0]["lr"], torch.Tensor)
    assert_matches_torch(ap, tp, "params", 7, lr=1e-2)


def test_noncontiguous_and_misaligned_params():
    base = torch.randn(4100)
    weird = [torch.nn.Parameter(torch.randn(40, 30).t()),       # transposed
             torch.nn.Parameter(base[1:4098].clone()[1:]),       # storage offset 1: unaligned
             torch.nn.Parameter(torch.randn(64, 64)[:, ::2])]   # strided
    plain = [torch.nn.Parameter(p.detach().contiguous().clone()) for p in weird]
    assert not weird[0].is_contiguous() and weird[1].data_ptr() % 64 != 0
    aw, ap = ampc.optim.AdamW(weird, lr=1e-2), ampc.optim.AdamW(plain, lr=1e-2)
    for k in range(3):
        for w, p, g in zip(weird, plain, grads_for(plain, k)):
            w.grad = g.t().contiguous().t() if g.dim() == 2 else g.clone()
            p.grad = g.clone()
        aw.step()
        ap.step()
    for w, p in zip(weird, plain):
        assert_same(w.detach().contiguous(), p.detach(), "param")
    assert not weird[0].is_contiguous()


def test_stochastic_rounding_of_model_weights():
    """With stochastic rounding the bf16 weights are the master weights rounded by the
    cast kernel's rule with the same seed and element numbering."""
    sizes = [1000, 77, 4099]
    masters = [torch.randn(n) for n in sizes]
    params = [m.to(bf16) for m in masters]
    grads = [torch.randn(n).to(bf16) for n in sizes]
    state = [[torch.zeros(n) for n in sizes] for _ in range(2)]
    steps = [torch.zeros(1) for _ in sizes]
    ampc.ops.adam_master(params, grads, state[0], state[1], steps, lr=1e-2, masters=masters,
                         stochastic=True, seed=1234)
    want = ampc.ops.cast(masters, bf16, stochastic=True, seed=ampc.ops.step_seed(1234, 1))
    for p, w in zip(params, want):
        assert_same(p, w, "stochastically rounded weights")
    rne = [m.to(bf16) for m in masters]
    assert any(not torch.equal(p, r) for p, r in zip(params, rne))


CHECK_PATHS = r"""
import hashlib, torch, ampc
f32, f16, bf16 = torch.float32, torch.float16, torch.bfloat16
h = hashlib.sha256()
for pt, gt, master in [(f32, f32, False), (bf16, bf16, True), (f16, f16, True), (bf16, f32, False)]:
    # AdamW and Adam without decay take loops specialised for them (adam.c), the rest not
    for beta1, ams, dec, wd in [(0.9, False, True, 0.1), (0.9, False, False, 0.0),
                                (0.3, True, False, 0.1)]:
        gen = torch.Generator().manual_seed(7)
        sizes = [1, 15, 17, 1000, 65536 + 9]
        w = [torch.randn(n, generator=gen) for n in sizes]
        params = [x.to(pt) for x in w]
        masters = [x.clone() for x in w] if master else None
        m = [torch.randn(n, generator=gen) * 0.1 for n in sizes]
        v = [torch.rand(n, generator=gen) * 0.1 for n in sizes]
        vmax = [x * 2 for x in v] if ams else None
        steps = [torch.full((1,), 3.0) for _ in sizes]
        grads = [torch.randn(n, generator=gen).to(gt) for n in sizes]
        ampc.ops.adam_master(params, grads, m, v, steps, lr=1e-2, masters=masters,
                             max_exp_avg_sqs=vmax, beta1=beta1, weight_decay=wd,
                             decoupled=dec, maximize=ams, inv_scale=torch.full((1,), 0.37),
                             clip_coef=torch.full((1,), 0.9))
        for t in params + m + v + (masters or []) + (vmax or []) + steps:
            h.update(t.contiguous().view(torch.uint8).numpy().tobytes())
print(h.hexdigest())
"""


def test_every_cpu_path_gives_the_same_bits():
    digests = {}
    for isa, stream in (("scalar", 0), ("avx2", 0), ("avx2", 1), ("best", 0), ("best", 1)):
        env = dict(os.environ)
        env.pop("AMPC_CPU_ISA", None)
        env.pop("AMPC_STREAM_BYTES", None)
        if isa != "best":
            env["AMPC_CPU_ISA"] = isa
        if stream:          # every call counts as larger than the cache: streaming stores
            env["AMPC_STREAM_BYTES"] = "0"
        out = subprocess.run([sys.executable, "-c", CHECK_PATHS], env=env, capture_output=True,
                             text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-3000:]
        digests[isa, stream] = out.stdout.strip()
    assert len(set(digests.values())) == 1, digests


def test_threads_do_not_change_the_bits():
    def run(threads):
        p = [torch.randn(300000, generator=torch.Generator().manual_seed(1))]
        g = [torch.randn(300000, generator=torch.Generator().manual_seed(2))]
        m, v, s = [torch.zeros(300000)], [torch.zeros(300000)], [torch.zeros(1)]
        torch.set_num_threads(threads)
        ampc.ops.adam_master(p, g, m, v, s, lr=1e-2)
        return p[0]
    saved = torch.get_num_threads()
    try:
        one, two = run(1), run(2)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(saved)
    assert_same(two, one, "params")


def available_memory():
    """Bytes the kernel says can be had without swapping (MemAvailable), else all of RAM."""
    try:
        with open("/proc/meminfo") as f:
            return next(int(ln.split()[1]) * 1024 for ln in f if ln.startswith("MemAvailable:"))
    except (OSError, StopIteration):
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


@pytest.mark.skipif(
    available_memory() < 26 * 2**30,
    reason="a param of 2^31 + 16 elements needs about 26 GiB (bf16 param and grad, 4 GiB "
           "each; fp32 moments, 8 GiB each; the checks); this machine has less available")
def test_param_past_2_31_elements():
    n = 2**31 + 16
    p = torch.zeros(n, dtype=bf16)
    g = torch.ones(n, dtype=bf16)
    m, v = torch.zeros(n), torch.zeros(n)
    step = torch.zeros(1)
    ampc.ops.adam_master([p], [g], [m], [v], [step], lr=0.5)
    # first step, g = 1: m = 0.1, v = 0.001, p = -lr * (0.1 / 0.1) / (sqrt(1) + eps)
    for t, want in ((p, -0.5), (m, 0.1), (v, 0.001)):
        for idx in (0, 2**31 - 1, 2**31, n - 1):
            assert abs(t[idx].item() - want) < 1e-2 * abs(want), (idx, t[idx].item())
        assert bool((t == t[0]).all())
