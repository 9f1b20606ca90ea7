"""Bad input: every case raises an error that names the op and the argument, and
leaves every tensor it was given unchanged (the checks run before any write)."""
import re

import pytest
import torch

import ampc
from reference import assert_refused_unchanged

f32, f16, bf16 = torch.float32, torch.float16, torch.bfloat16


def scalar(value=0.0, dtype=f32):
    return torch.full((1,), value, dtype=dtype)


def raw_cast(src, dst):
    return lambda: torch.ops.ampc.cast(dst, src, [], False, 0)


def raw_unscale(grads, found_inf=None, inv_scale=None):
    found_inf = scalar() if found_inf is None else found_inf
    inv_scale = scalar(0.5) if inv_scale is None else inv_scale
    return lambda: torch.ops.ampc.unscale_check(grads, found_inf, inv_scale)


def raw_norm(grads, found_inf, inv_scale):
    return lambda: torch.ops.ampc.check_norm(grads, found_inf, inv_scale)


def raw_scale(scale=None, growth=None, hyst=None, found_inf=None, growth_factor=2.0,
              backoff_factor=0.5, growth_interval=10, hysteresis=1, min_scale=0.0,
              max_scale=float("inf")):
    scale = scalar(1024.0) if scale is None else scale
    growth = torch.zeros(1, dtype=torch.int32) if growth is None else growth
    hyst = torch.ones(1, dtype=torch.int32) if hyst is None else hyst
    found_inf = scalar(1.0) if found_inf is None else found_inf
    return lambda: torch.ops.ampc.update_scale(scale, growth, hyst, found_inf, growth_factor,
                                               backoff_factor, growth_interval, hysteresis,
                                               min_scale, max_scale)


def case_cast_src_dtype():
    src = [torch.randn(5), torch.randn(5, dtype=torch.float64)]
    dst = [torch.zeros(5, dtype=bf16), torch.zeros(5, dtype=bf16)]
    return raw_cast(src, dst), src + dst, RuntimeError, r"^ampc\.cast: src\[1\] must be torch\.float32, torch\.float16 or torch\.bfloat16, got torch\.float64"


def case_cast_dst_dtype():
    src = [torch.randn(5)]
    dst = [torch.zeros(5, dtype=torch.int32)]
    return raw_cast(src, dst), src + dst, RuntimeError, r"^ampc\.cast: dst\[0\] must be torch\.float32, torch\.float16 or torch\.bfloat16, got torch\.int32"


def case_cast_mixed_dtypes_alias_across_groups():
    # the pairs (fp32 -> fp16) and (fp32 -> bf16) run as two groups; an output of one
    # aliasing an input of the other is refused before either runs
    base = torch.randn(10)
    src = [torch.randn(10), base[:5]]
    dst = [base.view(f16)[:10], torch.zeros(5, dtype=bf16)]
    return raw_cast(src, dst), [base] + src[:1] + dst[1:], RuntimeError, r"^ampc\.cast: (dst\[0\] overlaps src\[1\]|src\[1\] overlaps dst\[0\]) in memory"


def case_cast_lengths():
    src = [torch.randn(5), torch.randn(6)]
    dst = [torch.zeros(5, dtype=bf16)]
    return raw_cast(src, dst), src + dst, RuntimeError, r"^ampc\.cast: dst must have as many tensors as src \(2\), got 1"


def case_cast_shapes():
    src = [torch.randn(2, 3)]
    dst = [torch.zeros(3, 2, dtype=bf16)]
    return raw_cast(src, dst), src + dst, RuntimeError, r"^ampc\.cast: dst\[0\] must have the shape of src\[0\]"


def case_cast_alias_dst_src():
    buf = torch.randn(10)
    src = [buf[:6]]
    dst = [buf[4:10]]
    return raw_cast(src, dst), [buf], RuntimeError, r"^ampc\.cast: (dst\[0\] overlaps src\[0\]|src\[0\] overlaps dst\[0\]|dst\[0\] overlaps src\[0\]) in memory"


def case_cast_alias_dst_dst():
    buf = torch.zeros(10, dtype=bf16)
    src = [torch.randn(6), torch.randn(6)]
    dst = [buf[:6], buf[4:]]
    return raw_cast(src, dst), src + [buf], RuntimeError, r"^ampc\.cast: dst\[[01]\] overlaps dst\[[01]\] in memory"


