"""Bad input to the fp8 ops: every case raises an error that names the op and the argument,
and leaves every tensor it was given unchanged (the checks run before any write)."""
import pytest
import torch

import ampc
from reference import assert_refused_unchanged

f32, f16, bf16 = torch.float32, torch.float16, torch.bfloat16
e4m3, e5m2 = torch.float8_e4m3fn, torch.float8_e5m2


def fp8(n, dtype=e4m3):
    return torch.zeros(n, dtype=dtype)


def raw_cast_fp8(dst, src, scale=None, amax=None):
    scale = torch.ones(len(src)) if scale is None else scale
    amax = torch.full((len(src),), -1.0) if amax is None else amax
    return lambda: torch.ops.ampc.cast_fp8(dst, src, scale, amax), [scale, amax]


def cast_fp8_case(dst, src, pattern, scale=None, amax=None, exc=RuntimeError):
    call, values = raw_cast_fp8(dst, src, scale, amax)
    return call, src + dst + values, exc, r"^ampc\.cast_fp8: " + pattern


def case_cast_fp8_dst_dtype():
    return cast_fp8_case([fp8(5), torch.zeros(5, dtype=bf16)], [torch.randn(5)] * 2,
                         r"dst\[1\] must be torch\.float8_e4m3fn or torch\.float8_e5m2, got torch\.bfloat16")


def case_cast_fp8_src_dtype():
    return cast_fp8_case([fp8(5)], [torch.randn(5, dtype=torch.float64)],
                         r"src\[0\] must be torch\.float32, torch\.float16 or torch\.bfloat16, got torch\.float64")


def case_cast_fp8_src_fp8():
    return cast_fp8_case([fp8(5)], [fp8(5, e5m2)],
                         r"src\[0\] must be torch\.float32, torch\.float16 or torch\.bfloat16, got torch\.float8_e5m2")


def case_cast_fp8_lengths():
    return cast_fp8_case([fp8(5)], [torch.randn(5), torch.randn(3)],
                         r"dst must have as many tensors as src \(2\), got 1")


def case_cast_fp8_shapes():
    return cast_fp8_case([torch.zeros(3, 2, dtype=e4m3)], [torch.randn(2, 3)],
                         r"dst\[0\] must have the shape of src\[0\]")


def case_cast_fp8_scale_length():
    return cast_fp8_case([fp8(5)] * 2, [torch.randn(5)] * 2,
                         r"scale must be a 1-D torch\.float32 tensor of 2 values \(one per tensor of src\), got torch\.float32 with 1 dimensions and 3 elements",
                         scale=torch.ones(3))


def case_cast_fp8_scale_dtype():
    return cast_fp8_case([fp8(5)], [torch.randn(5)],
                         r"scale must be a 1-D torch\.float32 tensor of 1 values \(one per tensor of src\), got torch\.float16",
                         scale=torch.ones(1, dtype=f16))


def case_cast_fp8_amax_shape():
    return cast_fp8_case([fp8(5)] * 2, [torch.randn(5)] * 2,
                         r"amax must be a 1-D torch\.float32 tensor of 2 values \(one per tensor of src\), got torch\.float32 with 2 dimensions",
                         amax=torch.zeros(1, 2))


def case_cast_fp8_noncontiguous():
    return cast_fp8_case([torch.zeros(4, 3, dtype=e4m3)], [torch.randn(3, 4).t()],
                         r"src\[0\] must be contiguous")


def case_cast_fp8_noncontiguous_dst():
    return cast_fp8_case([torch.zeros(3, 4, dtype=e4m3).t()], [torch.randn(4, 3)],
                         r"dst\[0\] must be contiguous")


def case_cast_fp8_device():
    # a meta tensor among CPU ones goes to the fake kernel, which refuses it by name
    return cast_fp8_case([fp8(4)], [torch.randn(4)], r"scale must be on cpu like dst\[0\], got meta",
                         scale=torch.ones(1, device="meta"))


