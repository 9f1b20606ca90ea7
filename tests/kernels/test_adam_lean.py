"""ampc.ops.adam_lean, the lean Adam step, on the CPU: against torch.optim.AdamW and a
float64 reference, the 8-bit codes against an independent transcription (a search of the
code table, not lean.h's bit arithmetic; exp_avg_sq's codes rounded stochastically with
the weight's random bits), stochastic rounding unbiased, Kahan summation against fp32
master weights, every CPU path bit-equal, bad input refused before anything moves."""
import math

import numpy as np
import pytest
import torch

import ampc
from ampc.ops import QBLOCK
from reference import assert_refused_unchanged, assert_same, run_on_cpu_path
from test_stochastic_bits import random_bits

f32, f16, bf16, u8 = torch.float32, torch.float16, torch.bfloat16, torch.uint8


# ---- an independent transcription of the 8-bit codes (Note [8-bit moments]) ----

def _table(mant_bits):
    """Every code's value, in float64: a small float, exponent bias 7, subnormals."""
    codes = np.arange(1 << (4 + mant_bits))
    e, f = codes >> mant_bits, codes & ((1 << mant_bits) - 1)
    return np.where(e == 0, f * 2.0 ** (-6 - mant_bits),
                    (1 + f / 2.0 ** mant_bits) * 2.0 ** (e - 7.0))


M_TABLE = _table(3)         # 128 magnitudes of exp_avg, up to 480
V_TABLE = _table(4)         # 256 values of sqrt(exp_avg_sq), up to 496


def nearest_code(a, table):
    """Code of the value of `table` nearest to a (float64 array), ties to the even code."""
    hi = np.clip(np.searchsorted(table, a), 1, len(table) - 1)
    lo = hi - 1
    dlo, dhi = a - table[lo], table[hi] - a
    return np.where(dlo < dhi, lo, np.where(dhi < dlo, hi, np.where(lo % 2 == 0, lo, hi)))


def stochastic_code(a, table, rnd):
    """Code of a (float64 array) rounded stochastically between the table's values around
    it: up when the distance past the lower one, over the step, plus rnd's low 16 bits
    over 2^16 reaches 1. Below 2^-6 the kernel first holds a in the fp32 sum a + 2^-6."""
    small = a < 2.0 ** -6
    a = np.where(small, (a.astype(np.float32) + np.float32(2.0 ** -6)).astype(np.float64)
                 - 2.0 ** -6, a)
    lo = np.clip(np.searchsorted(table, a, side="right") - 1, 0, len(table) - 2)
    frac = (a - table[lo]) / (table[lo + 1] - table[lo])
    return lo + (frac + (rnd & 0xFFFF) / 65536.0 >= 1.0)


def v_random_bits(seed, step, n, first=0):
    """The random bits of elements first .. first + n - 1 of a list at a step (the step's
    count after it, from 1): the weight's (Note [8-bit moments])."""
    step_seed = ampc.ops.step_seed(seed, step) & 0xFFFFFFFFFFFFFFFF      # int64 to its bits
    return random_bits(step_seed, np.arange(first, first + n, dtype=np.uint64))


def blocks(x):
    """x (1-d) padded with zeros to whole blocks, as rows."""
    n = x.shape[0]
    pad = -n % QBLOCK
    return np.concatenate([x, np.zeros(pad, x.dtype)]).reshape(-1, QBLOCK), n


MUL_MIN = np.float32(2.0 ** -100)


def _code_magnitude(x, amax, most):
    """lean.h's magnitude to code, in fp32: x times (most / the block's absmax), that factor
    rounded once; under 2^-100 (the factor could overflow) x / absmax times most."""
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        factor = (most / amax).astype(np.float32)[:, None]
        product = (x * factor).astype(np.float32)
        quotient = ((x / amax[:, None]).astype(np.float32) * most).astype(np.float32)
    return np.where(amax[:, None] >= MUL_MIN, product, np.where(amax[:, None] > 0, quotient, 0))