def case_cast_noncontiguous():
    src = [torch.randn(4, 6).t()]
    dst = [torch.zeros(6, 4, dtype=bf16)]
    return raw_cast(src, dst), src + dst, RuntimeError, r"^ampc\.cast: src\[0\] must be contiguous"


def case_cast_device():
    src = [torch.randn(4)]
    dst = [torch.zeros(4, dtype=bf16, device="meta")]
    # a meta tensor among CPU ones goes to the fake kernel, which must refuse it by name
    return raw_cast(src, dst), src, RuntimeError, r"^ampc\.cast: src\[0\] must be on meta like dst\[0\], got cpu"


def case_cast_non_tensor():
    src = [torch.randn(4), 3.0]
    return (lambda: ampc.ops.cast(src, bf16)), src[:1], TypeError, r"^ampc\.cast: tensors\[1\] must be a Tensor, got float"


def case_cast_bad_target():
    src = [torch.randn(4)]
    return (lambda: ampc.ops.cast(src, torch.float64)), src, TypeError, r"^ampc\.cast: dtype must be torch\.float32, torch\.float16 or torch\.bfloat16, got torch\.float64"


def case_cast_not_a_list():
    src = torch.randn(4)
    return (lambda: ampc.ops.cast(src, bf16)), [src], TypeError, r"^ampc\.cast: tensors must be a list or tuple of tensors, got Tensor"


def case_unscale_dtype():
    grads = [torch.randn(5), torch.randn(5).double()]
    return raw_unscale(grads), grads, RuntimeError, r"^ampc\.unscale_check: grads\[1\] must be torch\.float32, torch\.float16 or torch\.bfloat16, got torch\.float64"


def case_unscale_mixed_alias_across_groups():
    base = torch.randn(8)
    grads = [base[:4], base.view(f16)[:4]]
    return raw_unscale(grads), [base], RuntimeError, r"^ampc\.unscale_check: (grads\[1\] overlaps grads\[0\]|grads\[0\] overlaps grads\[1\]) in memory"


def case_unscale_found_inf_dtype():
    grads = [torch.randn(5)]
    found_inf = torch.zeros(1, dtype=torch.float64)
    return raw_unscale(grads, found_inf), grads + [found_inf], RuntimeError, r"^ampc\.unscale_check: found_inf must be a 1-element torch\.float32 tensor, got torch\.float64 with 1 elements"


def case_unscale_inv_scale_shape():
    grads = [torch.randn(5)]
    inv = torch.full((2,), 0.5)
    return raw_unscale(grads, None, inv), grads + [inv], RuntimeError, r"^ampc\.unscale_check: inv_scale must be a 1-element torch\.float32 tensor, got torch\.float32 with 2 elements"


def case_unscale_alias_grads():
    buf = torch.randn(10)
    grads = [buf[:6], buf[3:]]
    return raw_unscale(grads), [buf], RuntimeError, r"^ampc\.unscale_check: grads\[[01]\] overlaps grads\[[01]\] in memory"


def case_unscale_alias_found_inf():
    grads = [torch.randn(5)]
    found_inf = grads[0][2:3]
    return raw_unscale(grads, found_inf), grads, RuntimeError, r"^ampc\.unscale_check: (grads\[0\] overlaps found_inf|found_inf overlaps grads\[0\]) in memory"


def case_unscale_alias_inv_scale():
    grads = [torch.randn(5)]
    inv = grads[0][4:5]
    return raw_unscale(grads, None, inv), grads, RuntimeError, r"^ampc\.unscale_check: (grads\[0\] overlaps inv_scale|inv_scale overlaps grads\[0\]) in memory"


def case_unscale_noncontiguous():
    grads = [torch.randn(6, 4)[:, 1]]
    return raw_unscale(grads), grads, RuntimeError, r"^ampc\.unscale_check: grads\[0\] must be contiguous"


def case_unscale_non_tensor():
    grads = [torch.randn(5), None]
    return (lambda: ampc.ops.unscale_check(grads, scalar(), scalar(0.5))), grads[:1], TypeError, r"^ampc\.unscale_check: grads\[1\] must be a Tensor, got NoneType"


