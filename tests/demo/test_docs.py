"""Every ```python block of README.md and docs/*.md runs alone, in a fresh interpreter after a
plain ``import ampc`` (docs_block.py, which also holds the stand-ins for the names a snippet
leaves to the reader), so a public name works for a reader, not only after another test
imported its module.
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

from docs_block import MISSING, python_blocks
from optional import lacking

ROOT = Path(__file__).resolve().parents[2]
RUNNER = Path(__file__).with_name("docs_block.py")


def doc_files():
    return [p for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
            if p.is_file()]


def _cases():
    cases = []
    for path in doc_files():
        for line, _, skip in python_blocks(path):
            marks = [pytest.mark.skip(reason=skip)] if skip else []
            name = f"{path.relative_to(ROOT)}:{line}"
            cases.append(pytest.param(path, line, id=name, marks=marks))
    return cases


def test_docs_have_python_blocks():
    assert any(python_blocks(p) for p in doc_files())


def test_no_run_marker_is_read(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("text\n\n<!-- no-run: needs a GPU -->\n```python\nx = 1\n```\n\n"
                    "```python\ny = 2\n```\n```bash\nz\n```\n")
    assert python_blocks(page) == [(5, "x = 1\n", "needs a GPU"), (9, "y = 2\n", None)]


@pytest.mark.parametrize("path, line", _cases())
def test_block_runs(path, line, tmp_path):
    # a module this interpreter is kept from importing (None in sys.modules) the block's is too
    blocked = [m for m, v in sys.modules.items() if v is None]
    where = f"{path.relative_to(ROOT)}:{line}"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]))
    out = subprocess.run([sys.executable, str(RUNNER), str(path), str(line), *blocked],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    if out.returncode == MISSING:
        top = out.stdout.strip().splitlines()[-1]
        lacking(top, f"{where} imports {top}, which is not installed")
    assert out.returncode == 0, f"{where}:\n{out.stdout[-3000:]}{out.stderr[-3000:]}"


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
