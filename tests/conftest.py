import os
import shutil
import sys

import pytest
import torch

# the shared helpers (reference.py) sit here, above the per-area folders; a few tests take
# helpers from another area's test file (fp8's distributed tests from test_distributed.py),
# so every area folder is importable whichever folders a run collects
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [_HERE] + sorted(os.path.join(_HERE, d) for d in os.listdir(_HERE)
                                if os.path.isdir(os.path.join(_HERE, d)) and d[0] not in "_.")

from optional import lacking  # noqa: E402  (tests/ is on the path from the line above)


def pytest_configure(config):
    config.addinivalue_line("markers", "needs(tool): needs this program on the PATH; skipped without it, "
                                       "failed without it when the environment variable CI is set")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


def pytest_runtest_setup(item):
    for mark in item.iter_markers("needs"):
        tool = mark.args[0]
        if shutil.which(tool) is None:
            lacking(tool, f"{tool} is not on the PATH")