def case_cast_fp8_amax_aliases_scale():
    scale = torch.ones(2)
    return cast_fp8_case([fp8(3), fp8(3)], [torch.randn(3)] * 2,
                         r"(amax overlaps scale|scale overlaps amax) in memory", scale=scale,
                         amax=scale)


def case_cast_fp8_dst_aliases_src():
    buf = torch.randn(8)
    return cast_fp8_case([buf.view(e4m3)[:8]], [buf], r"(dst\[0\] overlaps src\[0\]|src\[0\] overlaps dst\[0\]) in memory")


def case_cast_fp8_dst_aliases_dst():
    out = fp8(8)
    return cast_fp8_case([out[:5], out[3:]], [torch.randn(5)] * 2,
                         r"dst\[\d\] overlaps dst\[\d\] in memory")


def case_cast_fp8_not_a_tensor():
    amax = torch.full((2,), -1.0)
    return (lambda: ampc.ops.cast_fp8([fp8(3), 1.0], [torch.randn(3)] * 2, torch.ones(2), amax),
            [amax], TypeError, r"^ampc\.cast_fp8: dst\[1\] must be a Tensor, got float")


def case_cast_fp8_scale_not_a_tensor():
    return (lambda: ampc.ops.cast_fp8([fp8(3)], [torch.randn(3)], 1.0, torch.zeros(1)), [],
            TypeError, r"^ampc\.cast_fp8: scale must be a Tensor, got float")


def case_fp8_amax_dtype():
    amax = torch.full((1,), 3.0)
    return (lambda: ampc.ops.fp8_amax([torch.zeros(3, dtype=torch.int32)], amax), [amax],
            RuntimeError, r"^ampc\.fp8_amax: src\[0\] must be torch\.float32, torch\.float16 or torch\.bfloat16, got torch\.int32")


def case_fp8_amax_length():
    amax = torch.full((3,), 3.0)
    return (lambda: ampc.ops.fp8_amax([torch.zeros(3)] * 2, amax), [amax], RuntimeError,
            r"^ampc\.fp8_amax: amax must be a 1-D torch\.float32 tensor of 2 values")


def case_fp8_amax_aliases_src():
    x = torch.randn(4)
    return (lambda: ampc.ops.fp8_amax([x], x[:1]), [x], RuntimeError,
            r"^ampc\.fp8_amax: (amax overlaps src\[0\]|src\[0\] overlaps amax) in memory")


def from_case(dst, src, pattern, scale_inv=None):
    scale_inv = torch.ones(len(src)) if scale_inv is None else scale_inv
    return (lambda: torch.ops.ampc.cast_from_fp8(dst, src, scale_inv), src + dst + [scale_inv],
            RuntimeError, r"^ampc\.cast_from_fp8: " + pattern)


def case_from_fp8_src_dtype():
    return from_case([torch.zeros(3)], [torch.zeros(3, dtype=bf16)],
                     r"src\[0\] must be torch\.float8_e4m3fn or torch\.float8_e5m2, got torch\.bfloat16")


def case_from_fp8_dst_dtype():
    return from_case([torch.zeros(3, dtype=e4m3)], [fp8(3)],
                     r"dst\[0\] must be torch\.float32, torch\.float16 or torch\.bfloat16, got torch\.float8_e4m3fn")


def case_from_fp8_shapes():
    return from_case([torch.zeros(4)], [fp8(3)], r"dst\[0\] must have the shape of src\[0\]")


def case_from_fp8_scale_inv():
    return from_case([torch.zeros(3)], [fp8(3)],
                     r"scale_inv must be a 1-D torch\.float32 tensor of 1 values .*got torch\.float32 with 2 dimensions",
                     scale_inv=torch.ones(1, 1))


def case_from_fp8_alias():
    buf = torch.zeros(4)
    return from_case([buf], [buf.view(e4m3)[:4]], r"(dst\[0\] overlaps src\[0\]|src\[0\] overlaps dst\[0\]) in memory")


