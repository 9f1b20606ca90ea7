"""python -m ampc prints what a bug report needs: versions, the CPU and both ISA paths,
and whether ampc's CUDA library loaded, with the reason when it did not."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import ampc
from ampc import __main__ as info
from ampc import _lib

ROOT = Path(__file__).resolve().parents[2]


def _python_m_ampc(**env):
    full = dict(os.environ, PYTHONPATH=str(ROOT), **env)
    done = subprocess.run([sys.executable, "-m", "ampc"], cwd=ROOT, env=full,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_prints_versions_cpu_and_isa_paths():
    out = _python_m_ampc(AMPC_CPU_ISA="scalar")
    assert f"ampc {ampc.__version__} ({ROOT / 'ampc'})" in out
    assert f"torch {torch.__version__} " in out
    assert f"Python {sys.version.split()[0]} " in out
    assert f"CPU: {info.cpu_model()}" in out
    assert "ampc CPU path: scalar (AMPC_CPU_ISA=scalar)" in out
    assert f"torch CPU capability: {torch.backends.cpu.get_cpu_capability()}" in out
    assert re.search(r"^ampc CUDA library: (loaded \(.+\)|not loaded: .+)$", out, re.M)


def test_report_in_process_names_this_cpu_path():
    lines = info.report()
    assert f"ampc CPU path: {ampc.ops.cpu_isa()} " in "\n".join(lines)
    assert all(isinstance(line, str) and line for line in lines)


def test_cuda_versions_read_from_the_loaded_library():
    versions = info.cuda_versions()
    if _lib.cuda_lib is None:
        assert versions is None
        return
    driver, runtime = versions
    assert re.fullmatch(r"\d+\.\d", runtime)
    assert driver == "none" or re.fullmatch(r"\d+\.\d", driver)
    if torch.cuda.is_available():
        assert driver != "none"


@pytest.mark.parametrize("case", ["torch_without_cuda", "not_built", "refused", "loaded"])
def test_cuda_library_status_says_why(monkeypatch, tmp_path, case):
    monkeypatch.setattr(_lib, "cuda_lib", object() if case == "loaded" else None)
    if case == "torch_without_cuda":
        monkeypatch.setattr(torch.version, "cuda", None)
        assert info.cuda_library_status() == "not loaded: this torch is built without CUDA"
        return
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    # where the loader looks: next to ampc/_lib.py
    monkeypatch.setattr(_lib, "__file__", str(tmp_path / "_lib.py"))
    if case == "not_built":
        assert "libampc_cuda.so was not built (nvcc was not on the PATH" in \
            info.cuda_library_status()
        return
    (tmp_path / "libampc_cuda.so").write_bytes(b"")
    if case == "refused":
        monkeypatch.setattr(_lib, "cuda_refusal", lambda: "the driver is too old")
        assert info.cuda_library_status() == "not loaded: the driver is too old"
    else:
        assert info.cuda_library_status() == f"loaded ({tmp_path / 'libampc_cuda.so'})"


def test_loaded_library_without_a_driver_is_called_unusable(monkeypatch, tmp_path):
    # the library links against the runtime only, so it loads on a machine with no driver;
    # the status line must not then read plainly "loaded" beside "CUDA driver: none"
    monkeypatch.setattr(_lib, "cuda_lib", object())
    monkeypatch.setattr(_lib, "__file__", str(tmp_path / "_lib.py"))
    path = tmp_path / "libampc_cuda.so"
    assert info.cuda_library_status(driver="none") == (
        f"loaded ({path}) but unusable: no NVIDIA driver, so its kernels cannot run "
        "(CPU kernels only)")
    assert info.cuda_library_status(driver="13.0") == f"loaded ({path})"


def test_report_library_line_agrees_with_the_driver_line():
    lines = info.report()
    library = next(line for line in lines if line.startswith("ampc CUDA library: "))
    driver = next((line for line in lines if line.startswith("CUDA driver: ")), None)
    if driver is not None and driver.startswith("CUDA driver: none"):
        assert "unusable: no NVIDIA driver" in library
    else:
        assert "unusable" not in library
