"""Checks that need what a plain environment may lack (a program on the PATH, an optional
framework): skipped without it, failed without it when the environment variable CI is set,
because CI must run every check, not pass by skipping it."""
import os

import pytest


def lacking(what: str, why: str) -> None:
    """Skips the running test for want of ``what``; under CI fails it, saying ``why``."""
    if os.environ.get("CI"):
        pytest.fail(f"{why}, and CI is set", pytrace=False)
    pytest.skip(f"needs {what}")
