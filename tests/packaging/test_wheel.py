"""The package as a user gets it: an sdist and a wheel built from a clean copy of the
checkout, the wheel installed (not editable) into a new virtual environment, used from a
directory outside the checkout.

The copy holds the files git tracks (and new ones it does not ignore), so nothing built in
the checkout travels along. The sdist is built from the copy, the wheel from the unpacked
sdist (what `pip install ampc-*.tar.gz` does), without build isolation (which could fetch
a torch) and with nvcc hidden from the PATH: the CUDA library takes minutes to build, so
this wheel carries the CPU kernels only. A second build of the same tree with a stand-in
nvcc on the PATH checks that a library nvcc builds goes into the wheel.

The new environment gets no second torch: it is made from the base interpreter, and a
.pth file adds the site-packages this torch lives in (a .pth named there is not read in
turn, so an editable ampc there stays out of sight).
"""
import json
import os
import shutil
import subprocess
import sys
import tarfile
import textwrap
import zipfile
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
BUILD_TIMEOUT_S = 1200          # a C build on a loaded 2-core machine


def _run(cmd, cwd, env=None, timeout=BUILD_TIMEOUT_S):
    done = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert done.returncode == 0, f"{cmd} failed:\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
    return done.stdout


def _clean_env(path=None):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "PIP_"))}
    if path is not None:
        env["PATH"] = path
    return env


def _path_without_nvcc():
    dirs = os.environ.get("PATH", "").split(os.pathsep)
    return os.pathsep.join(d for d in dirs if d and not os.access(os.path.join(d, "nvcc"),
                                                                  os.X_OK))


def _tracked_files():
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout: the clean copy is made from git's file list")
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                         cwd=ROOT, capture_output=True, check=True).stdout
    return [f for f in out.decode().split("\0") if f and (ROOT / f).is_file()]


def _package_sources(files):
    return sorted(f for f in files if f.startswith("ampc/") and f.endswith(".py"))


@pytest.fixture(scope="module")
def build(tmp_path_factory):
    base = tmp_path_factory.mktemp("wheel")
    files = _tracked_files()
    copy = base / "checkout"
    for f in files:
        (copy / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / f, copy / f)
    dist = base / "dist"
    sdist_name = _run([sys.executable, "-c", "import sys; from setuptools import build_meta; "
                       "print(build_meta.build_sdist(sys.argv[1]))", str(dist)],
                      cwd=copy, env=_clean_env()).strip().splitlines()[-1]
    sdist = dist / sdist_name
    with tarfile.open(sdist) as tar:
        tar.extractall(base / "sdist", filter="data")
    tree = base / "sdist" / sdist_name[:-len(".tar.gz")]
    no_nvcc = _path_without_nvcc()
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-index",
          "--no-build-isolation", "-w", str(dist), "."], cwd=tree, env=_clean_env(no_nvcc))
    wheel, = dist.glob("ampc-*.whl")
    return {"base": base, "files": files, "sdist": sdist, "tree": tree, "wheel": wheel,
            "no_nvcc": no_nvcc}


@pytest.fixture(scope="module")
def venv(build):
    """A new environment with the wheel installed and this torch visible."""
    env_dir = build["base"] / "venv"
    _run([getattr(sys, "_base_executable", sys.executable), "-m", "venv", "--without-pip",
          str(env_dir)], cwd=build["base"], env=_clean_env())
    python = env_dir / "bin" / "python"
    site = Path(_run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                     cwd=build["base"], env=_clean_env()).strip())
    torch_site = Path(torch.__file__).resolve().parents[1]
    (site / "torch_from_base.pth").write_text(f"{torch_site}\n")
    _run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps",
          "--no-index", str(build["wheel"])], cwd=build["base"], env=_clean_env())
    return {"python": python, "site": site.resolve()}


def test_sdist_carries_the_sources_and_no_built_files(build):
    with tarfile.open(build["sdist"]) as tar:
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
    wanted = _package_sources(build["files"]) + [
        f for f in build["files"] if f.startswith("csrc/")] + ["LICENSE", "setup.py",
                                                               "pyproject.toml", "README.md"]
    assert not set(wanted) - names
    assert any(f.startswith("csrc/cuda/") for f in names)
    assert not [n for n in names if n.endswith((".so", ".o"))]


def test_wheel_carries_every_subpackage_the_library_and_the_license(build):
    names = set(zipfile.ZipFile(build["wheel"]).namelist())
    missing = set(_package_sources(build["files"])) - names
    assert not missing, f"not in the wheel: {sorted(missing)}"
    assert {"ampc/fp8/__init__.py", "ampc/validate/__init__.py", "ampc/libampc.so"} <= names
    # dist-info/licenses/LICENSE from setuptools 77 on, dist-info/LICENSE before
    assert any(".dist-info/" in n and n.endswith("/LICENSE") for n in names)
    # built with nvcc hidden: the CPU kernels only
    assert "ampc/libampc_cuda.so" not in names


