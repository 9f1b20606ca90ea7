"""CUDA behaviours a CPU test cannot see: graph replays that must draw new random bits,
graph capture of each op as the very first CUDA work of a process, stream ordering,
devices and threads, launches split over several tables, Adam's constants over many step
counts, and a full training step without a host sync. All need a GPU; on a machine with
one, scripts/gpu_check.sh runs them.

None of these has run yet: they were written for the first GPU run, from a reading of
the kernels and of torch's CUDA semantics."""
import math
import os
import subprocess
import sys
import threading

import pytest
import torch

import ampc
import ampc.optim

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
f32, f16, bf16 = torch.float32, torch.float16, torch.bfloat16
CHUNK = 65536
MAX_TENSORS = 902       # tensors in one launch's 32 KB table of cast, unscale_check, check_norm


def bits(t):
    return t.contiguous().view(torch.int32 if t.dtype == f32 else torch.int16).cpu()


def assert_bits(got, want, what):
    assert got.shape == want.shape and got.dtype == want.dtype, what
    same = torch.eq(bits(got), bits(want)) | (torch.isnan(got.float().cpu()) &
                                              torch.isnan(want.float().cpu()))
    assert bool(same.all()), f"{what}: {int((~same).sum())} of {same.numel()} elements differ"


def capture(fn):
    """Runs fn once on a side stream (warm-up, as torch asks), then captures one call."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


# ---- stochastic rounding under graphs (Note [random bits that advance on the device]) ----

def test_adam_graph_replays_draw_new_bits_cuda():
    # lr = 0 keeps the masters where they are: every replay rounds the same values, with
    # the bits of the step count it takes, which advances on the device
    gen = torch.Generator().manual_seed(0)
    sizes = [1000, 4097, CHUNK + 3]
    masters = [torch.randn(n, generator=gen).cuda() for n in sizes]
    params = [m.to(bf16) for m in masters]
    grads = [torch.randn(n, generator=gen).to(bf16).cuda() for n in sizes]
    m = [torch.zeros(n, device="cuda") for n in sizes]
    v = [torch.zeros(n, device="cuda") for n in sizes]
    steps = [torch.zeros(1, device="cuda") for _ in sizes]
    seed = 2024

    graph = capture(lambda: ampc.ops.adam_master(params, grads, m, v, steps, lr=0.0,
                                                  masters=masters, stochastic=True, seed=seed))
    seen = []
    for k in (2, 3, 4):                     # the warm-up took step 1
        graph.replay()
        torch.cuda.synchronize()
        assert [s.item() for s in steps] == [float(k)] * len(sizes)
        want = ampc.ops.cast([x.cpu() for x in masters], bf16, stochastic=True,
                             seed=ampc.ops.step_seed(seed, k))
        for i, (p, w) in enumerate(zip(params, want)):
            assert_bits(p, w, f"replay taking step {k}, param {i}")
        seen.append(torch.cat([bits(p) for p in params]))
    for a, b in [(0, 1), (1, 2)]:
        assert int((seen[a] != seen[b]).sum()) > 1000, "two replays rounded alike"


def test_cast_graph_replays_read_the_seed_tensor_cuda():
    gen = torch.Generator().manual_seed(1)
    sizes = [CHUNK + 9, 77, 3 * CHUNK]
    src = [torch.randn(n, generator=gen).cuda() for n in sizes]
    dst = [torch.empty(n, dtype=f16, device="cuda") for n in sizes]
    seed = torch.tensor([41], dtype=torch.int64, device="cuda")

    def body():
        ampc.ops.cast_(dst, src, stochastic=True, seed=seed)
        seed.add_(1)

    graph = capture(body)                   # the warm-up used 41
    seen = []
    for k in (42, 43):
        graph.replay()
        torch.cuda.synchronize()
        want = ampc.ops.cast([s.cpu() for s in src], f16, stochastic=True, seed=k)
        for i, (d, w) in enumerate(zip(dst, want)):
            assert_bits(d, w, f"replay with seed {k}, tensor {i}")
        seen.append(torch.cat([bits(d) for d in dst]))
    assert seed.item() == 44
    assert int((seen[0] != seen[1]).sum()) > 1000


# ---- graph capture as the first CUDA work of a process ----

FIRST_CAPTURE = r"""
import sys, torch, ampc
op = sys.argv[1]
gen = torch.Generator().manual_seed(3)
cpu = {
    "grads": [torch.randn(n, generator=gen).to(torch.float16) for n in (70000, 5)],
    "masters": [torch.randn(n, generator=gen) for n in (70000, 5)],
    "m": [torch.zeros(n) for n in (70000, 5)], "v": [torch.zeros(n) for n in (70000, 5)],
    "steps": [torch.zeros(1), torch.zeros(1)], "found_inf": torch.zeros(1),
    "inv_scale": torch.full((1,), 0.5), "scale": torch.full((1,), 1024.0),
    "tracker": torch.zeros(1, dtype=torch.int32), "out": [torch.empty(n, dtype=torch.bfloat16)
                                                          for n in (70000, 5)],
    "q": [torch.zeros(n, dtype=torch.float8_e4m3fn) for n in (70000, 5)],
    "fp8_scale": torch.tensor([2.0, 0.5]), "amax": torch.zeros(2), "history": torch.zeros(4, 2),
    "scale_inv": torch.ones(2),
}
if op == "unscale_check":      # elsewhere an inf would make NaNs, whose payloads may differ
    cpu["grads"][1][2] = float("inf")
