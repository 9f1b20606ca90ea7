"""torch.library.opcheck on every op (schema, fake kernel, aot dispatch), and
torch.compile tracing the ops in one graph with results equal to eager."""
import pytest
import torch

import ampc

f32, f16, bf16 = torch.float32, torch.float16, torch.bfloat16


def cast_samples():
    for s, d in [(f32, bf16), (f32, f16), (bf16, f32), (f16, bf16)]:
        src = [torch.randn(17).to(s), torch.randn(3, 5).to(s), torch.randn(0).to(s)]
        yield ([torch.empty(t.shape, dtype=d) for t in src], src, [], False, 0)
    src = [torch.randn(33)]
    yield ([torch.empty(33, dtype=bf16)], src, [], True, 7)
    yield ([torch.empty(33, dtype=bf16)], src, [torch.tensor([7])], True, 0)


def unscale_samples():
    for dt in (f32, f16, bf16):
        grads = [torch.randn(19).to(dt), torch.randn(2, 8).to(dt)]
        yield (grads, torch.zeros(1), torch.full((1,), 0.25))
    grads = [torch.tensor([1.0, float("inf")])]
    yield (grads, torch.zeros(1), torch.full((1,), 0.5))


def scale_samples():
    for found in (0.0, 1.0):
        yield (torch.full((1,), 1024.0), torch.zeros(1, dtype=torch.int32),
               torch.full((1,), 2, dtype=torch.int32), torch.full((1,), found),
               2.0, 0.5, 1, 2, 1.0, 2.0 ** 24)


def adam_samples():
    for pt, master, ams in [(f32, False, False), (bf16, True, True), (f16, True, False)]:
        sizes = [17, 40]
        yield ([torch.randn(n).to(pt) for n in sizes], [torch.randn(n).to(pt) for n in sizes],
               [torch.randn(n) for n in sizes] if master else [],
               [torch.zeros(n) for n in sizes], [torch.zeros(n) for n in sizes],
               [torch.zeros(n) for n in sizes] if ams else [],
               [torch.zeros(1) for _ in sizes], [torch.full((1,), 1e-3)], [torch.ones(1)],
               [torch.full((1,), 0.5)], [torch.zeros(1)], 0.0, 0.9, 0.999, 1e-8, 0.01, True,
               False, master, 3)


