"""ampc.autocast against torch.autocast on every case of torch's own autocast test lists
(torch.testing._internal.autocast_test_lists, shipped with torch): same output dtypes, same
values (bit for bit on the CPU: ampc's casts round like .to(); within tolerance on CUDA, where
atomics make some sums order-dependent), same errors.

The CPU lists run here; the CUDA lists need a GPU. Each case runs every variant torch's
tests run (torch.<op> / torch._C._nn.<op> and Tensor.<op>), under each autocast dtype.
"""
import collections
import sys
import types
import unittest

import pytest
import torch

import ampc

if "expecttest" not in sys.modules:   # torch's test utilities import it; only TestCase is used
    sys.modules["expecttest"] = types.ModuleType("expecttest")
    sys.modules["expecttest"].TestCase = unittest.TestCase
from torch.testing._internal import autocast_test_lists as lists  # noqa: E402


def _same(a, b, exact):
    """Same type and dtype, and equal bit for bit (``exact``) or within the dtype's tolerance
    (CUDA: atomics in scatter_add and index_put make sums order-dependent)."""
    if isinstance(a, torch.Tensor):
        if not isinstance(b, torch.Tensor) or a.dtype != b.dtype:
            return False
        if exact or not a.is_floating_point():
            return torch.equal(a, b)
        return torch.allclose(a.double(), b.double(), rtol=1e-2, atol=1e-3, equal_nan=True)
    if isinstance(a, (tuple, list)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y, exact) for x, y in zip(a, b))
    return a == b


def _dtypes(x):
    if isinstance(x, torch.Tensor):
        return x.dtype
    if isinstance(x, (tuple, list)):
        return tuple(_dtypes(v) for v in x)
    return type(x).__name__


def _call(ctx, fn, args, kwargs):
    torch.manual_seed(0)
    with ctx:
        try:
            return fn(*args, **kwargs), None
        except Exception as e:            # noqa: BLE001  (the error is compared too)
            return None, e


def _variants(module, op, args):
    """The callables torch's test calls: module.<op> and Tensor.<op>."""
    out = []
    if module is not None and hasattr(module, op):
        out.append((f"{module.__name__}.{op}", getattr(module, op), args))
    if hasattr(torch.Tensor, op) and isinstance(args[0], torch.Tensor):
        out.append((f"Tensor.{op}", getattr(torch.Tensor, op), args))
    return out


def _cases(device):
    """(id, module, op, args, kwargs, amp dtype) for every entry of torch's lists."""
    if device == "cpu":
        L = lists.AutocastCPUTestLists(device)
        amp = (torch.bfloat16, torch.float16)
        plain = {"torch_16": torch, "nn_16": torch._C._nn, "torch_fp32": torch, "nn_fp32": torch._C._nn}
        paired = {"torch_expect_builtin_promote": torch, "methods_expect_builtin_promote": None,
                  "torch_need_autocast_promote": torch}
    else:
        L = lists.AutocastTestLists(device)
        amp = (torch.float16, torch.bfloat16)
        plain = {"torch_fp16": torch, "torch_fp32": torch, "torch_need_autocast_promote": torch,
                 "nn_fp16": torch._C._nn, "nn_fp32": torch._C._nn, "linalg_fp16": torch._C._linalg,
                 "methods_fp16": None, "methods_fp32": None, "banned": None,
                 "torch_expect_builtin_promote": torch, "methods_expect_builtin_promote": None}
        paired = {}
    for list_name, module in plain.items():
        for i, entry in enumerate(getattr(L, list_name)):
            op, args = entry[0], entry[1]
            kwargs = entry[2] if len(entry) > 2 and isinstance(entry[2], dict) else {}
            if list_name == "banned":
                module = entry[2]
            if op == "einsum":                  # ("einsum", equation, operands)
                args = (args,) + entry[2]
            if len(entry) > 2 and entry[-1] is True:    # skipped on ROCm by torch's tests
                continue
            for dt in amp:
                yield f"{device}:{list_name}[{i}]:{op}:{dt}", module, op, args, kwargs, dt
    for list_name, module in paired.items():     # (op, args for bf16, args for fp16[, out type])
        for i, entry in enumerate(getattr(L, list_name)):
            for dt, args in zip(amp, entry[1:3]):
                yield f"{device}:{list_name}[{i}]:{entry[0]}:{dt}", module, entry[0], args, {}, dt


README_TORCH = "2.14.1"      # the torch whose test lists gave the counts in docs/autocast.md