cpu["params"] = [x.to(torch.bfloat16) for x in cpu["masters"]]
dev = {k: [t.cuda() for t in v] if isinstance(v, list) else v.cuda() for k, v in cpu.items()}

def run(s):
    if op == "cast":
        ampc.ops.cast_(s["out"], s["masters"], stochastic=True, seed=9)
    elif op == "unscale_check":
        ampc.ops.unscale_check(s["grads"], s["found_inf"], s["inv_scale"])
    elif op == "check_norm":
        return ampc.ops.unscale_check(s["grads"][:1], s["found_inf"], s["inv_scale"], check_only=True)
    elif op == "update_scale":
        ampc.ops.update_scale(s["scale"], s["tracker"], s["found_inf"], 2.0, 0.5, 1)
    elif op == "cast_fp8":
        ampc.ops.cast_fp8(s["q"], s["grads"], s["fp8_scale"], s["amax"])
    elif op == "fp8_update_scales":
        ampc.ops.fp8_update_scales(s["history"], s["amax"].add_(3.0), s["fp8_scale"],
                                   s["scale_inv"], fmax=448.0)
    else:
        ampc.ops.adam_master(s["params"], s["grads"], s["m"], s["v"], s["steps"], lr=1e-2,
                             masters=s["masters"], inv_scale=s["inv_scale"], stochastic=True, seed=4)

torch.cuda.synchronize()
graph = torch.cuda.CUDAGraph()
with torch.cuda.graph(graph):          # no ampc call has run in this process before
    out = run(dev)
graph.replay()
torch.cuda.synchronize()
want = run(cpu)
if out is not None:
    assert abs(out.item() - want.item()) <= 1e-5 * want.item(), (out.item(), want.item())
for k, v in cpu.items():
    for a, b in zip(v if isinstance(v, list) else [v], dev[k] if isinstance(v, list) else [dev[k]]):
        ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[a.element_size()]
        same = a.view(ints) == b.cpu().view(ints)
        assert bool(same.all()), f"{op}: {k} differs from the CPU"