def case_unscale_found_inf_not_tensor():
    grads = [torch.randn(5)]
    return (lambda: ampc.ops.unscale_check(grads, 0.0, scalar(0.5))), grads, TypeError, r"^ampc\.unscale_check: found_inf must be a Tensor, got float"


def case_norm_found_inf_int():
    grads = [torch.randn(5)]
    found_inf = torch.zeros(1, dtype=torch.int32)
    return raw_norm(grads, found_inf, scalar(1.0)), grads + [found_inf], RuntimeError, r"^ampc\.check_norm: found_inf must be a 1-element torch\.float32 tensor, got torch\.int32"


def case_scale_dtype():
    scale = torch.full((1,), 4.0, dtype=torch.float64)
    return raw_scale(scale=scale), [scale], RuntimeError, r"^ampc\.update_scale: scale must be a 1-element torch\.float32 tensor, got torch\.float64"


def case_scale_tracker_dtype():
    growth = torch.zeros(1, dtype=torch.int64)
    return raw_scale(growth=growth), [growth], RuntimeError, r"^ampc\.update_scale: growth_tracker must be a 1-element torch\.int32 tensor, got torch\.int64"


def case_scale_hysteresis_tracker_missing():
    # the wrappers pass an empty tracker for none: the kernel says it needs one
    scale = scalar(8.0)
    hyst = torch.empty(0, dtype=torch.int32)
    return raw_scale(scale=scale, hyst=hyst, hysteresis=2), [scale], RuntimeError, r"^ampc\.update_scale: hysteresis_tracker is required when hysteresis > 1, got hysteresis=2$"


def case_scale_hysteresis_tracker_shape():
    scale = scalar(8.0)
    hyst = torch.ones(2, dtype=torch.int32)
    return raw_scale(scale=scale, hyst=hyst, hysteresis=2), [scale, hyst], RuntimeError, r"^ampc\.update_scale: hysteresis_tracker must be a 1-element torch\.int32 tensor, got torch\.int32 with 2 elements"


def case_scale_interval():
    scale = scalar(8.0)
    return raw_scale(scale=scale, growth_interval=0), [scale], RuntimeError, r"^ampc\.update_scale: growth_interval must be in \[1, 2\^31\), got 0"


def case_scale_backoff():
    scale = scalar(8.0)
    return raw_scale(scale=scale, backoff_factor=float("nan")), [scale], RuntimeError, r"^ampc\.update_scale: backoff_factor must be a positive finite number, got nan"


def case_scale_bounds():
    scale = scalar(8.0)
    return raw_scale(scale=scale, min_scale=4.0, max_scale=2.0), [scale], RuntimeError, r"^ampc\.update_scale: min_scale and max_scale must satisfy 0 <= min_scale <= max_scale, got 4 and 2"


def case_scale_max_zero():
    scale = scalar(8.0)
    return raw_scale(scale=scale, min_scale=0.0, max_scale=0.0), [scale], RuntimeError, r"^ampc\.update_scale: max_scale must be > 0, got 0$"


def case_scale_alias():
    scale = scalar(8.0)
    return raw_scale(scale=scale, found_inf=scale), [scale], RuntimeError, r"^ampc\.update_scale: (scale overlaps found_inf|found_inf overlaps scale) in memory"


def case_scale_hysteresis_needs_tracker():
    scale = scalar(8.0)
    growth = torch.zeros(1, dtype=torch.int32)
    call = lambda: ampc.ops.update_scale(scale, growth, scalar(1.0), 2.0, 0.5, 10, hysteresis=3)
    return call, [scale, growth], RuntimeError, r"^ampc\.update_scale: hysteresis_tracker is required when hysteresis > 1, got hysteresis=3$"


CASES = {name[5:]: fn for name, fn in globals().items() if name.startswith("case_")}


@pytest.mark.smoke
@pytest.mark.parametrize("name", sorted(CASES))
def test_bad_input_raises_and_changes_nothing(name):
    assert_refused_unchanged(name, *CASES[name]())