def encode(m, v, rnd):
    """(codes of m, scales of m, codes of v, scales of v) of fp32 moments, as lean.h
    defines them: the magnitude times the code's maximum over the block's absmax (that
    factor in fp32), or below an absmax of 2^-100 the ratio to it times the maximum; m's
    code to nearest, v's stochastically with the elements' random bits rnd."""
    mb, n = blocks(m.numpy().astype(np.float32))
    sb, _ = blocks(np.sqrt(v.numpy().astype(np.float32)))
    mmax = np.abs(mb).max(axis=1)
    smax = sb.max(axis=1)
    am = _code_magnitude(np.abs(mb), mmax, np.float32(480))
    cm = nearest_code(am.astype(np.float64), M_TABLE)
    cm = cm | np.where(np.signbit(mb), 128, 0)
    av = _code_magnitude(sb, smax, np.float32(496)).astype(np.float64)
    rb, _ = blocks(np.asarray(rnd, dtype=np.uint64))
    cv = stochastic_code(av, V_TABLE, rb)
    cv = np.where((cv == 0) & (av > 0), 1, cv)          # never a nonzero v to 0
    return (torch.from_numpy(cm.reshape(-1)[:n].astype(np.uint8)), torch.from_numpy(mmax),
            torch.from_numpy(cv.reshape(-1)[:n].astype(np.uint8)), torch.from_numpy(smax))


def decode(cm, ms, cv, vs):
    """fp32 moments of codes and scales: the code's value times (scale / maximum) in fp32."""
    n = cm.numel()
    idx = np.arange(n) // QBLOCK
    fm = (ms.numpy() / np.float32(480)).astype(np.float32)[idx]
    fv = (vs.numpy() / np.float32(496)).astype(np.float32)[idx]
    c = cm.numpy().astype(np.int64)
    with np.errstate(invalid="ignore"):     # a block of nan scale: nan, as the kernel
        return _decode(c, cv, fm, fv)


def _decode(c, cv, fm, fv):
    m = (M_TABLE[c & 127].astype(np.float32) * fm) * np.where(c & 128, -1, 1).astype(np.float32)
    s = V_TABLE[cv.numpy().astype(np.int64)].astype(np.float32) * fv
    return torch.from_numpy(m.astype(np.float32)), torch.from_numpy((s * s).astype(np.float32))


