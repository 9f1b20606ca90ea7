"""Accelerate keeps one process-wide state: no test here leaves its own behind (a later
Accelerator with another mixed precision, in another test file or a docs block, would be
refused)."""
import pytest


@pytest.fixture(autouse=True)
def fresh_accelerate_state():
    yield
    try:
        from accelerate.state import AcceleratorState, GradientState
    except ImportError:
        return
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