def test_error_is_one_line_without_cpp_backtrace():
    src = [torch.randn(3).double()]
    with pytest.raises(RuntimeError) as info:
        torch.ops.ampc.cast([torch.zeros(3, dtype=bf16)], src, [], False, 0)
    assert "\n" not in str(info.value).strip()
    assert str(info.value).startswith("ampc.cast: src[0]")


def test_schema_rejects_non_tensor_in_raw_op():
    with pytest.raises((TypeError, RuntimeError), match=r"ampc::cast|src"):
        torch.ops.ampc.cast([torch.zeros(3), torch.zeros(1)], [torch.randn(3), 1.0], [], False, 0)


def test_failed_call_leaks_no_tensor():
    # the kernel owns every handle it receives, on the error path too
    src = torch.randn(1000)
    import sys
    refs = sys.getrefcount(src)
    for _ in range(100):
        with pytest.raises(RuntimeError):
            torch.ops.ampc.cast([torch.zeros(999, dtype=bf16)], [src], [], False, 0)
    assert sys.getrefcount(src) == refs
    import weakref
    dst = torch.zeros(1000, dtype=bf16)
    ref = weakref.ref(dst)
    with pytest.raises(RuntimeError):
        torch.ops.ampc.cast([dst], [src.double()], [], False, 0)
    del dst
    assert ref() is None


def test_mutated_tensors_get_new_versions():
    # autograd and cached casts rely on version counters to see in-place writes
    x = torch.randn(8)
    dst = torch.empty(8, dtype=bf16)
    found_inf, inv = torch.zeros(1), torch.ones(1)
    scale, growth = torch.ones(1), torch.zeros(1, dtype=torch.int32)
    ampc.ops.cast_([dst], [x])
    assert (dst._version, x._version) == (1, 0)
    ampc.ops.unscale_check([x], found_inf, inv)
    assert (x._version, found_inf._version, inv._version) == (1, 1, 0)
    ampc.ops.unscale_check([x], found_inf, inv, check_only=True)
    assert (x._version, found_inf._version) == (1, 2)
    ampc.ops.update_scale(scale, growth, found_inf, 2.0, 0.5, 1)
    assert (scale._version, growth._version, found_inf._version) == (1, 1, 2)


