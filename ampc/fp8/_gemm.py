"""ampc.fp8.gemm (defined here; the function is the public name): one FP8 matrix product, with
torch._scaled_mm's contract.

On CUDA it runs through cuBLASLt (ampc.ops.fp8_gemm, GPUs of compute capability
8.9 and newer); on the CPU through a reference path: the fp8 values widened to fp32
(exact: every fp8 value is an fp32 value), an fp32 matmul, the dequantizing scales and the
bias applied to the fp32 result as cuBLASLt applies them, one rounding to ``out_dtype``.
"""
from __future__ import annotations  # "X | None" hints on Python 3.9 too; none evaluated at import

import torch

from .. import ops

__all__ = ["gemm", "FP8_DTYPES", "OUT_DTYPES"]

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
OUT_DTYPES = (torch.bfloat16, torch.float32)
# cuBLASLt's FP8 kernels on Hopper pick faster algorithms with a large workspace
WORKSPACE_BYTES = 32 * 1024 * 1024

_workspaces = {}


def _workspace(device):
    """One workspace per device and stream: two streams must not share one."""
    stream = torch.cuda.current_stream(device)
    key = (device.index, stream.cuda_stream)
    ws = _workspaces.get(key)
    if ws is None:
        ws = _workspaces[key] = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
    return ws


def _fail(kind, msg):
    raise kind(f"ampc.fp8.gemm: {msg}")


def _check_scalar(name, t, device):
    if not isinstance(t, torch.Tensor):
        _fail(TypeError, f"{name} must be a Tensor, got {type(t).__name__}")
    if t.dtype != torch.float32 or t.numel() != 1:
        _fail(ValueError, f"{name} must be a 1-element torch.float32 tensor, got {t.dtype} "
                          f"with {t.numel()} elements")
    if t.device != device:
        _fail(ValueError, f"{name} must be on {device} like a, got {t.device}")


def _check(a, b, scale_inv_a, scale_inv_b, bias, out_dtype, amax_out):
    for name, t in (("a", a), ("b", b)):
        if not isinstance(t, torch.Tensor):
            _fail(TypeError, f"{name} must be a Tensor, got {type(t).__name__}")
        if t.dtype not in FP8_DTYPES:
            _fail(TypeError, f"{name} must be torch.float8_e4m3fn or torch.float8_e5m2, "
                             f"got {t.dtype}")
        if t.dim() != 2:
            _fail(ValueError, f"{name} must be a matrix, got {t.dim()} dimensions")
    if a.dtype == b.dtype == torch.float8_e5m2:
        _fail(TypeError, "a and b are both torch.float8_e5m2; at least one must be "
                         "torch.float8_e4m3fn (cuBLASLt has no e5m2 x e5m2 GEMM)")
    if b.device != a.device:
        _fail(ValueError, f"b must be on {a.device} like a, got {b.device}")
    (m, k), (k2, n) = a.shape, b.shape
    if k2 != k:
        _fail(ValueError, f"a is [{m}, {k}] and b is [{k2}, {n}]: b must have {k} rows")
    if k % 16 or n % 16 or k == 0 or n == 0:
        _fail(ValueError, f"k ({k}) and n ({n}) must be positive multiples of 16 "
                          f"(cuBLASLt's FP8 kernels need it; the CPU path keeps the same rule)")
    if not a.is_contiguous():
        _fail(ValueError, f"a must be row-major (contiguous), got strides {a.stride()}")
    if not b.t().is_contiguous():
        _fail(ValueError, f"b must be column-major (b.t() contiguous, as `weight.t()` of a "
                          f"contiguous weight is), got strides {b.stride()}")
    _check_scalar("scale_inv_a", scale_inv_a, a.device)
    _check_scalar("scale_inv_b", scale_inv_b, a.device)
    if out_dtype not in OUT_DTYPES:
        _fail(TypeError, f"out_dtype must be torch.bfloat16 or torch.float32, got {out_dtype}")
    if bias is not None:
        if not isinstance(bias, torch.Tensor):
            _fail(TypeError, f"bias must be a Tensor or None, got {type(bias).__name__}")
        if bias.dtype != torch.bfloat16 or bias.shape != (n,) or bias.device != a.device:
            _fail(ValueError, f"bias must be a torch.bfloat16 vector of n = {n} elements on "
                              f"{a.device}, got {bias.dtype} of shape {tuple(bias.shape)} on "
                              f"{bias.device}")
    if amax_out is not None:
        _check_scalar("amax_out", amax_out, a.device)


def gemm(a: torch.Tensor, b: torch.Tensor, scale_inv_a: torch.Tensor, scale_inv_b: torch.Tensor, *,
         bias: torch.Tensor | None = None, out_dtype: torch.dtype = torch.bfloat16,
         amax_out: torch.Tensor | None = None) -> torch.Tensor:
    """Returns ``(a * scale_inv_a) @ (b * scale_inv_b) + bias`` in ``out_dtype``.

    Shapes and layouts as torch._scaled_mm takes them: ``a`` [m, k] row-major, ``b`` [k, n]
    column-major (``w.t()`` of a contiguous [n, k] weight), k and n multiples of 16. The
    products accumulate in fp32 and the result is rounded once.

    Args:
        a, b (Tensor): torch.float8_e4m3fn or torch.float8_e5m2 (not both e5m2).
        scale_inv_a, scale_inv_b (Tensor): 1-element fp32 tensors on the inputs' device, the
            dequantizing scales (inverse of the scales the inputs were cast with); read on
            the device, never on the host.
        bias (Tensor, optional): a torch.bfloat16 vector of n elements, added in fp32 before
            the rounding (cuBLASLt's bias epilogue).
        out_dtype (torch.dtype): torch.bfloat16 (default) or torch.float32.
        amax_out (Tensor, optional): a 1-element fp32 tensor that receives max |result|,
            taken before the rounding to ``out_dtype`` where cuBLASLt's epilogue offers it
            and on the CPU, after it otherwise.
    """
    _check(a, b, scale_inv_a, scale_inv_b, bias, out_dtype, amax_out)
    if a.device.type == "cpu":
        return _reference(a, b, scale_inv_a, scale_inv_b, bias, out_dtype, amax_out)
    if a.device.type != "cuda":
        _fail(ValueError, f"runs on CPU and CUDA tensors, got {a.device}")
    out = torch.empty(a.shape[0], b.shape[1], dtype=out_dtype, device=a.device)
    written = ops.fp8_gemm(
        out, a, b.t(), scale_inv_a.reshape(1), scale_inv_b.reshape(1),
        [] if bias is None else [bias], [] if amax_out is None else [amax_out.reshape(1)],
        _workspace(a.device))
    if amax_out is not None and not written:
        ops.fp8_amax([out], amax_out.reshape(1))
    return out


def _widen(x):
    """fp8 -> fp32 (exact) through ampc's vectorized cast; x contiguous."""
    out = torch.empty(x.shape, dtype=torch.float32)
    ops.cast_from_fp8([out], [x], torch.ones(1))
    return out


def _reference(a, b, scale_inv_a, scale_inv_b, bias, out_dtype, amax_out):
    # an enclosing autocast region must not turn the fp32 matmul into a bf16 one
    with torch.autocast("cpu", enabled=False):
        acc = _widen(a) @ _widen(b.t()).t()
        out = acc * (scale_inv_a.reshape(()) * scale_inv_b.reshape(()))
        if bias is not None:
            out = out + bias.float()
    if amax_out is not None:
        ops.fp8_amax([out], amax_out.reshape(1))
    return out.to(out_dtype)
