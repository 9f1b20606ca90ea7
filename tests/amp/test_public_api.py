"""The public names: torch.amp's names are ampc's too, every ``__all__`` entry resolves, the
classes re-exported under a module's name do not hide the modules they live in, and
is_autocast_available answers as torch's does for the devices ampc supports."""
import importlib
import types

import pytest
import torch

import ampc

PUBLIC_MODULES = ["ampc", "ampc.amp", "ampc.amp.autocast_mode", "ampc.policy", "ampc.grad_scaler",
                  "ampc.optim", "ampc.master", "ampc.demo", "ampc.fp8", "ampc.fp8.autocast_mode",
                  "ampc.fp8.linear", "ampc.fp8.recipe", "ampc.fp8.scaling", "ampc.validate",
                  "ampc.memory", "ampc.memory.peak", "ampc.lean_state"]


@pytest.mark.parametrize("name", PUBLIC_MODULES)
def test_every_name_in_all_resolves(name):
    module = importlib.import_module(name)
    missing = [n for n in module.__all__ if not hasattr(module, n)]
    assert not missing


def test_torch_amp_names_are_ampc_names():
    assert set(torch.amp.__all__) <= set(ampc.__all__)
    assert "validate" in ampc.__all__ and "is_autocast_available" in ampc.__all__


def test_classes_do_not_hide_their_modules():
    assert isinstance(ampc.autocast, type) and ampc.autocast is ampc.amp.autocast_mode.autocast
    assert isinstance(ampc.amp.autocast_mode, types.ModuleType)
    assert isinstance(ampc.fp8.autocast, type)
    assert ampc.fp8.autocast is importlib.import_module("ampc.fp8.autocast_mode").autocast
    assert callable(ampc.fp8.gemm) and not isinstance(ampc.fp8.gemm, types.ModuleType)


# ids other than "cuda": the conftest skips a test with that keyword on a machine without a GPU
@pytest.mark.parametrize("device", ["cpu", "cuda", "xpu", "mps", "meta"], ids=lambda d: f"on_{d}")
def test_is_autocast_available(device):
    # ampc's regions run where torch's autocast does and ampc has kernels: cpu and cuda
    assert ampc.is_autocast_available(device) == (torch.amp.is_autocast_available(device)
                                                   and device in ("cpu", "cuda"))
    assert ampc.is_autocast_available(device) == (device in ("cpu", "cuda"))


def test_is_autocast_available_refuses_what_torch_refuses():
    for bad, kind in (("foo", RuntimeError), (3, TypeError)):
        with pytest.raises(kind):
            torch.amp.is_autocast_available(bad)
        with pytest.raises(kind):
            ampc.is_autocast_available(bad)