def test_direct_op_calls_and_modes_bump_versions_once():
    # the wrappers do the guard's work themselves and enter the op below the dispatcher's
    # guard; direct torch.ops calls and calls under a dispatch mode go through the guard:
    # every way bumps each written tensor once and refuses tensors that require grad
    from torch.utils._python_dispatch import TorchDispatchMode

    class PassThrough(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    def call(way, x, found_inf, inv):
        if way == "torch.ops":
            torch.ops.ampc.unscale_check([x], found_inf, inv)
        elif way == "mode":
            with PassThrough():
                ampc.ops.unscale_check([x], found_inf, inv)
        else:
            ampc.ops.unscale_check([x], found_inf, inv)

    for way in ("wrapper", "torch.ops", "mode"):
        x, found_inf, inv = torch.randn(8), torch.zeros(1), torch.ones(1)
        call(way, x, found_inf, inv)
        assert (x._version, found_inf._version, inv._version) == (1, 1, 0), way
        y = torch.randn(3, requires_grad=True) * 2
        with pytest.raises(RuntimeError, match=r"^ampc\.unscale_check: grads\[0\] requires grad"):
            call(way, y, found_inf, inv)
        assert y._version == 0, way


def test_overlap_check_over_many_tensors_in_any_address_order():
    # the check sorts the ranges by merging the runs already in address order: lists
    # sorted, reversed, interleaved and shuffled, with one overlap planted anywhere or none
    gen = torch.Generator().manual_seed(21)
    buf = torch.zeros(64 * 400, dtype=bf16)
    slots = [buf[64 * i:64 * i + 48] for i in range(400)]
    orders = {"sorted": list(range(400)), "reversed": list(range(399, -1, -1)),
              "interleaved": [i for k in range(4) for i in range(k, 400, 4)],
              "shuffled": torch.randperm(400, generator=gen).tolist()}
    for name, order in orders.items():
        views = [slots[i] for i in order]
        src, dst = views[:200], views[200:]
        ampc.ops.cast_(dst, [s.float() for s in src])          # no overlap: runs
        with pytest.raises(RuntimeError, match="overlaps"):
            # a source that starts inside a destination
            ampc.ops.cast_(dst, src[:199] + [buf[64 * order[350] + 10:][:48]])
        k = int(torch.randint(0, 200, (1,), generator=gen))
        j = (k + 57) % 200                  # dst[k] moved onto part of dst[j]
        shifted = dst[:k] + [buf[64 * order[200 + j] + 8:][:48]] + dst[k + 1:]
        with pytest.raises(RuntimeError, match=r"dst\[\d+\] overlaps"):
            ampc.ops.cast_(shifted, [torch.zeros(48) for _ in range(200)])


def test_in_place_write_to_a_tensor_saved_for_backward_is_caught():
    w = torch.randn(4, requires_grad=True)
    x = torch.randn(4)
    y = (w * x).sum()          # saves x for the gradient of w
    ampc.ops.unscale_check([x], torch.zeros(1), torch.full((1,), 2.0))
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.backward()


def test_tensors_that_require_grad_are_refused_in_grad_mode():
    # the ops record nothing for autograd: gradients through them would be silently wrong
    x = torch.randn(3, requires_grad=True)
    y = x * 2
    before = y.detach().clone()
    with pytest.raises(RuntimeError, match=r"^ampc\.unscale_check: grads\[0\] requires grad"):
        ampc.ops.unscale_check([y], torch.zeros(1), torch.full((1,), 2.0))
    assert torch.equal(y.detach(), before) and y._version == 0
    with pytest.raises(RuntimeError, match=r"^ampc\.cast: src\[1\] requires grad"):
        ampc.ops.cast([torch.randn(3), x], bf16)
    with pytest.raises(RuntimeError, match=r"^ampc\.cast: dst\[0\] requires grad"):
        ampc.ops.cast_([torch.zeros(3, requires_grad=True)], [torch.randn(3)])
    # under no_grad, as optimizers and scalers run, they work on such tensors
    with torch.no_grad():
        ampc.ops.unscale_check([x], torch.zeros(1), torch.full((1,), 2.0))
        (low,) = ampc.ops.cast([x], bf16)
    assert torch.equal(low, (x.detach()).to(bf16))


# ---- tensors with elements and no data ----
# FSDP frees a parameter's storage between uses (storage resized to 0, sizes kept): the
# kernels would read or write through a null pointer. Every tensor argument of every op is
# refused by name, before anything is written.

def op_arguments(op):
    """A valid call of torch.ops.ampc.<op> on the CPU, as its argument list."""
    r = lambda dt=f32: torch.randn(37).to(dt)                   # noqa: E731
    one = lambda v, dt=f32: torch.full((1,), v, dtype=dt)       # noqa: E731
    if op == "cast":
        return [[torch.zeros(37, dtype=bf16)], [r()], [torch.tensor([3])], True, 0]
    if op in ("unscale_check", "check_norm"):
        return [[r(), r()], one(0.0), one(0.5)]
    if op == "update_scale":
        return [one(1024.0), one(0, torch.int32), one(2, torch.int32), one(0.0), 2.0, 0.5, 10,
                2, 0.0, float("inf")]
    e4m3 = lambda: torch.zeros(37, dtype=torch.float8_e4m3fn)     # noqa: E731
    if op == "cast_fp8":
        return [[e4m3(), e4m3()], [r(), r(bf16)], torch.ones(2), torch.zeros(2)]
    if op == "fp8_amax":
        return [[r(), r(f16)], torch.zeros(2)]
    if op == "cast_from_fp8":
        return [[r(), r(bf16)], [e4m3(), e4m3()], torch.ones(2)]
    if op == "fp8_update_scales":
        return [torch.zeros(3, 2), torch.ones(2), torch.ones(2), torch.ones(2), 448.0, 0.0, False]
    assert op == "adam_master"
    return [[r(bf16)], [r(bf16)], [r()], [r()], [r().abs()], [r().abs()], [one(2.0)],
            [one(1e-3)], [one(1.0)], [one(1.0)], [one(0.0)], 1e-3, 0.9, 0.999, 1e-8, 0.01,
            True, False, True, 7]


def tensor_arguments(op):
    """(position, index in its list or None, label in messages) of every tensor argument."""
    schema = getattr(torch.ops.ampc, op).default._schema
    options = {"seed_tensor", "lr_tensor", "inv_scale", "clip_coef", "found_inf"}
    out = []
    for pos, value in enumerate(op_arguments(op)):
        name = schema.arguments[pos].name
        if isinstance(value, torch.Tensor):
            out.append((pos, None, name))
        elif isinstance(value, list):
            for i in range(len(value)):
                single = isinstance(schema.arguments[pos].type, torch.ListType) and name in options
                out.append((pos, i, name if single else f"{name}[{i}]"))
    return out


FREED_CASES = [(op, pos, i, label)
               for op in ("cast", "unscale_check", "check_norm", "update_scale", "adam_master",
                          "cast_fp8", "fp8_amax", "cast_from_fp8", "fp8_update_scales")
               for pos, i, label in tensor_arguments(op)]


@pytest.mark.parametrize("op, pos, index, label", FREED_CASES,
                         ids=[f"{c[0]}-{c[3]}" for c in FREED_CASES])
def test_tensor_without_data_refused_by_name(op, pos, index, label):
    args = op_arguments(op)
    victim = args[pos] if index is None else args[pos][index]
    numel = victim.numel()
    victim.untyped_storage().resize_(0)
    assert victim.numel() == numel and victim.data_ptr() == 0
    others = [t for a in args for t in (a if isinstance(a, list) else [a])
              if isinstance(t, torch.Tensor) and t is not victim]
    pattern = (rf"^ampc\.{op}: {re.escape(label)} has {numel} elements and no data "
               r"\(its storage was freed or resized to 0\)")
    call = lambda: getattr(torch.ops.ampc, op)(*args)       # noqa: E731
    assert_refused_unchanged(f"{op} {label} freed", call, others, RuntimeError, pattern)


def test_freed_storage_refused_through_the_wrappers():
    w = torch.randn(10)
    w.untyped_storage().resize_(0)
    with pytest.raises(RuntimeError, match=r"^ampc\.cast: src\[0\] has 10 elements and no data"):
        ampc.ops.cast([w], bf16)
    with pytest.raises(RuntimeError, match=r"^ampc\.unscale_check: grads\[0\] has 10 elements"):
        ampc.ops.unscale_check([w], torch.zeros(1), torch.ones(1))
    # an emptied tensor whose sizes are 0 too has nothing to read: fine
    empty = torch.randn(0)
    empty.untyped_storage().resize_(0)
    assert ampc.ops.cast([empty], bf16)[0].numel() == 0


def test_mixed_dtype_lists_run_in_one_call():
    # the raw list ops take lists that mix dtypes: one group of positions per dtype pair
    # (check_norm's norms of the groups then make one norm, on the device)
    src = [torch.randn(7), torch.randn(9).half(), torch.randn(3), torch.randn(4).to(bf16)]
    dst = [torch.empty(7, dtype=bf16), torch.empty(9), torch.empty(3, dtype=f16),
           torch.empty(4, dtype=bf16)]
    torch.ops.ampc.cast(dst, src, [], False, 0)
    for d, s in zip(dst, src):
        assert torch.equal(d, s.to(d.dtype))
    grads = [torch.randn(7), torch.randn(9).half(), torch.randn(3).to(bf16), torch.randn(2)]
    found = torch.zeros(1)
    norm = torch.ops.ampc.check_norm(grads, found, scalar(0.5))
    expected = 0.5 * torch.cat([g.double() for g in grads]).norm()
    assert found.item() == 0.0 and norm.shape == () and norm.dtype == f32
    assert abs(norm.item() - expected.item()) <= 1e-6 * expected.item()
    grads[2][1] = float("inf")
    ref = [g.clone() for g in grads]
    found = torch.zeros(1)
    assert torch.ops.ampc.check_norm(grads, found, scalar(0.5)).isinf()
    assert found.item() == 1.0
    found.zero_()
    torch.ops.ampc.unscale_check(grads, found, scalar(0.5))
    assert found.item() == 1.0
    for g, r in zip(grads, ref):
        assert torch.equal(g, (r.float() * 0.5).to(r.dtype))
