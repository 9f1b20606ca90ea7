"""Every ```python block of docs/autoprecision.md runs on its own (each unless the line
before it is <!-- no-run: REASON -->)."""
import os
import re

import pytest

DOC = os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, "docs", "autoprecision.md")


def blocks():
    with open(DOC) as f:
        text = f.read()
    out = []
    for m in re.finditer(r"(?:^|\n)([^\n]*)\n```python\n(.*?)\n```", text, re.S):
        if not m.group(1).strip().startswith("<!-- no-run:"):
            out.append(m.group(2))
    return out


def test_the_guide_has_blocks():
    assert len(blocks()) >= 5


@pytest.mark.slow
@pytest.mark.parametrize("k", range(len(blocks())))
def test_block_runs(k, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    exec(compile(blocks()[k], f"docs/autoprecision.md block {k}", "exec"), {"__name__": "__doc__"})