def scales_for(n):
    return torch.zeros(-(-n // QBLOCK))


def q8_state(n, gen, scale=1.0):
    """Codes and scales of random moments (via the transcription)."""
    m = torch.randn(n, generator=gen) * scale * torch.rand(n, generator=gen) ** 4
    v = (torch.randn(n, generator=gen) * scale) ** 2 * torch.rand(n, generator=gen) ** 6
    return encode(m, v, v_random_bits(99, 1, n))


SIZES = [1, 255, 256, 257, 1000, 65536 + 300]


# ---- the fp32 path is adam_master's, is torch's ----

@pytest.mark.parametrize("decoupled", [True, False], ids=["AdamW", "Adam"])
def test_fp32_moments_match_torch_adamw(decoupled):
    # sizes of whole 16-lane vectors: torch's own tails round apart (Note [tails] of
    # tests/optim/test_adam.py); odd sizes are checked against adam_master below
    gen = torch.Generator().manual_seed(0)
    sizes = [16, 1024, 65536 + 48]
    ours = [torch.randn(n, generator=gen) for n in sizes]
    theirs = [torch.nn.Parameter(p.clone()) for p in ours]
    cls = torch.optim.AdamW if decoupled else torch.optim.Adam
    opt = cls(theirs, lr=1e-2, weight_decay=0.1, fused=True)
    m = [torch.zeros(n) for n in sizes]
    v = [torch.zeros(n) for n in sizes]
    steps = [torch.zeros(1) for _ in sizes]
    for _ in range(5):
        grads = [torch.randn(n, generator=gen) for n in sizes]
        for p, g in zip(theirs, grads):
            p.grad = g.clone()
        opt.step()
        ampc.ops.adam_lean(ours, grads, m, v, steps, lr=1e-2, weight_decay=0.1,
                           decoupled=decoupled)
    for a, b, k in zip(ours, theirs, range(len(sizes))):
        assert_same(a, b.detach(), f"param {k}")
        assert_same(m[k], opt.state[b]["exp_avg"], f"exp_avg {k}")
        assert_same(v[k], opt.state[b]["exp_avg_sq"], f"exp_avg_sq {k}")


@pytest.mark.parametrize("weights", ["master", "fp32", "master_fp32_params"])
def test_fp32_moments_match_adam_master(weights):
    """Also a master over fp32 params: the param is written from it, as adam_master does."""
    master = weights.startswith("master")
    gen = torch.Generator().manual_seed(1)
    sizes = [1, 17, 300, 70001]
    masters = [torch.randn(n, generator=gen) for n in sizes]
    grads = [torch.randn(n, generator=gen).to(bf16) for n in sizes]
    runs = []
    for op in (ampc.ops.adam_lean, ampc.ops.adam_master):
        ms = [x.clone() for x in masters] if master else None
        ps = [x.to(bf16) if weights == "master" else x.clone() for x in masters]
        m, v = [torch.zeros(n) for n in sizes], [torch.zeros(n) for n in sizes]
        st = [torch.zeros(1) for _ in sizes]
        for _ in range(3):
            op(ps, grads, m, v, st, lr=1e-2, masters=ms, inv_scale=torch.tensor([0.5]),
               clip_coef=torch.tensor([0.7]), stochastic=True, seed=9)
        runs.append(ps + (ms or []) + m + v + st)
    for k, (a, b) in enumerate(zip(*runs)):
        assert_same(a, b, f"tensor {k}")


# ---- 8-bit moments ----

@pytest.mark.parametrize("weights", ["fp32", "master", "sr", "kahan", "sr16", "master_sr16"])
def test_q8_step_equals_decode_adam_encode(weights):
    """One step is, bit for bit: decode the codes (transcription), adam_master on fp32
    copies (the tested fp32 arithmetic), encode the new moments (transcription), and the
    weight written as cast writes it (fp16 and bf16 stochastic rounding included: cast's
    bits are checked against a transcription in test_stochastic_bits.py)."""
    gen = torch.Generator().manual_seed(2)
    sizes = SIZES
    w0 = [torch.randn(n, generator=gen) for n in sizes]
    grads = [torch.randn(n, generator=gen).to(bf16) for n in sizes]
    state = [q8_state(n, gen, scale=10.0 ** -k) for k, n in enumerate(sizes)]
    steps0 = [torch.full((1,), 4.0) for _ in sizes]
    kw = dict(lr=1e-2, weight_decay=0.1, inv_scale=torch.tensor([0.25]),
              clip_coef=torch.tensor([0.8]), seed=77)

    pdtype = f32 if weights == "fp32" else f16 if weights.endswith("16") else bf16
    stochastic = weights.startswith("sr") or weights == "master_sr16"
    params = [x.to(pdtype, copy=True) for x in w0]
    masters = [x.clone() for x in w0] if weights.startswith("master") else None
    comps = ([(x - x.to(bf16).float()).to(bf16) for x in w0] if weights == "kahan" else None)
    cm = [s[0].clone() for s in state]
    ms = [s[1].clone() for s in state]
    cv = [s[2].clone() for s in state]
    vs = [s[3].clone() for s in state]
    steps = [s.clone() for s in steps0]
    ampc.ops.adam_lean(params, grads, cm, cv, steps, masters=masters, compensations=comps,
                       exp_avg_scales=ms, exp_avg_sq_scales=vs, stochastic=stochastic,
                       **kw)

    # the reference: weights in fp32, adam_master, then the same write of the weight
    if weights.startswith("master"):
        rw = [x.clone() for x in w0]
    elif weights == "kahan":
        rw = [p.float() + c.float() for p, c in zip([x.to(bf16) for x in w0], comps0(w0))]
    elif weights.startswith("sr"):
        rw = [x.to(pdtype).float() for x in w0]
    else:
        rw = [x.clone() for x in w0]
    moments = [decode(*s) for s in state]
    rm = [x[0] for x in moments]
    rv = [x[1] for x in moments]
    rsteps = [s.clone() for s in steps0]
    ampc.ops.adam_master(rw, grads, rm, rv, rsteps, **kw)
    first = np.cumsum([0] + sizes)            # list-wide indices run on across tensors
    for k in range(len(sizes)):
        want = encode(rm[k], rv[k], v_random_bits(77, 5, sizes[k], first[k]))
        assert_same(cm[k], want[0], f"exp_avg codes {k}")
        assert_same(ms[k], want[1], f"exp_avg scales {k}")
        assert_same(cv[k], want[2], f"exp_avg_sq codes {k}")
        assert_same(vs[k], want[3], f"exp_avg_sq scales {k}")
        assert_same(steps[k], rsteps[k], f"step {k}")
    if weights == "fp32":
        for k in range(len(sizes)):
            assert_same(params[k], rw[k], f"param {k}")
    elif weights == "master":
        for k in range(len(sizes)):
            assert_same(masters[k], rw[k], f"master {k}")
            assert_same(params[k], rw[k].to(bf16), f"param {k}")
    elif stochastic:
        want = ampc.ops.cast(rw, pdtype, stochastic=True, seed=ampc.ops.step_seed(77, 5))
        for k in range(len(sizes)):
            assert_same(params[k], want[k], f"param {k}")
            if masters is not None:
                assert_same(masters[k], rw[k], f"master {k}")
    else:
        for k in range(len(sizes)):
            hi = rw[k].to(bf16)
            assert_same(params[k], hi, f"param {k}")
            assert_same(comps[k], (rw[k] - hi.float()).to(bf16), f"compensation {k}")


def comps0(w0):
    return [(x - x.to(bf16).float()).to(bf16) for x in w0]


def adam64(w, g, m, v, step, lr, beta1, beta2, eps, wd):
    """AdamW in float64."""
    m = beta1 * m + (1 - beta1) * g
    v = beta2 * v + (1 - beta2) * g * g
    w = w * (1 - lr * wd)
    bc1, bc2 = 1 - beta1 ** step, 1 - beta2 ** step
    return w - lr / bc1 * m / (np.sqrt(v) / math.sqrt(bc2) + eps), m, v


def test_q8_step_against_float64_reference():
    """The weights after a step from decoded moments agree with float64 AdamW to fp32's
    precision, and the new codes decode to float64's moments within the code's step (half
    a step for exp_avg, to nearest; a whole one for sqrt(exp_avg_sq), stochastic)."""
    gen = torch.Generator().manual_seed(3)
    n = 5000
    w = torch.randn(n, generator=gen)
    g = torch.randn(n, generator=gen)
    cm, ms, cv, vs = q8_state(n, gen)
    m0, v0 = decode(cm, ms, cv, vs)
    p = [w.clone()]
    ampc.ops.adam_lean(p, [g], [cm], [cv], [torch.full((1,), 9.0)], lr=1e-3, weight_decay=0.01,
                       exp_avg_scales=[ms], exp_avg_sq_scales=[vs])
    want, m64, v64 = adam64(w.double().numpy(), g.double().numpy(), m0.double().numpy(),
                            v0.double().numpy(), 10, 1e-3, 0.9, 0.999, 1e-8, 0.01)
    np.testing.assert_allclose(p[0].double().numpy(), want, rtol=2e-6, atol=1e-7)
    m1, v1 = decode(cm, ms, cv, vs)
    mb, _ = blocks(m64)
    vb, _ = blocks(np.sqrt(v64))
    # a subnormal code's step, in the block's units
    m_step = np.repeat(np.abs(mb).max(axis=1), QBLOCK)[:n] * 2.0 ** -9 / 480
    s_step = np.repeat(vb.max(axis=1), QBLOCK)[:n] * 2.0 ** -10 / 496
    err_m = np.abs(m1.double().numpy() - m64)
    assert (err_m <= np.maximum(np.abs(m64) * 2.0 ** -4, m_step) * 1.001).all()
    err_s = np.abs(np.sqrt(v1.double().numpy()) - np.sqrt(v64))
    assert (err_s <= np.maximum(np.sqrt(v64) * 2.0 ** -4, s_step) * 1.001).all()


def test_q8_error_is_bounded_and_small_v_never_vanishes():
    """Round trips of moments over 30 binades: relative error at most half a code step
    for exp_avg (2^-4) and a whole one on sqrt(exp_avg_sq) (2^-4, stochastic) above the
    subnormal codes, and a nonzero exp_avg_sq never decodes to 0 (it comes back larger
    instead)."""
    gen = torch.Generator().manual_seed(4)
    n = 256 * 64
    m = torch.randn(n, generator=gen) * torch.exp2(-torch.rand(n, generator=gen) * 30)
    v = m * m
    v[::7] = 0.0
    cm, ms, cv, vs = encode(m, v, v_random_bits(4, 1, n))
    m1, v1 = decode(cm, ms, cv, vs)
    mb, _ = blocks(m.numpy())
    sb, _ = blocks(np.sqrt(v.numpy()))
    mmax = np.repeat(np.abs(mb).max(axis=1), QBLOCK)[:n]
    smax = np.repeat(sb.max(axis=1), QBLOCK)[:n]
    rel_m = np.abs(m1.numpy() - m.numpy()) / np.abs(m.numpy())
    big = np.abs(m.numpy()) >= mmax * 2.0 ** -6 / 480 * 1.01   # normal codes
    assert (rel_m[big] <= 2.0 ** -4 * 1.0001).all()
    s, s1 = np.sqrt(v.numpy()), np.sqrt(v1.numpy())
    bigv = s >= smax * 2.0 ** -6 / 496 * 1.01
    assert (np.abs(s1 - s)[bigv] / s[bigv] <= 2.0 ** -4 * 1.0001).all()
    assert (v1.numpy()[v.numpy() > 0] > 0).all()
    assert (v1.numpy()[v.numpy() == 0] == 0).all()


def test_kernel_codes_match_transcription_on_a_wide_range():
    """beta1 = beta2 = 0 and a grad of g: the new moments are g and g * g exactly, so the
    kernel's codes of g over 30 binades must be the transcription's."""
    gen = torch.Generator().manual_seed(5)
    n = 256 * 40 + 77
    g = torch.randn(n, generator=gen) * torch.exp2(-torch.rand(n, generator=gen) * 30)
    g[::11] = 0.0
    g = g.to(bf16).float()          # g * g exact in fp32
    cm, cv = torch.zeros(n, dtype=u8), torch.zeros(n, dtype=u8)
    ms, vs = scales_for(n), scales_for(n)
    ampc.ops.adam_lean([torch.zeros(n)], [g], [cm], [cv], [torch.zeros(1)], lr=0.0,
                       beta1=0.0, beta2=0.0, exp_avg_scales=[ms], exp_avg_sq_scales=[vs])
    want = encode(g, g * g, v_random_bits(0, 1, n))
    assert_same(cm, want[0], "exp_avg codes")
    assert_same(ms, want[1], "exp_avg scales")
    assert_same(cv, want[2], "exp_avg_sq codes")
    assert_same(vs, want[3], "exp_avg_sq scales")


def test_q8_second_moment_decays_in_expectation_under_a_held_block_max():
    """exp_avg_sq with a zero grad and beta2 = 0.999 in blocks whose largest value a grad
    holds: each step moves sqrt(v) 0.05%, far under half a code step (3%), so to nearest
    every code would stay and v would not decay at all; stochastic codes decay the mean of
    sqrt(v) as fp32 does (sqrt(beta2) a step)."""
    nb = 800
    n = nb * QBLOCK
    held = np.zeros(n, bool)
    held[::QBLOCK] = True
    g = torch.from_numpy(np.where(held, 1.0, 0.0).astype(np.float32)).to(bf16)
    v0 = torch.from_numpy(np.where(held, 1.0, 0.25).astype(np.float32))
    cm, ms, cv, vs = encode(torch.zeros(n), v0, v_random_bits(1, 1, n))
    assert_same(decode(cm, ms, cv, vs)[1], v0, "the start, exact in the codes")
    steps = [torch.zeros(1)]
    for _ in range(50):
        ampc.ops.adam_lean([torch.zeros(n, dtype=bf16)], [g], [cm], [cv], steps, lr=0.0,
                           exp_avg_scales=[ms], exp_avg_sq_scales=[vs], seed=3)
    s = decode(cm, ms, cv, vs)[1].double().sqrt().numpy()
    assert np.allclose(s[held], 1.0, rtol=1e-6)
    want = 0.5 * 0.999 ** 25
    got = s[~held].mean()
    assert abs(got - want) < 1e-3, (got, want)      # to nearest: 0.5, 0.0124 away
    assert s[~held].std() > 0                       # the codes moved, not the scale


def test_non_finite_block_decodes_to_nan_and_others_untouched():
    n = 3 * QBLOCK
    g = torch.randn(n)
    g[QBLOCK + 5] = float("inf")
    cm, cv = torch.zeros(n, dtype=u8), torch.zeros(n, dtype=u8)
    ms, vs = scales_for(n), scales_for(n)
    ampc.ops.adam_lean([torch.zeros(n)], [g], [cm], [cv], [torch.zeros(1)], lr=0.0,
                       exp_avg_scales=[ms], exp_avg_sq_scales=[vs])
    m, v = decode(cm, ms, cv, vs)
    assert torch.isnan(m[QBLOCK:2 * QBLOCK]).all() and torch.isnan(v[QBLOCK:2 * QBLOCK]).all()
    assert torch.isfinite(m[:QBLOCK]).all() and torch.isfinite(m[2 * QBLOCK:]).all()


@pytest.mark.parametrize("kind", ["q8", "bf16"])
def test_found_inf_skips_everything(kind):
    gen = torch.Generator().manual_seed(6)
    n = 1000
    p = [torch.randn(n, generator=gen).to(bf16)]
    comps = [torch.zeros(n, dtype=bf16)]
    if kind == "q8":
        cm, ms, cv, vs = q8_state(n, gen)
        m, v, extra = [cm], [cv], dict(exp_avg_scales=[ms], exp_avg_sq_scales=[vs])
    else:
        m, v, extra = [torch.randn(n).to(bf16)], [torch.rand(n).to(bf16)], {}
    steps = [torch.zeros(1)]
    watched = p + comps + m + v + steps + list(extra.get("exp_avg_scales", []))
    before = [t.clone() for t in watched]
    ampc.ops.adam_lean(p, [torch.randn(n).to(bf16)], m, v, steps, lr=1e-2,
                       compensations=comps, found_inf=torch.tensor([1.0]), **extra)
    for t, b in zip(watched, before):
        assert_same(t, b, "state after a skipped step")


# ---- bf16 moments ----

def test_bf16_moments_decay_in_expectation():
    """exp_avg_sq with a zero grad and beta2 = 0.999: round to nearest would keep every
    value (the decay is under half an ulp); stochastic rounding decays the mean like fp32."""
    n = 200000
    v0 = torch.full((n,), 1.0)
    m = [torch.zeros(n, dtype=bf16)]
    v = [v0.to(bf16)]
    steps = [torch.zeros(1)]
    for _ in range(50):
        ampc.ops.adam_lean([torch.zeros(n, dtype=bf16)], [torch.zeros(n, dtype=bf16)], m, v,
                           steps, lr=0.0, seed=3)
    want = 0.999 ** 50
    got = v[0].double().mean().item()
    assert abs(got - want) < 5e-4, (got, want)
    assert v0.to(bf16).float().mean().item() == 1.0     # what round to nearest would keep


# ---- weights without masters ----

def test_stochastic_rounding_is_unbiased():
    """Updates far below half a bf16 ulp: the mean of the written weights is the fp32
    result; round to nearest would leave every weight where it was."""
    n = 400000
    w = torch.full((n,), 1.0, dtype=bf16)
    g = torch.full((n,), 1.0)
    m, v = [torch.zeros(n)], [torch.zeros(n)]
    p = [w.clone()]
    ampc.ops.adam_lean(p, [g], m, v, [torch.zeros(1)], lr=1e-4, stochastic=True, seed=11)
    exact = torch.zeros(n) + 1.0
    ref = [exact.clone()]
    ampc.ops.adam_lean(ref, [g], [torch.zeros(n)], [torch.zeros(n)], [torch.zeros(1)],
                       lr=1e-4)
    want = ref[0].double().mean().item()             # 1 - 1e-4 (to fp32)
    got = p[0].double().mean().item()
    ulp = 2.0 ** -8
    sigma = ulp / 2 / math.sqrt(n)
    assert abs(got - want) < 6 * sigma, (got, want, sigma)
    assert abs(want - 1.0) > 20 * sigma


def test_kahan_tracks_fp32_master_over_many_steps():
    gen = torch.Generator().manual_seed(8)
    n = 4096
    w0 = torch.randn(n, generator=gen)
    master = [w0.clone()]
    mp = [w0.to(bf16)]
    kp, kc = [w0.to(bf16)], [(w0 - w0.to(bf16).float()).to(bf16)]
    rp = [w0.to(bf16)]
    states = [([torch.zeros(n)], [torch.zeros(n)], [torch.zeros(1)]) for _ in range(3)]
    for _ in range(300):
        g = torch.randn(n, generator=gen).to(bf16)
        kw = dict(lr=1e-4, weight_decay=0.01)
        ampc.ops.adam_master(mp, [g], *states[0], masters=master, **kw)
        ampc.ops.adam_lean(kp, [g], *states[1], compensations=kc, **kw)
        ampc.ops.adam_lean(rp, [g], *states[2], **kw)
    kahan = kp[0].double() + kc[0].double()
    ref = master[0].double()
    err_kahan = (kahan - ref).abs().max().item()
    err_plain = (rp[0].double() - ref).abs().max().item()
    scale = ref.abs().max().item()
    # the pair holds about 16 bits: its rounding error, a few 2^-18 of the weight a step,
    # walks; bf16 alone loses most small updates
    assert err_kahan < 2.0 ** -12 * scale, err_kahan
    assert err_plain > 10 * err_kahan, (err_plain, err_kahan)


# ---- every CPU path gives the same bits ----

CHECK_PATHS = r"""
import hashlib, torch, ampc
f32, f16, bf16, u8 = torch.float32, torch.float16, torch.bfloat16, torch.uint8
h = hashlib.sha256()
# every layout the CPU loops compile with constant kinds, and others that take the loop with
# kinds read at run time (fp16 params, fp32 grads, Adam's L2, maximize, a small beta1)
# (AVX2 and AVX-512 write the lean preset's loops by hand, and skip the scale and clip
# multiplies when both are 1: "unscaled" takes that branch; "specials" gives blocks of zero,
# inf, nan and huge grads, which the hand-written loops meet as NaN weights and as blocks
# whose codes are all 0)
SCALED = dict(inv_scale=torch.full((1,), 0.37), clip_coef=torch.full((1,), 0.9))
SHAPES = {"adamw": (bf16, dict(weight_decay=0.1, **SCALED)),
          "unscaled": (bf16, dict(weight_decay=0.1)),
          "specials": (bf16, dict(weight_decay=0.1)),
          "others": (f32, dict(weight_decay=0.1, decoupled=False, maximize=True, beta1=0.3,
                               **SCALED))}
for shape, (gdt, kw) in SHAPES.items():
  for kind in ("f32", "bf16", "q8"):
    for weights in ("fp32", "master", "sr", "kahan", "rne", "master_sr", "f16_master", "f16_sr"):
        gen = torch.Generator().manual_seed(7)
        sizes = [1, 15, 255, 257, 1000, 65536 + 9]
        w = [torch.randn(n, generator=gen) for n in sizes]
        pdt = f32 if weights == "fp32" else f16 if weights.startswith("f16") else bf16
        params = [x.to(pdt) for x in w]
        masters = [x.clone() for x in w] if "master" in weights else None
        comps = [torch.zeros(n, dtype=bf16) for n in sizes] if weights == "kahan" else None
        dt = {"f32": f32, "bf16": bf16, "q8": u8}[kind]
        m = [torch.zeros(n, dtype=dt) for n in sizes]
        v = [torch.zeros(n, dtype=dt) for n in sizes]
        sc = ([[torch.zeros(-(-n // 256)) for n in sizes] for _ in range(2)] if kind == "q8"
              else [None, None])
        steps = [torch.zeros(1) for _ in sizes]
        for k in range(3):
            grads = [torch.randn(n, generator=gen).to(gdt) * 10.0 ** -k for n in sizes]
            if shape == "specials":
                g = grads[-1]
                g[:256] = 0.0
                g[300 + k] = float("inf")
                g[700 + 50 * k] = float("nan")
                g[1000:1040] = 3e38
            ampc.ops.adam_lean(params, grads, m, v, steps, lr=1e-2, masters=masters,
                               compensations=comps, exp_avg_scales=sc[0],
                               exp_avg_sq_scales=sc[1], stochastic="sr" in weights, seed=5,
                               **kw)
        for t in params + m + v + (masters or []) + (comps or []) + (sc[0] or []) + \
                (sc[1] or []) + steps:
            if t.is_floating_point():   # a NaN's sign follows the operand order, so all
                t = t.masked_fill(t.isnan(), float("nan"))     # NaNs count as one value
            h.update(t.contiguous().view(torch.uint8).numpy().tobytes())
print(h.hexdigest())
"""


def test_every_cpu_path_gives_the_same_bits():
    digests = {isa: run_on_cpu_path(isa, CHECK_PATHS).strip() for isa in ("scalar", "avx2", "best")}
    assert len(set(digests.values())) == 1, digests


def test_threads_do_not_change_the_bits():
    def run(threads):
        gen = torch.Generator().manual_seed(1)
        n = 300000
        p = [torch.randn(n, generator=gen).to(bf16)]
        g = [torch.randn(n, generator=gen)]
        m, v = [torch.zeros(n, dtype=u8)], [torch.zeros(n, dtype=u8)]
        sc = [scales_for(n)], [scales_for(n)]
        torch.set_num_threads(threads)
        ampc.ops.adam_lean(p, g, m, v, [torch.zeros(1)], lr=1e-2, exp_avg_scales=sc[0],
                           exp_avg_sq_scales=sc[1], stochastic=True)
        return p + m + v + sc[0] + sc[1]
    saved = torch.get_num_threads()
    try:
        one, two = run(1), run(2)
    finally:
        torch.set_num_threads(saved)
    for a, b in zip(one, two):
        assert_same(b, a, "state")


# ---- bad input ----

def _case(**over):
    n = 300
    args = dict(params=[torch.randn(n).to(bf16)], grads=[torch.randn(n).to(bf16)],
                exp_avgs=[torch.zeros(n, dtype=u8)], exp_avg_sqs=[torch.zeros(n, dtype=u8)],
                steps=[torch.zeros(1)], exp_avg_scales=[scales_for(n)],
                exp_avg_sq_scales=[scales_for(n)])
    args.update(over)
    return args


BAD = {
    "no scales": (dict(exp_avg_scales=None), "exp_avg_scales must have as many tensors"),
    "short scales": (dict(exp_avg_sq_scales=[torch.zeros(1)]),
                     r"exp_avg_sq_scales\[0\] must hold 2 values"),
    "mixed moments": (dict(exp_avg_sqs=[torch.zeros(300, dtype=bf16)]),
                      r"exp_avg_sqs\[0\] must be torch.uint8"),
    "fp16 moments": (dict(exp_avgs=[torch.zeros(300, dtype=f16)],
                          exp_avg_sqs=[torch.zeros(300, dtype=f16)]),
                     r"exp_avgs\[0\] must be torch.float32, torch.bfloat16 or torch.uint8"),
    "kahan on fp16": (dict(params=[torch.randn(300).to(f16)], grads=[torch.randn(300).to(f16)],
                           compensations=[torch.zeros(300, dtype=bf16)]),
                      "compensations need torch.bfloat16 params"),
    "kahan and master": (dict(compensations=[torch.zeros(300, dtype=bf16)],
                              masters=[torch.zeros(300)]),
                         "compensations and masters are two ways"),
    "scales with fp32": (dict(exp_avgs=[torch.zeros(300)], exp_avg_sqs=[torch.zeros(300)]),
                         "exp_avg_scales and exp_avg_sq_scales are for 8-bit"),
    "moment shape": (dict(exp_avgs=[torch.zeros(299, dtype=u8)]),
                     r"exp_avgs\[0\] must have the shape of params\[0\]"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_is_refused_before_anything_moves(case):
    over, pattern = BAD[case]
    args = _case(**over)
    watched = [t for k in ("params", "exp_avgs", "exp_avg_sqs", "steps", "exp_avg_scales",
                           "exp_avg_sq_scales", "compensations", "masters")
               for t in (args.get(k) or [])]
    p, g, m, v, s = (args.pop(k) for k in ("params", "grads", "exp_avgs", "exp_avg_sqs",
                                           "steps"))
    assert_refused_unchanged(
        case, lambda: ampc.ops.adam_lean(p, g, m, v, s, lr=1e-2, **args), watched,
        RuntimeError, "ampc.adam_lean: " + pattern)


# (absmax, value) pairs whose code differs by one step between value * (MAX / absmax) and the
# older value / absmax * MAX, for exp_avg (MAX 480) and, to nearest, for sqrt(exp_avg_sq)
# (496; its codes now round stochastically, where the two differ only when the random bits
# fall exactly at the one-ulp gap, so these only check the paths agree there); and an
# exp_avg block under an absmax of 2^-100, which divides (a nonzero sqrt(exp_avg_sq) is at
# least 2^-74.5: its blocks never do)
M_TIES = [(10.198850631713867, 7.819118499755859), (10.198850631713867, 1.062380313873291),
          (1.8473109006881714, 1.785733938217163), (1.8473109006881714, 1.1699634790420532)]
V_TIES = [(0.00013932381989434361, 5.1965539569209795e-06), (0.9848464727401733, 0.5241925120353699),
          (0.17447435855865479, 0.07457371801137924), (6.410659807443153e-06, 4.446102593647083e-06)]
TINY = (1.5 * 2.0 ** -125, 1.25 * 2.0 ** -125)      # 480 / absmax would overflow to inf

CHECK_TIES = r"""
import sys, torch
from ampc.optim._codes import encode_moments
m, v = (torch.tensor(eval(a), dtype=torch.float32) for a in sys.argv[1:3])
out = encode_moments(m, v, "8bit")
print((out["exp_avg_codes"].tolist(), out["exp_avg_sq_codes"].tolist()))
"""


def _blocks_of(pairs):
    x = np.zeros(QBLOCK * len(pairs), np.float32)
    for j, (a, b) in enumerate(pairs):
        x[j * QBLOCK:j * QBLOCK + 2] = a, b
    return x


@pytest.mark.parametrize("isa", ["scalar", "avx2", "best"])
def test_codes_multiply_by_the_block_s_factor_on_every_cpu_path(isa):
    """Codes come from value * (MAX / absmax), that factor rounded once a block: on values
    where the older value / absmax * MAX rounds to the next code, every CPU path gives the
    transcription's code, and a block under 2^-100 takes the divide (exp_avg's; the
    stochastic codes of sqrt(exp_avg_sq) agree with the transcription there too)."""
    m = _blocks_of(M_TIES + [TINY])
    s = _blocks_of(V_TIES + [(1.0, 0.5)])         # as many blocks as m
    v = (s.astype(np.float32) ** 2).astype(np.float32)     # sqrt gives s back
    assert np.array_equal(np.sqrt(v), s)
    cm, _, cv, _ = encode(torch.from_numpy(m), torch.from_numpy(v), v_random_bits(0, 1, m.size))
    out = run_on_cpu_path(isa, CHECK_TIES, repr(m.tolist()), repr(v.tolist()))
    got_m, got_v = (np.array(x) for x in eval(out))
    assert np.array_equal(got_m, cm.numpy()) and np.array_equal(got_v, cv.numpy())
    # the pairs are ties of the two formulas: the divide would have given other codes
    for j, (a, b) in enumerate(M_TIES):
        old = np.float32(np.float32(np.float32(b) / np.float32(a)) * np.float32(480))
        assert nearest_code(np.array([float(old)]), M_TABLE)[0] != got_m[j * QBLOCK + 1] & 127
