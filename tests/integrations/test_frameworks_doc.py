"""Every python block of docs/frameworks.md runs, each in a fresh process (the frameworks keep
process-wide state), unless the line before it says `<!-- no-run: why -->`."""
import os
import re
import subprocess
import sys

import pytest

from integration_helpers import need

for module in ("lightning", "accelerate", "transformers", "torchtitan"):
    need(module)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DOC = os.path.join(ROOT, "docs", "frameworks.md")


def _blocks():
    text = open(DOC).read()
    found = []
    for m in re.finditer(r"(?P<before>[^\n]*)\n```python\n(?P<code>.*?)\n```", text, re.S):
        line = text.count("\n", 0, m.start("code")) + 1
        if not m.group("before").startswith("<!-- no-run:"):
            found.append(pytest.param(m.group("code"), id=f"line{line}"))
    return found


BLOCKS = _blocks()


def test_the_page_has_its_blocks():
    assert len(BLOCKS) == 6


@pytest.mark.parametrize("code", BLOCKS)
def test_block_runs(code, tmp_path):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
