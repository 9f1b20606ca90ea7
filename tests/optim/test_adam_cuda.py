"""CUDA adam_master against ampc's CPU adam_master, bit for bit, on the same inputs.

Tolerance: none. Both kernels run adam.h's per-element math, and the CUDA build rounds
every operation on its own as the C build does (--fmad=false, IEEE sqrt and division), so
params, masters, exp_avgs, exp_avg_sqs, max_exp_avg_sqs and step counts must be
bit-identical after every step, stochastic rounding included (same seed, same bits). NaNs
are compared by position only: the GPU does not keep NaN payloads. Grads must come back
untouched.

One known hazard: each tensor's fp32 constants come from pow() in double, whose last bit
may differ between CUDA's and the host's math library; that changes an fp32 constant only
when it lies that close to a rounding boundary. It would show as one whole tensor off by
an ulp, not as scattered elements.

All tests need a GPU; the big-tensor test is also marked slow.
"""
import itertools
import math

import pytest
import torch

import ampc
from reference import assert_same

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

f32, f16, bf16 = torch.float32, torch.float16, torch.bfloat16
DTYPES = [f32, f16, bf16]
CHUNK = 65536
# around the 8-element vector and the 65536-element chunk of a block, empty ones included
SIZES = [1, 7, 8, 9, 17, 0, 4095, 4097, CHUNK - 1, CHUNK + 1, 2 * CHUNK + 5, 0]
LISTS = ["params", "grads", "masters", "exp_avgs", "exp_avg_sqs", "max_exp_avg_sqs", "steps"]


def name(dtype):
    return str(dtype).replace("torch.", "")


def values(n, dtype, seed, kind, specials=False):
    """n values of `kind` (grad, weight, m, v) in `dtype`; with specials, inf, -inf, nan,
    -0.0 and a subnormal planted at the start, middle and end."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=gen)
    if kind == "grad":
        x = x * torch.exp2(torch.randint(-12, 12, (n,), generator=gen).float())
    elif kind == "m":
        x = x * 1e-3
    elif kind == "v":
        x = x * x * 1e-6
    if specials and n:
        planted = torch.tensor([math.inf, -math.inf, math.nan, -0.0, 1e-40])
        for j, pos in enumerate((0, n // 2, n - 1)):
            x[pos] = planted[(seed + j) % planted.numel()]
    return x.to(dtype)


def make_state(sizes, pdtype=f32, gdtype=None, master=False, amsgrad=False, seed=0,
               specials=False, step0=0.0):
    """The CPU tensors of one adam_master call; masters and max_exp_avg_sqs are [] when
    off. Steps start at step0, step0 + 1, step0 + 2, ... (mod 3)."""
    gdtype = gdtype or pdtype
    s = {key: [] for key in LISTS}
    for i, n in enumerate(sizes):
        base = seed * 100003 + i * 7
        weight = values(n, f32, base, "weight", specials)
        s["params"].append(weight.to(pdtype))
        s["grads"].append(values(n, gdtype, base + 1, "grad", specials))
        if master:
            s["masters"].append(weight)
        s["exp_avgs"].append(values(n, f32, base + 2, "m", specials))
        s["exp_avg_sqs"].append(values(n, f32, base + 3, "v", specials))
        if amsgrad:
            s["max_exp_avg_sqs"].append(values(n, f32, base + 4, "v", specials) * 2)
        s["steps"].append(torch.tensor([step0 + i % 3], dtype=f32))
    return s


def place(t, device, offset=0):
    """A copy of t on `device` whose storage starts `offset` elements into its buffer."""
    buf = torch.empty(t.numel() + offset, dtype=t.dtype, device=device)
    out = buf[offset:offset + t.numel()].view(t.shape)
    out.copy_(t)
    return out


def to_device(state, device, offsets=None):
    """state's tensors on `device`; offsets maps a list name to a storage offset (an int,
    or a function of the tensor's index)."""
    offsets = offsets or {}
    out = {}
    for key, tensors in state.items():
        off = offsets.get(key, 0)
        out[key] = [place(t, device, off(i) if callable(off) else off)
                    for i, t in enumerate(tensors)]
    return out


def step(state, control=None, **kwargs):
    """One adam_master call on state; control's tensors (lr among them) override kwargs."""
    kwargs = {"lr": 1e-2, "weight_decay": 0.05, **kwargs, **(control or {})}
    ampc.ops.adam_master(state["params"], state["grads"], state["exp_avgs"],
                         state["exp_avg_sqs"], state["steps"],
                         masters=state["masters"] or None,
                         max_exp_avg_sqs=state["max_exp_avg_sqs"] or None, **kwargs)


