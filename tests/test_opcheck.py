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


@pytest.mark.smoke
@pytest.mark.parametrize("op, samples", [
    ("cast", cast_samples),
    ("unscale_check", unscale_samples),
    ("check_norm", unscale_samples),
    ("update_scale", scale_samples),
    ("adam_master", adam_samples),
], ids=lambda x: x if isinstance(x, str) else "")
def test_opcheck(op, samples):
    for args in samples():
        torch.library.opcheck(getattr(torch.ops.ampc, op).default, args)


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
