"""Every ```python block of README.md and docs/*.md runs.

Each block runs in a fresh namespace, from a temporary directory, with small stand-ins
for the names a snippet leaves to the reader (model, data, loss_fn, x, y, device ...):
a 16-32-16 classifier with a LayerNorm (FP8-friendly sizes), three batches of 8, cross-entropy
(ampc.validate's default loss), the CPU.
A block that cannot run here says why in an HTML comment on the line before it,
`<!-- no-run: needs torchrun -->`, and is reported as skipped with that reason. A block
that imports an optional framework (Lightning, Accelerate, transformers, torchtitan) that
is not installed is skipped, and fails under CI (tests/optional.py). New pages in docs/
are picked up as they land.
"""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ampc
from optional import lacking

ROOT = Path(__file__).resolve().parents[2]
NO_RUN = re.compile(r"<!--\s*no-run:\s*(.*?)\s*-->")


def doc_files():
    return [p for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
            if p.is_file()]


def python_blocks(path):
    """(first line number, code, reason to skip or None) of each ```python block."""
    lines = path.read_text().splitlines()
    blocks, i = [], 0
    while i < len(lines):
        if lines[i].strip() == "```python":
            before = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
            skip = NO_RUN.search(before)
            end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "```")
            blocks.append((i + 2, "\n".join(lines[i + 1:end]) + "\n",
                           skip.group(1) if skip else None))
            i = end
        i += 1
    return blocks


def _cases():
    cases = []
    for path in doc_files():
        for line, code, skip in python_blocks(path):
            marks = [pytest.mark.skip(reason=skip)] if skip else []
            name = f"{path.relative_to(ROOT)}:{line}"
            cases.append(pytest.param(path, line, code, id=name, marks=marks))
    return cases


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.GELU())
        self.head = nn.Linear(32, 16)

    def forward(self, x):
        return self.head(self.body(x))


def make_batch(step):
    g = torch.Generator().manual_seed(step)
    return torch.randn(8, 16, generator=g), torch.randint(0, 16, (8,), generator=g)


def stand_ins():
    torch.manual_seed(0)
    x, y = make_batch(0)
    data = [make_batch(step) for step in range(3)]
    return {"torch": torch, "nn": nn, "F": F, "ampc": ampc, "device": "cpu",
            "model": Net(), "make_model": Net, "make_batch": make_batch, "data": data,
            "batches": data, "x": x, "y": y, "loss_fn": F.cross_entropy}


def _custom_op_stand_in():
    # docs/autocast.md registers a custom op under a policy: torch.ops.mylib.attn
    if not hasattr(torch.ops.mylib, "attn"):
        @torch.library.custom_op("mylib::attn", mutates_args=())
        def attn(q: torch.Tensor) -> torch.Tensor:
            return q.clone()


@pytest.fixture
def clean_policy():
    yield
    ampc.policy.reset()


def test_docs_have_python_blocks():
    assert any(python_blocks(p) for p in doc_files())


def test_no_run_marker_is_read(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("text\n\n<!-- no-run: needs a GPU -->\n```python\nx = 1\n```\n\n"
                    "```python\ny = 2\n```\n```bash\nz\n```\n")
    assert python_blocks(page) == [(5, "x = 1\n", "needs a GPU"), (9, "y = 2\n", None)]


@pytest.mark.parametrize("path, line, code", _cases())
def test_block_runs(path, line, code, tmp_path, monkeypatch, clean_policy):
    _custom_op_stand_in()
    monkeypatch.chdir(tmp_path)
    namespace = stand_ins()
    where = f"{path.relative_to(ROOT)}:{line}"
    try:
        exec(compile(code, where, "exec"), namespace)
    except ModuleNotFoundError as e:
        # ampc and torch are never optional: a block that cannot import them is broken
        top = (e.name or "").partition(".")[0]
        if top in ("", "ampc", "torch"):
            raise
        lacking(top, f"{where} imports {top}, which is not installed")


def _run_blocks_without(module, ids, ci):
    """pytest on the blocks ``ids`` in a fresh interpreter in which ``module`` cannot be
    imported (None in sys.modules), with or without CI set."""
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    if ci:
        env["CI"] = "true"
    nodes = [f"tests/demo/test_docs.py::test_block_runs[{i}]" for i in ids]
    code = (f"import sys; sys.modules[{module!r}] = None; import pytest; "
            f"sys.exit(pytest.main(['-q', '-rsf', '-p', 'no:cacheprovider', *sys.argv[1:]]))")
    return subprocess.run([sys.executable, "-c", code, *nodes], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)


def test_a_block_whose_framework_is_missing_skips_outside_ci_and_fails_under_it():
    ids = [f"{path.relative_to(ROOT)}:{line}" for path in doc_files()
           for line, code, skip in python_blocks(path) if "torchtitan" in code and not skip]
    assert ids, "no runnable docs block imports torchtitan any more: pick another framework"
    plain = _run_blocks_without("torchtitan", ids, ci=False)
    assert plain.returncode == 0, plain.stdout + plain.stderr
    assert f"{len(ids)} skipped" in plain.stdout and "needs torchtitan" in plain.stdout
    under_ci = _run_blocks_without("torchtitan", ids, ci=True)
    assert under_ci.returncode == 1, under_ci.stdout + under_ci.stderr
    assert f"{len(ids)} failed" in under_ci.stdout
    assert "imports torchtitan, which is not installed, and CI is set" in under_ci.stdout


LINK = re.compile(r"\]\(([^)#\s]+)(#[^)\s]*)?\)")


def test_relative_links_reach_files():
    missing = set()
    for path in [*doc_files(), ROOT / "CONTRIBUTING.md"]:
        for target, _ in LINK.findall(path.read_text()):
            if re.match(r"[a-z]+://", target):
                continue
            resolved = (path.parent / target).resolve()
            if not resolved.exists():
                missing.add((str(path.relative_to(ROOT)), str(resolved.relative_to(ROOT))))
    assert not missing, f"links to files that do not exist: {sorted(missing)}"