def control_on(device, lr=None, inv_scale=None, clip_coef=None, found_inf=None):
    """The 1-element fp32 control tensors on `device`, for those given."""
    given = dict(lr=lr, inv_scale=inv_scale, clip_coef=clip_coef, found_inf=found_inf)
    return {k: torch.tensor([v], dtype=f32, device=device) for k, v in given.items()
            if v is not None}


def assert_states_equal(gpu, cpu, what):
    for key in LISTS:
        assert len(gpu[key]) == len(cpu[key]), f"{what}: {key} lengths"
        for i, (a, b) in enumerate(zip(gpu[key], cpu[key])):
            assert_same(a.cpu(), b, f"{what}: {key}[{i}]")


def run_both(state, steps=1, offsets=None, control=None, **kwargs):
    """Runs `steps` steps on a CPU copy and a CUDA copy of state; returns both."""
    cpu = to_device(state, "cpu", offsets)
    gpu = to_device(state, "cuda", offsets)
    for k in range(steps):
        seeded = dict(kwargs, seed=kwargs.get("seed", 0) + k)
        step(cpu, control_on("cpu", **(control or {})), **seeded)
        step(gpu, control_on("cuda", **(control or {})), **seeded)
    torch.cuda.synchronize()
    return gpu, cpu


# ---- modes ----

@pytest.mark.parametrize("decoupled", [True, False], ids=["AdamW", "Adam"])
@pytest.mark.parametrize("amsgrad", [False, True], ids=["", "amsgrad"])
@pytest.mark.parametrize("maximize", [False, True], ids=["", "maximize"])
def test_fp32_plain_matches_cpu_cuda(decoupled, amsgrad, maximize):
    state = make_state(SIZES, f32, amsgrad=amsgrad, seed=1)
    gpu, cpu = run_both(state, steps=3, decoupled=decoupled, maximize=maximize)
    assert_states_equal(gpu, cpu, f"fp32 decoupled={decoupled} amsgrad={amsgrad}")
    assert [s.item() for s in gpu["steps"]] == [3.0 + i % 3 for i in range(len(SIZES))]


@pytest.mark.parametrize("pdtype", [bf16, f16], ids=name)
@pytest.mark.parametrize("decoupled", [True, False], ids=["AdamW", "Adam"])
def test_master_mode_matches_cpu_cuda(pdtype, decoupled):
    state = make_state(SIZES, pdtype, master=True, seed=2)
    control = dict(lr=3e-3, inv_scale=1 / 1024, clip_coef=0.7, found_inf=0.0)
    gpu, cpu = run_both(state, steps=5, control=control, decoupled=decoupled,
                        weight_decay=0.1)
    assert_states_equal(gpu, cpu, f"{name(pdtype)} masters")
    for p, m in zip(gpu["params"], gpu["masters"]):     # params = masters, rounded
        assert_same(p, m.to(pdtype), "params are the rounded masters")


@pytest.mark.parametrize("pdtype,gdtype", list(itertools.product(DTYPES, DTYPES)),
                         ids=lambda d: name(d))
@pytest.mark.parametrize("master", [False, True], ids=["plain", "master"])
def test_every_dtype_pair_matches_cpu_cuda(pdtype, gdtype, master):
    state = make_state(SIZES, pdtype, gdtype, master=master, amsgrad=master, seed=3)
    gpu, cpu = run_both(state, steps=2, control=dict(inv_scale=0.5))
    assert_states_equal(gpu, cpu, f"params {name(pdtype)} grads {name(gdtype)}")


@pytest.mark.parametrize("pdtype,gdtype", [(f32, f32), (bf16, bf16), (f16, f32)],
                         ids=lambda d: name(d))
def test_nan_inf_and_subnormals_match_cpu_cuda(pdtype, gdtype):
    state = make_state(SIZES, pdtype, gdtype, master=pdtype != f32, amsgrad=True, seed=4,
                       specials=True)
    gpu, cpu = run_both(state, steps=2, decoupled=False, maximize=True)
    assert_states_equal(gpu, cpu, "specials")


@pytest.mark.parametrize("betas", [(0.9, 0.999), (0.3, 0.5), (0.0, 0.0)],
                         ids=["default", "small", "zero"])
def test_hyperparameters_match_cpu_cuda(betas):
    state = make_state([1000, 4097], bf16, master=True, amsgrad=True, seed=5)
    gpu, cpu = run_both(state, steps=7, beta1=betas[0], beta2=betas[1], eps=1e-3,
                        weight_decay=0.0)
    assert_states_equal(gpu, cpu, f"betas {betas}")


def test_large_step_counts_match_cpu_cuda():
    # 2^24 - 1 + 1 and beyond: the fp32 step count rounds as the CPU's does
    state = make_state([100, 9], f32, seed=6, step0=2.0**24 - 1)
    gpu, cpu = run_both(state, steps=3)
    assert_states_equal(gpu, cpu, "large steps")