print("ok")
"""


@pytest.mark.parametrize("op", ["cast", "unscale_check", "check_norm", "update_scale",
                                "adam_master", "cast_fp8", "fp8_update_scales"])
def test_first_call_ever_is_a_graph_capture_cuda(op):
    # the first launch of a kernel loads its module (lazy loading), the first check_norm
    # takes scratch from the allocator: both must work while a stream captures
    out = subprocess.run([sys.executable, "-c", FIRST_CAPTURE, op], capture_output=True,
                         text=True, timeout=300, cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT))
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]


# ---- stream ordering ----

def test_each_op_waits_for_its_producer_on_a_side_stream_cuda():
    # each op runs on torch's current stream: queued behind a long sleep and the copy that
    # produces its input, it must see the input, with no sync anywhere
    gen = torch.Generator().manual_seed(5)
    n = 3 * CHUNK + 7
    staged = torch.randn(n, generator=gen).cuda()
    staged_inf = torch.ones(1, device="cuda")
    x = torch.zeros(n, device="cuda")
    out = torch.empty(n, dtype=bf16, device="cuda")
    found_inf = torch.zeros(1, device="cuda")
    produced_inf = torch.zeros(1, device="cuda")
    inv = torch.full((1,), 0.25, device="cuda")
    scale = torch.full((1,), 1024.0, device="cuda")
    tracker = torch.zeros(1, dtype=torch.int32, device="cuda")
    p, m, v = torch.zeros(n, device="cuda"), torch.zeros(n, device="cuda"), torch.zeros(n, device="cuda")
    step = torch.zeros(1, device="cuda")
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.cuda._sleep(200_000_000)      # long enough that an op on another stream runs first
        x.copy_(staged)
        produced_inf.copy_(staged_inf)
        ampc.ops.cast_([out], [x])
        norm = ampc.ops.unscale_check([x], found_inf, inv, check_only=True)
        ampc.ops.adam_master([p], [x], [m], [v], [step], lr=0.1)
        ampc.ops.unscale_check([x], found_inf, inv)
        ampc.ops.update_scale(scale, tracker, produced_inf, 2.0, 0.5, 100)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    cpu = staged.cpu()
    assert_bits(out, cpu.to(bf16), "cast after the producer")
    want_norm = 0.25 * math.sqrt(float((cpu.double() ** 2).sum()))
    assert abs(norm.item() - want_norm) <= 1e-5 * want_norm
    assert step.item() == 1.0 and bool((p != 0).any())
    assert_bits(x, cpu * 0.25, "unscale after the producer")
    assert scale.item() == 512.0, "update_scale read found_inf before it was produced"


# ---- devices and threads ----

def test_ops_from_a_fresh_thread_cuda():
    src = torch.randn(CHUNK + 1).cuda()
    result, errors = {}, []

    def worker():
        try:
            (result["out"],) = ampc.ops.cast([src], f16)
            result["norm"] = ampc.ops.unscale_check([src], torch.zeros(1, device="cuda"),
                                                    torch.ones(1, device="cuda"), check_only=True)
            result["device"] = torch.cuda.current_device()
        except Exception as e:      # noqa: BLE001  (reported below)
            errors.append(e)

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert not errors, errors
    assert_bits(result["out"], src.to(f16), "cast from a fresh thread")
    want = math.sqrt(float((src.double() ** 2).sum()))
    assert abs(result["norm"].item() - want) <= 1e-5 * want
    assert result["device"] == src.device.index


NO_GPU0_CONTEXT = r"""
import threading, ctypes, torch, ampc
cuda = ctypes.CDLL("libcuda.so.1")
def gpu0_context_active():
    flags, active = ctypes.c_uint(), ctypes.c_int()
    assert cuda.cuDevicePrimaryCtxGetState(0, ctypes.byref(flags), ctypes.byref(active)) == 0
    return bool(active.value)
torch.cuda.init()
def work():
    x = torch.randn(100000, device="cuda:1")
    torch.cuda.synchronize(1)
    before = gpu0_context_active()
    (y,) = ampc.ops.cast([x], torch.bfloat16)
    ampc.ops.unscale_check([y], torch.zeros(1, device="cuda:1"), torch.ones(1, device="cuda:1"),
                           check_only=True)
    torch.cuda.synchronize(1)
    print("torch made it" if before else ("made" if gpu0_context_active() else "none"))