def _conformance(device, capsys):
    counts = collections.Counter()
    failures = []
    for case, module, op, args, kwargs, dt in _cases(device):
        variants = _variants(module, op, args)
        assert variants, f"{case}: neither {module}.{op} nor Tensor.{op} exists"
        counts["cases"] += 1
        for label, fn, a in variants:
            if label.startswith("Tensor.") and module is not None and op == "einsum":
                continue
            counts["variants"] += 1
            want, want_err = _call(torch.autocast(device, dtype=dt), fn, a, kwargs)
            got, got_err = _call(ampc.autocast(device, dtype=dt), fn, a, kwargs)
            if want_err is not None or got_err is not None:
                ok = type(want_err) is type(got_err) and str(want_err) in str(got_err)
                counts["errors compared"] += 1
            else:
                ok = _same(want, got, exact=device == "cpu")
            if not ok:
                failures.append(f"{case} {label}: torch {_dtypes(want)} {want_err!r} "
                                f"ampc {_dtypes(got)} {got_err!r}")
    with capsys.disabled():       # the count shows in the test output, captured or not
        print(f"\n{device} conformance: {counts['cases']} cases, {counts['variants']} calls: "
              f"{counts['variants'] - counts['errors compared']} values compared, "
              f"{counts['errors compared']} errors compared, {len(failures)} differ")
    assert not failures, "\n".join(failures)
    return counts


def test_conformance_cpu_lists(capsys):
    counts = _conformance("cpu", capsys)
    assert counts["cases"] >= 100
    if torch.__version__.startswith(README_TORCH):     # the figures docs/autocast.md states
        assert (counts["cases"], counts["variants"]) == (110, 144)


@pytest.mark.cuda
def test_conformance_cuda_lists(capsys):
    counts = _conformance("cuda", capsys)
    assert counts["cases"] >= 200


def _cast_floating(value, dtype):
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() else value
    if isinstance(value, (list, tuple)):
        return type(value)(_cast_floating(v, dtype) for v in value)
    return value


@pytest.mark.filterwarnings("ignore::UserWarning")     # torch's own list calls cross() without dim
def test_cuda_table_on_cpu_tensors_gives_torchs_expected_results(monkeypatch, capsys):
    """Without a GPU: ampc's CUDA table applied to CPU tensors under float16 gives, on every
    case of torch's CUDA lists that runs on the CPU, the result torch's own test expects:
    the op run with its floating arguments cast to the list's type, autocast off. Every op
    takes ampc's own path here (the one policy edits take), torch's autocast off for it."""
    from ampc.amp import autocast_mode as AC
    monkeypatch.setitem(AC._EFFECTIVE, "cpu", AC._EFFECTIVE["cuda"])
    monkeypatch.setitem(AC._TORCH, "cpu", {})    # every listed op differs: ampc does all the casts
    monkeypatch.setattr(ampc.policy, "CHANGED", True)     # so regions put ampc's mode on
    L = lists.AutocastTestLists("cpu")
    plan = {"torch_fp16": (torch, torch.float16), "nn_fp16": (torch._C._nn, torch.float16),
            "linalg_fp16": (torch._C._linalg, torch.float16), "methods_fp16": (None, torch.float16),
            "torch_fp32": (torch, torch.float32), "nn_fp32": (torch._C._nn, torch.float32),
            "methods_fp32": (None, torch.float32), "torch_need_autocast_promote": (torch, torch.float32)}
    checked, failures = 0, []
    for list_name, (module, run_as) in plan.items():
        for entry in getattr(L, list_name):
            op, args = entry[0], entry[1]
            kwargs = entry[2] if len(entry) > 2 and isinstance(entry[2], dict) else {}
            if op.startswith("cudnn_") or op == "einsum":     # CUDA-only / 4-d equation on 2-d args
                continue
            for label, fn, a in _variants(module, op, args):
                with ampc.autocast("cpu", dtype=torch.float16):
                    got = fn(*a, **kwargs)
                want = fn(*_cast_floating(a, run_as), **kwargs)
                checked += 1
                if not _same(want, got, exact=True):
                    failures.append(f"{list_name} {label}: {_dtypes(got)} vs expected {_dtypes(want)}")
    with ampc.autocast("cpu", dtype=torch.float16), pytest.raises(RuntimeError, match="unsafe to autocast"):
        torch._C._nn.binary_cross_entropy(*L.banned[0][1])
    with capsys.disabled():
        print(f"\ncuda table on cpu tensors: {checked} calls, {len(failures)} differ")
    assert checked >= 140 and not failures, "\n".join(failures)
    if torch.__version__.startswith(README_TORCH):
        assert checked == 147