# ---- control values on the device ----

@pytest.mark.parametrize("lr,inv_scale,clip_coef,found_inf",
                         list(itertools.product([None, 5e-3], [None, 2.0**-12], [None, 0.3],
                                                [None, 0.0])))
def test_control_tensors_match_cpu_cuda(lr, inv_scale, clip_coef, found_inf):
    state = make_state([CHUNK + 9, 100], bf16, f16, master=True, seed=7)
    control = dict(lr=lr, inv_scale=inv_scale, clip_coef=clip_coef, found_inf=found_inf)
    gpu, cpu = run_both(state, steps=2, control=control)
    assert_states_equal(gpu, cpu, f"control {control}")


@pytest.mark.parametrize("value", [1.0, 2.0, -1.0, math.inf, math.nan])
@pytest.mark.parametrize("master", [False, True], ids=["plain", "master"])
def test_found_inf_skips_everything_cuda(value, master):
    state = make_state(SIZES, bf16 if master else f32, master=master, amsgrad=True, seed=8)
    gpu, cpu = run_both(state, steps=2, control=dict(found_inf=value, inv_scale=0.5),
                        stochastic=True)
    assert_states_equal(gpu, cpu, f"found_inf={value}")
    assert_states_equal(gpu, to_device(state, "cpu"), f"found_inf={value} changed nothing")


def test_skipped_steps_in_a_run_match_cpu_cuda():
    state = make_state([CHUNK + 3, 17, 0, 4096], bf16, master=True, amsgrad=True, seed=9)
    cpu, gpu = to_device(state, "cpu"), to_device(state, "cuda")
    controls = {dev: control_on(dev, lr=1e-3, inv_scale=0.25, found_inf=0.0)
                for dev in ("cpu", "cuda")}
    pattern = [0, 1, 0, 0, 1, 1, 0]
    for k, bad in enumerate(pattern):
        for dev, s in (("cpu", cpu), ("cuda", gpu)):
            controls[dev]["found_inf"].fill_(float(bad))
            step(s, controls[dev], seed=k, stochastic=True)
    assert_states_equal(gpu, cpu, "skip pattern")
    taken = pattern.count(0)
    assert [s.item() for s in gpu["steps"]] == [taken + i % 3 for i in range(4)]


# ---- rounding of the params ----

@pytest.mark.parametrize("pdtype", [bf16, f16], ids=name)
@pytest.mark.parametrize("master", [False, True], ids=["plain", "master"])
def test_stochastic_rounding_matches_cpu_cuda(pdtype, master):
    state = make_state(SIZES, pdtype, master=master, seed=10)
    gpu, cpu = run_both(state, steps=3, stochastic=True, seed=1234)
    assert_states_equal(gpu, cpu, f"stochastic {name(pdtype)}")
    if master:      # it did round stochastically: some params are not the nearest value
        nearest = torch.cat([m.to(pdtype).view(torch.int16) for m in gpu["masters"]])
        got = torch.cat([p.view(torch.int16) for p in gpu["params"]])
        assert not torch.equal(got, nearest)
    other, _ = run_both(state, steps=3, stochastic=True, seed=99)
    assert not all(torch.equal(a.view(torch.int16), b.view(torch.int16))
                   for a, b in zip(other["params"], gpu["params"]))


def test_fp32_params_ignore_stochastic_cuda():
    state = make_state(SIZES, f32, master=True, seed=11)
    gpu, cpu = run_both(state, steps=2, stochastic=True, seed=5)
    assert_states_equal(gpu, cpu, "fp32 stochastic")
    for p, m in zip(gpu["params"], gpu["masters"]):
        assert_same(p, m, "fp32 params equal their masters")


# ---- many tensors, odd layouts ----

def test_thousand_small_tensors_match_cpu_cuda():
    # 1,000 tensors: three launches of the update and one of the step counts (about 20
    # and two with the 4 KB tables of older drivers)
    gen = torch.Generator().manual_seed(12)
    sizes = torch.randint(0, 3000, (1000,), generator=gen)
    sizes[torch.randint(0, 1000, (100,), generator=gen)] = 0
    state = make_state(sizes.tolist(), bf16, f32, master=True, amsgrad=True, seed=12)
    offsets = {"params": lambda i: i % 3, "exp_avgs": lambda i: i % 5 == 0}
    gpu, cpu = run_both(state, steps=2, offsets=offsets, stochastic=True, seed=7)
    assert_states_equal(gpu, cpu, "1000 tensors")
    assert [s.item() for s in gpu["steps"]] == [2.0 + i % 3 for i in range(1000)]