t = threading.Thread(target=work); t.start(); t.join()
"""


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_ops_on_another_device_create_no_context_on_gpu0_cuda():
    out = subprocess.run([sys.executable, "-c", NO_GPU0_CONTEXT], capture_output=True,
                         text=True, timeout=300, cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT))
    assert out.returncode == 0, out.stderr[-3000:]
    if out.stdout.strip() == "torch made it":
        pytest.skip("torch itself created a context on GPU 0 before ampc ran")
    assert out.stdout.strip() == "none", "ampc created a context on GPU 0"


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_check_norm_on_a_non_current_device_cuda():
    # the scratch of the partial sums must be on the grads' device, not the current one
    with torch.cuda.device(0):
        grads = [torch.randn(n).to("cuda:1") for n in (5 * CHUNK + 3, 17)]
        found_inf = torch.zeros(1, device="cuda:1")
        norm = ampc.ops.unscale_check(grads, found_inf, torch.full((1,), 2.0, device="cuda:1"),
                                      check_only=True)
        assert torch.cuda.current_device() == 0
    want = 2.0 * math.sqrt(sum(float((g.double() ** 2).sum()) for g in grads))
    assert norm.device == grads[0].device and abs(norm.item() - want) <= 1e-5 * want


# ---- launches split over several tables ----

@pytest.mark.parametrize("dtype", [f32, f16, bf16], ids=["fp32", "fp16", "bf16"])
def test_inf_only_in_the_second_launch_cuda(dtype):
    # more tensors than one launch's table holds: the inf sits in a tensor of the second
    n = MAX_TENSORS + 60
    grads = [torch.randn(10 + i).to(dtype).cuda() for i in range(n)]
    grads[MAX_TENSORS + 30][3] = float("inf")
    found_inf = torch.zeros(1, device="cuda")
    norm_found = torch.zeros(1, device="cuda")
    norm = ampc.ops.unscale_check(grads, norm_found, torch.ones(1, device="cuda"), check_only=True)
    assert norm_found.item() == 1.0 and math.isinf(norm.item())
    finite = [g.clone() for g in grads]
    finite[MAX_TENSORS + 30][3] = 1.0
    clean_found = torch.zeros(1, device="cuda")
    clean_norm = ampc.ops.unscale_check(finite, clean_found, torch.ones(1, device="cuda"),
                                        check_only=True)
    want = math.sqrt(sum(float((g.double() ** 2).sum()) for g in finite))
    assert clean_found.item() == 0.0 and abs(clean_norm.item() - want) <= 1e-5 * want
    ref = [g.clone() for g in grads]
    ref_found = torch.zeros(1, device="cuda")
    inv = torch.full((1,), 0.5, device="cuda")
    ampc.ops.unscale_check(grads, found_inf, inv)
    torch._amp_foreach_non_finite_check_and_unscale_(ref, ref_found, inv)
    assert found_inf.item() == ref_found.item() == 1.0
    for i, (g, r) in enumerate(zip(grads, ref)):
        assert_bits(g, r, f"unscale tensor {i}")


# ---- Adam's per-tensor constants over many step counts ----

@pytest.mark.parametrize("betas", [(0.9, 0.999), (0.5, 0.95), (0.0, 0.99999), (0.99, 0.9999)],
                         ids=str)
def test_adam_constants_match_cpu_over_steps_to_100k_cuda(betas):
    # one 9-element param per step count: every count 0..1999, then every 97th to 100k;
    # the constants come from pow() in double on each side, which may differ in the last
    # bit (test_adam_cuda.py's docstring): this is where such a difference would show
    counts = list(range(2000)) + list(range(2000, 100001, 97))
    gen = torch.Generator().manual_seed(8)
    state = {k: [torch.randn(9, generator=gen) * s for _ in counts]
             for k, s in (("p", 1.0), ("g", 1.0), ("m", 1e-2))}
    state["v"] = [torch.rand(9, generator=gen) * 1e-4 for _ in counts]
    state["step"] = [torch.full((1,), float(c)) for c in counts]
    on = {dev: {k: [t.to(dev) for t in ts] for k, ts in state.items()} for dev in ("cpu", "cuda")}
    for s in on.values():
        ampc.ops.adam_master(s["p"], s["g"], s["m"], s["v"], s["step"], lr=1e-3, beta1=betas[0],
                             beta2=betas[1], weight_decay=0.01)
    for k in ("p", "m", "v", "step"):
        for i, (a, b) in enumerate(zip(on["cuda"][k], on["cpu"][k])):
            assert_bits(a, b, f"{k} at step count {counts[i]}")


# ---- a training step without a host sync ----

def test_adamw_gradscaler_clip_without_a_sync_cuda():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(),
                                torch.nn.Linear(64, 8)).cuda().to(bf16)
    opt = ampc.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = ampc.GradScaler("cuda")
    x = torch.randn(32, 64, device="cuda", dtype=bf16)

    def step():
        loss = model(x).float().pow(2).mean()
        scaler.scale(loss).backward()
        scaler.clip_grad_norm_(opt, 1.0)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=False)

    step()                                  # creates the state (allocations, no syncs either)
    torch.cuda.synchronize()
    before = [p.detach().clone() for p in model.parameters()]
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert any(not torch.equal(b, p.detach()) for b, p in zip(before, model.parameters()))
    assert all(opt.state[p]["step"].item() == 4.0 for p in model.parameters())


# ---- views that start off a 16-byte boundary ----

@pytest.mark.parametrize("dtype", [f32, f16, bf16], ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("offset", [1, 3, 7])
def test_misaligned_views_take_a_scalar_head_cuda(dtype, offset):
    # grads as views into one flat buffer, each starting `offset` elements past a 16-byte
    # boundary: the kernels handle the head one element a thread and vectorize the rest;
    # results must equal torch's and the CPU's whatever the split
    sizes = [offset + 1, 8 * 1000 + 5, 3 * CHUNK + 11, 2]
    flat = torch.randn(sum(sizes) + (8 + offset) * len(sizes)).to(dtype).cuda()
    views, at = [], offset
    for n in sizes:
        views.append(flat[at:at + n])
        at = (at + n + 7) // 8 * 8 + offset     # the next starts `offset` past a boundary
    assert all(v.data_ptr() % 16 != 0 for v in views)
    ref = [v.clone() for v in views]
    found, ref_found = torch.zeros(1, device="cuda"), torch.zeros(1, device="cuda")
    inv = torch.full((1,), 0.125, device="cuda")
    norm = ampc.ops.check_norm(views, found, inv)
    want = 0.125 * math.sqrt(sum(float((r.double() ** 2).sum()) for r in ref))
    assert abs(norm.item() - want) <= 1e-5 * want and found.item() == 0.0
    ampc.ops.unscale_check(views, found, inv)
    torch._amp_foreach_non_finite_check_and_unscale_(ref, ref_found, inv)
    for i, (v, r) in enumerate(zip(views, ref)):
        assert_bits(v, r, f"unscale view {i}")
    copies = [torch.empty_like(v) for v in views]
    ampc.ops.cast_(copies, views)
    for i, (c, v) in enumerate(zip(copies, views)):
        assert_bits(c, v, f"same-dtype copy of view {i}")


# ---- lists that mix dtypes: one group per dtype pair, in the binding ----

def test_mixed_dtype_lists_match_cpu_cuda():
    gen = torch.Generator().manual_seed(12)
    src = [torch.randn(n, generator=gen).to(dt) for n, dt in
           ((CHUNK + 3, f32), (100, f16), (7, f32), (4 * CHUNK, bf16))]
    dst_dtypes = [bf16, f32, f16, bf16]
    outs = {}
    for dev in ("cpu", "cuda"):
        s = [t.to(dev) for t in src]
        d = [torch.empty(t.shape, dtype=dt, device=dev) for t, dt in zip(src, dst_dtypes)]
        ampc.ops.cast_(d, s, stochastic=True, seed=21)
        found = torch.zeros(1, device=dev)
        ampc.ops.unscale_check(s, found, torch.full((1,), 0.5, device=dev))
        outs[dev] = (d, s, found)
    for i in range(len(src)):
        assert_bits(outs["cuda"][0][i], outs["cpu"][0][i], f"mixed cast {i}")
        assert_bits(outs["cuda"][1][i], outs["cpu"][1][i], f"mixed unscale {i}")
    assert outs["cuda"][2].item() == outs["cpu"][2].item() == 0.0


# ---- casts between views misaligned differently (Note [misaligned views]) ----

def views_at(sizes, dtype, offset, seed=None):
    """Views into one flat CUDA buffer, each starting `offset` elements past a 16-byte
    boundary (random values when seeded)."""
    per16 = 16 // dtype.itemsize
    starts, at = [], 0
    for n in sizes:
        starts.append(at + offset)
        at += -(-(n + offset) // per16) * per16
    flat = torch.empty(at, dtype=dtype, device="cuda")
    if seed is not None:
        gen = torch.Generator().manual_seed(seed)
        flat.copy_(torch.randn(at, generator=gen) * 100)
    return [flat[a:a + n] for a, n in zip(starts, sizes)]


@pytest.mark.parametrize("src_dtype,dst_dtype", [(a, b) for a in (f32, f16, bf16)
                                                 for b in (f32, f16, bf16)],
                         ids=lambda d: str(d).replace("torch.", ""))
def test_every_misalignment_pair_matches_cpu_cuda(src_dtype, dst_dtype):
    # each source offset against each destination offset within 16 bytes: the kernel picks
    # 16-, 8-, 4-byte or element accesses from how the two differ; the bits must not care
    sizes = [CHUNK + 13, 1000, 37, 3]
    for s_off in range(16 // src_dtype.itemsize):
        src = views_at(sizes, src_dtype, s_off, seed=s_off)
        cpu_src = [s.cpu() for s in src]
        for d_off in range(16 // dst_dtype.itemsize):
            dst = views_at(sizes, dst_dtype, d_off)
            what = f"{src_dtype}->{dst_dtype} offsets {s_off}/{d_off}"
            ampc.ops.cast_(dst, src)
            for i, (d, s) in enumerate(zip(dst, cpu_src)):
                assert_bits(d, s.to(dst_dtype), f"{what} tensor {i} vs Tensor.to")
            if src_dtype.itemsize > dst_dtype.itemsize:
                ampc.ops.cast_(dst, src, stochastic=True, seed=5)
                cpu_dst = [torch.empty(n, dtype=dst_dtype) for n in sizes]
                ampc.ops.cast_(cpu_dst, cpu_src, stochastic=True, seed=5)
                for i, (d, c) in enumerate(zip(dst, cpu_dst)):
                    assert_bits(d, c, f"{what} tensor {i} stochastic vs CPU")