def update(history=None, amax=None, scale=None, scale_inv=None, **kw):
    history = torch.zeros(4, 2) if history is None else history
    amax = torch.ones(2) if amax is None else amax
    scale = torch.ones(2) if scale is None else scale
    scale_inv = torch.ones(2) if scale_inv is None else scale_inv
    kw.setdefault("fmax", 448.0)
    call = lambda: ampc.ops.fp8_update_scales(history, amax, scale, scale_inv, **kw)  # noqa: E731
    return call, [history, amax, scale, scale_inv]


def update_case(pattern, exc=RuntimeError, **kw):
    call, watched = update(**kw)
    return call, watched, exc, r"^ampc\.fp8_update_scales: " + pattern


def case_update_history_dims():
    return update_case(r"amax_history must be a 2-D torch\.float32 tensor \[history length >= 1, number of tensors\], got torch\.float32 with 1 dimensions",
                       history=torch.zeros(8))


def case_update_history_rows():
    return update_case(r"amax_history must be a 2-D torch\.float32 tensor", history=torch.zeros(0, 2))


def case_update_history_dtype():
    return update_case(r"amax_history must be a 2-D torch\.float32 tensor .*got torch\.float16",
                       history=torch.zeros(4, 2, dtype=f16))


def case_update_scale_length():
    return update_case(r"scale must be a 1-D torch\.float32 tensor of 2 values \(one per column of amax_history\)",
                       scale=torch.ones(3))


def case_update_amax_dtype():
    return update_case(r"amax must be a 1-D torch\.float32 tensor of 2 values", amax=torch.ones(2, dtype=bf16))


def case_update_fmax():
    return update_case(r"fmax must be a positive finite fp32 number, got -1", fmax=-1.0)


def case_update_fmax_tiny():
    return update_case(r"fmax must be a positive finite fp32 number, got 1e-50", fmax=1e-50)


def case_update_fmax_inf():
    return update_case(r"fmax must be a positive finite fp32 number, got inf", fmax=float("inf"))


def case_update_margin():
    return update_case(r"margin must be finite and leave fmax \* 2\^-margin a positive finite fp32 number, got margin 200",
                       margin=200)


def case_update_algo():
    return update_case(r"algo must be 'max' or 'most_recent', got 'mean'", exc=ValueError, algo="mean")


def case_update_alias():
    s = torch.ones(2)
    return update_case(r"(scale overlaps scale_inv|scale_inv overlaps scale) in memory", scale=s, scale_inv=s)


def case_update_noncontiguous():
    return update_case(r"amax_history must be contiguous", history=torch.zeros(2, 4).t())


CASES = {name[5:]: fn for name, fn in globals().items() if name.startswith("case_")}


@pytest.mark.smoke
@pytest.mark.parametrize("name", sorted(CASES))
def test_bad_input_raises_and_changes_nothing(name):
    assert_refused_unchanged(name, *CASES[name]())


# (tensors with elements and no data: tests/test_errors.py covers every fp8 op's arguments)


def test_fp8_ops_bump_versions_and_refuse_grad():
    x = torch.randn(8)
    q, scale, amax = fp8(8), torch.ones(1), torch.zeros(1)
    ampc.ops.cast_fp8([q], [x], scale, amax)
    assert (q._version, amax._version, x._version, scale._version) == (1, 1, 0, 0)
    back = torch.empty(8)
    ampc.ops.cast_from_fp8([back], [q], scale)
    assert (back._version, q._version) == (1, 1)
    history, s, s_inv = torch.zeros(2, 1), torch.ones(1), torch.ones(1)
    ampc.ops.fp8_update_scales(history, amax, s, s_inv, fmax=448.0)
    assert (history._version, s._version, s_inv._version, amax._version) == (1, 1, 1, 1)
    w = torch.randn(8, requires_grad=True)
    with pytest.raises(RuntimeError, match=r"^ampc\.cast_fp8: src\[0\] requires grad"):
        ampc.ops.cast_fp8([q], [w], scale, amax)
    with torch.no_grad():
        ampc.ops.cast_fp8([q], [w], scale, amax)