@pytest.mark.parametrize("shifted", LISTS[:6] + ["all"])
def test_misaligned_storage_offsets_match_cpu_cuda(shifted):
    # one list (or all) off the 16-byte alignment: that chunk falls back to one element a
    # thread, and must still give the same bits
    keys = LISTS[:6] if shifted == "all" else [shifted]
    offsets = {key: (lambda i: 1 + i % 3) for key in keys}
    state = make_state(SIZES, bf16, f16, master=True, amsgrad=True, seed=13)
    gpu, cpu = run_both(state, steps=2, offsets=offsets, decoupled=False)
    assert_states_equal(gpu, cpu, f"{shifted} misaligned")


# ---- no sync, graphs ----

def test_no_host_sync_cuda():
    state = to_device(make_state([CHUNK + 1, 10], bf16, master=True, amsgrad=True, seed=14),
                      "cuda")
    control = control_on("cuda", lr=1e-3, inv_scale=0.5, clip_coef=0.9, found_inf=0.0)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step(state, control, stochastic=True, seed=3)
        step(state, control, decoupled=False)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert [s.item() for s in state["steps"]] == [2.0, 3.0]


def test_graph_capture_matches_cpu_cuda():
    sizes = [3 * CHUNK + 1, 10, 0]
    state = make_state(sizes, bf16, master=True, seed=15)
    cpu, gpu = to_device(state, "cpu"), to_device(state, "cuda")
    controls = {dev: control_on(dev, lr=1e-3, inv_scale=0.5, found_inf=0.0)
                for dev in ("cpu", "cuda")}

    side = torch.cuda.Stream()                  # warm up off the capture, as torch asks
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step(gpu, controls["cuda"], stochastic=True, seed=4)
    torch.cuda.current_stream().wait_stream(side)
    step(cpu, controls["cpu"], stochastic=True, seed=4)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step(gpu, controls["cuda"], stochastic=True, seed=4)

    for k in range(5):
        bad = float(k == 2)
        fresh = [values(n, bf16, 500 + 10 * k + i, "grad") for i, n in enumerate(sizes)]
        for dev, s in (("cpu", cpu), ("cuda", gpu)):
            for g, f in zip(s["grads"], fresh):
                g.copy_(f)
            controls[dev]["found_inf"].fill_(bad)
            controls[dev]["lr"].fill_(1e-3 * (k + 1))
        graph.replay()
        step(cpu, controls["cpu"], stochastic=True, seed=4)
        torch.cuda.synchronize()
        assert_states_equal(gpu, cpu, f"replay {k}")
    assert [s.item() for s in gpu["steps"]] == [5.0, 6.0, 7.0]


# ---- tensors over 2^31 elements ----

@pytest.mark.slow
def test_over_2_31_elements_cuda():
    # the elements past 2^31 of a bf16 master-weight tensor, and the tensor after it,
    # against the CPU step on copies of those pieces (the step is element-wise)
    n = 2**31 + CHUNK + 5
    gen = torch.Generator(device="cuda").manual_seed(16)
    big = {
        "params": [torch.empty(n, dtype=bf16, device="cuda")],
        "grads": [torch.randn(n, device="cuda", generator=gen).to(bf16)],
        "masters": [torch.randn(n, device="cuda", generator=gen)],
        "exp_avgs": [torch.randn(n, device="cuda", generator=gen) * 1e-3],
        "exp_avg_sqs": [torch.rand(n, device="cuda", generator=gen) * 1e-6],
        "max_exp_avg_sqs": [],
        "steps": [torch.tensor([4.0], device="cuda")],
    }
    big["params"][0].copy_(big["masters"][0])
    small = to_device(make_state([1000], bf16, master=True, seed=17), "cuda")
    for key in LISTS:
        big[key] = big[key] + small[key]
    pieces = [slice(0, 1000), slice(2**31 - 100, n)]
    before = [{key: [big[key][0][s].cpu() if key != "steps" else big[key][0].cpu()]
               if big[key] else [] for key in LISTS} for s in pieces]
    small_before = to_device(small, "cpu")

    step(big, control_on("cuda", inv_scale=0.5))
    torch.cuda.synchronize()

    for s, cpu in zip(pieces, before):
        step(cpu, control_on("cpu", inv_scale=0.5))
        got = {key: [big[key][0][s]] if key != "steps" else [big[key][0]]
               for key in LISTS if big[key]}
        for key in got:
            assert_same(got[key][0].cpu(), cpu[key][0], f"{key} [{s.start}:{s.stop}]")
    step(small_before, control_on("cpu", inv_scale=0.5))
    for key in LISTS:
        for a, b in zip(big[key][1:], small_before[key]):
            assert_same(a.cpu(), b, f"tensor after the big one: {key}")