def adam_lean_samples():
    sizes = [17, 300]
    for weights, mdt in [("sr", torch.uint8), ("kahan", bf16), ("master", f32)]:
        q8 = mdt == torch.uint8
        yield ([torch.randn(n).to(bf16) for n in sizes], [torch.randn(n).to(bf16) for n in sizes],
               [torch.randn(n) for n in sizes] if weights == "master" else [],
               [torch.zeros(n, dtype=bf16) for n in sizes] if weights == "kahan" else [],
               [torch.zeros(n, dtype=mdt) for n in sizes], [torch.zeros(n, dtype=mdt) for n in sizes],
               [torch.zeros(-(-n // 256)) for n in sizes] if q8 else [],
               [torch.zeros(-(-n // 256)) for n in sizes] if q8 else [],
               [torch.zeros(1) for _ in sizes], [torch.full((1,), 1e-3)], [torch.ones(1)],
               [torch.full((1,), 0.5)], [torch.zeros(1)], 0.0, 0.9, 0.999, 1e-8, 0.01, True,
               False, weights == "sr", 3)


def encode_q8_samples():
    for dt in (f32, bf16, f16):
        src = [torch.randn(300).to(dt), torch.randn(2, 9).to(dt)]
        yield ([torch.empty(t.shape, dtype=torch.uint8) for t in src],
               [torch.empty(-(-t.numel() // 256)) for t in src], src)


def decode_q8_samples():
    for dt in (f32, bf16, f16):
        codes = [torch.randint(0, 256, (300,), dtype=torch.uint8), torch.zeros(2, 9, dtype=torch.uint8)]
        yield ([torch.empty(c.shape, dtype=dt) for c in codes], codes, [torch.rand(2), torch.rand(1)])


e4m3, e5m2 = torch.float8_e4m3fn, torch.float8_e5m2


def cast_fp8_samples():
    for s, d in [(f32, e4m3), (bf16, e5m2), (f16, e4m3)]:
        src = [torch.randn(17).to(s) * 100, torch.randn(3, 5).to(s), torch.randn(0).to(s)]
        yield ([torch.empty(t.shape, dtype=d) for t in src], src, torch.tensor([0.5, 2.0, 1.0]),
               torch.empty(3))
    src = [torch.randn(9), torch.randn(4).to(bf16)]      # mixed dtypes
    yield ([torch.empty(9, dtype=e5m2), torch.empty(4, dtype=e4m3)], src, torch.ones(2),
           torch.empty(2))


def fp8_amax_samples():
    for s in (f32, f16, bf16):
        yield ([torch.randn(17).to(s), torch.randn(0).to(s), torch.randn(2, 9).to(s)],
               torch.empty(3))


def cast_from_fp8_samples():
    for s, d in [(e4m3, f32), (e5m2, bf16), (e4m3, f16)]:
        src = [torch.randn(17).to(s), torch.randn(3, 5).to(s)]
        yield ([torch.empty(t.shape, dtype=d) for t in src], src, torch.tensor([0.5, 4.0]))


def fp8_scaling_samples():
    for most_recent in (False, True):
        yield (torch.rand(4, 3), torch.ones(3), torch.ones(3), torch.tensor([2.0, 0.0, 1e3]),
               448.0, 1.0, most_recent)


@pytest.mark.smoke
@pytest.mark.parametrize("op, samples", [
    ("fp8_amax", fp8_amax_samples),
    ("fp8_update_scales", fp8_scaling_samples),
    ("cast", cast_samples),
    ("unscale_check", unscale_samples),
    ("check_norm", unscale_samples),
    ("update_scale", scale_samples),
    ("adam_master", adam_samples),
    ("adam_lean", adam_lean_samples),
    ("encode_q8", encode_q8_samples),
    ("decode_q8", decode_q8_samples),
], ids=lambda x: x if isinstance(x, str) else "")
def test_opcheck(op, samples):
    for args in samples():
        torch.library.opcheck(getattr(torch.ops.ampc, op).default, args)


def tensors_of(args):
    return [t for a in args for t in (a if isinstance(a, list) else [a])
            if isinstance(t, torch.Tensor)]


@pytest.mark.smoke
@pytest.mark.parametrize("op, samples", [
    ("cast_fp8", cast_fp8_samples),
    ("cast_from_fp8", cast_from_fp8_samples),
], ids=lambda x: x if isinstance(x, str) else "")
def test_opcheck_fp8_tensors(op, samples):
    # opcheck's schema test compares tensors with allclose, which torch has no fp8 kernel
    # for: the other tests run, and the schema's claim (which arguments are written) is
    # checked here bit for bit
    overload = getattr(torch.ops.ampc, op).default
    for args in samples():
        torch.library.opcheck(overload, args, test_utils=(
            "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic"))
        written = {id(t) for pos, a in enumerate(overload._schema.arguments)
                   if a.alias_info is not None and a.alias_info.is_write
                   for t in tensors_of([args[pos]])}
        read = [t for t in tensors_of(args) if id(t) not in written]
        before = [t.clone() for t in read]
        overload(*args)
        for b, t in zip(before, read):
            assert torch.equal(b.view(torch.uint8), t.view(torch.uint8)), f"{op} wrote an input"


def amp_step(grads, found_inf, inv_scale, scale, growth_tracker):
    """One sync-free scaler step: unscale and check, norm, scale update, cast."""
    ampc.ops.unscale_check(grads, found_inf, inv_scale)
    norm = ampc.ops.unscale_check(grads, found_inf, torch.ones_like(inv_scale), check_only=True)
    ampc.ops.update_scale(scale, growth_tracker, found_inf, 2.0, 0.5, 2)
    low = ampc.ops.cast(grads, bf16)
    return norm, low


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compile_matches_eager(backend):
    torch.manual_seed(0)
    grads = [torch.randn(1000), torch.randn(30, 7)]
    grads[1][3, 4] = float("inf")

    def state():
        return ([g.clone() for g in grads], torch.zeros(1), torch.full((1,), 0.125),
                torch.full((1,), 8.0), torch.zeros(1, dtype=torch.int32))

    eager_state = state()
    eager = amp_step(*eager_state)
    torch._dynamo.reset()
    compiled_state = state()
    compiled = torch.compile(amp_step, backend=backend, fullgraph=True)(*compiled_state)
    for a, b in zip(eager_state[0], compiled_state[0]):
        assert torch.equal(a, b)
    for a, b in zip(eager_state[1:], compiled_state[1:]):
        assert torch.equal(a, b), (a, b)
    assert compiled_state[1].item() == 1.0 and compiled_state[3].item() == 4.0
    assert torch.equal(eager[0], compiled[0])
    for a, b in zip(eager[1], compiled[1]):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))


def fp8_step(x, q, back, history, scale, scale_inv, amax):
    """Delayed scaling as a training step runs it: cast with amax, update, cast back."""
    ampc.ops.cast_fp8(q, x, scale, amax)
    ampc.ops.fp8_update_scales(history, amax, scale, scale_inv, fmax=448.0)
    ampc.ops.cast_from_fp8(back, q, scale_inv)
    return [b * 2 for b in back]


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_fp8_ops_compile_matches_eager(backend):
    torch.manual_seed(0)
    x = [torch.randn(100) * 30, torch.randn(7, 3).to(bf16)]

    def state():
        return (x, [torch.empty(t.shape, dtype=e4m3) for t in x],
                [torch.empty(t.shape) for t in x], torch.zeros(3, 2), torch.full((2,), 2.0),
                torch.full((2,), 0.5), torch.empty(2))

    eager_state = state()
    eager = fp8_step(*eager_state)
    torch._dynamo.reset()
    compiled_state = state()
    compiled = torch.compile(fp8_step, backend=backend, fullgraph=True)(*compiled_state)
    for a, b in zip(eager + eager_state[2] + list(eager_state[3:]),
                    compiled + compiled_state[2] + list(compiled_state[3:])):
        assert torch.equal(a, b)
    for a, b in zip(eager_state[1], compiled_state[1]):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    assert eager_state[4][0].item() != 2.0          # the scale moved: the update ran