STEP = textwrap.dedent("""
    import json, sys
    import torch
    import ampc, ampc.fp8, ampc.validate

    def model_and_data():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(),
                                    torch.nn.Linear(32, 4))
        return model, torch.randn(8, 16), torch.randn(8, 4)

    def step(autocast, scaler, opt_cls, **opt_kw):
        model, x, y = model_and_data()
        opt = opt_cls(model.parameters(), lr=1e-2, **opt_kw)
        with autocast("cpu", dtype=torch.bfloat16):
            loss = torch.nn.functional.mse_loss(model(x).float(), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        return loss.item(), [p.detach().clone() for p in model.parameters()]

    before = [p.detach().clone() for p in model_and_data()[0].parameters()]
    ours = step(ampc.autocast, ampc.GradScaler("cpu"), ampc.optim.AdamW)
    theirs = step(torch.autocast, torch.amp.GradScaler("cpu"), torch.optim.AdamW, fused=True)
    print(json.dumps({
        "files": {m.__name__: m.__file__ for m in (ampc, ampc.fp8, ampc.validate)},
        "library": ampc._lib.lib._name,
        "losses": [ours[0], theirs[0]],
        "moved": min((a - b).abs().max().item() for a, b in zip(ours[1], before)),
        "gap": max((a - b).abs().max().item() for a, b in zip(ours[1], theirs[1])),
        "cuda_library": ampc._lib.cuda_lib is not None,
    }))
""")


def test_installed_wheel_imports_and_trains_outside_the_checkout(build, venv, tmp_path):
    script = tmp_path / "step.py"
    script.write_text(STEP)
    out = json.loads(_run([str(venv["python"]), str(script)], cwd=tmp_path,
                          env=_clean_env(build["no_nvcc"]), timeout=600).splitlines()[-1])
    for name, path in out["files"].items():
        assert Path(path).resolve().is_relative_to(venv["site"]), (name, path)
    assert Path(out["library"]).resolve().is_relative_to(venv["site"])
    assert not out["cuda_library"]          # none was built
    ours, theirs = out["losses"]
    assert ours == theirs                   # the same forward under both autocasts
    assert out["moved"] > 0                 # the step ran on every param
    # AdamW against torch's fused one: equal but the 1-ulp tails (README, optimizers)
    assert out["gap"] < 1e-6


def test_python_m_ampc_runs_from_the_install(build, venv, tmp_path):
    out = _run([str(venv["python"]), "-m", "ampc"], cwd=tmp_path,
               env=_clean_env(build["no_nvcc"]), timeout=600)
    assert f"ampc {_installed_version(build)}" in out
    assert str(venv["site"]) in out
    assert "libampc_cuda.so was not built" in out


def _installed_version(build):
    return build["wheel"].name.split("-")[1]


FAKE_NVCC = """#!{python}
# stands in for nvcc: answers --version, writes a placeholder for each -o
import sys
args = sys.argv[1:]
if "--version" in args:
    print("Cuda compilation tools, release 13.0, V13.0.0")
elif "-o" in args:
    open(args[args.index("-o") + 1], "wb").write(b"not a library")
"""


def _stand_in_nvcc(tmp_path):
    """A folder holding the stand-in nvcc."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    nvcc = bin_dir / "nvcc"
    nvcc.write_text(FAKE_NVCC.format(python=sys.executable))
    nvcc.chmod(0o755)
    return bin_dir


def test_a_cuda_library_nvcc_builds_goes_into_the_wheel(build, tmp_path):
    # the tree of the first build is reused: its C library is up to date, so only the
    # CUDA step runs, with the stand-in nvcc
    bin_dir = _stand_in_nvcc(tmp_path)
    dist = tmp_path / "dist"
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-index",
          "--no-build-isolation", "-w", str(dist), "."], cwd=build["tree"],
         env=_clean_env(f"{bin_dir}{os.pathsep}{build['no_nvcc']}"))
    wheel, = dist.glob("ampc-*.whl")
    with zipfile.ZipFile(wheel) as z:
        assert z.read("ampc/libampc_cuda.so") == b"not a library"
        assert "ampc/libampc.so" in z.namelist()


def test_no_cuda_switch_leaves_the_cuda_library_out_with_nvcc_on_the_path(build, tmp_path):
    # a tree of its own: the one of the first build holds a CUDA library from the test above
    tree = tmp_path / "tree"
    shutil.copytree(build["tree"], tree, ignore=shutil.ignore_patterns("build"))
    env = _clean_env(f"{_stand_in_nvcc(tmp_path)}{os.pathsep}{build['no_nvcc']}")
    env["AMPC_NO_CUDA"] = "1"
    dist = tmp_path / "dist"
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-index",
          "--no-build-isolation", "-w", str(dist), "."], cwd=tree, env=env)
    wheel, = dist.glob("ampc-*.whl")
    with zipfile.ZipFile(wheel) as z:
        assert "ampc/libampc.so" in z.namelist()
        assert "ampc/libampc_cuda.so" not in z.namelist()
