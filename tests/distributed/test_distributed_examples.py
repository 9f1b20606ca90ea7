"""The two distributed examples run as their docstrings say: torchrun, 2 ranks, gloo, CPU."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

from test_distributed import _free_port

ROOT = Path(__file__).resolve().parent.parent.parent
pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch without distributed")


def torchrun(script, *args):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-addr", "127.0.0.1", "--master-port", str(_free_port()),
           str(ROOT / "examples" / script), *args]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_ddp_example_keeps_ranks_identical():
    out = torchrun("ddp_train.py", "--steps", "4")
    assert "step    3" in out
    assert "weights identical on every rank: True" in out


def test_fsdp2_example_saves_and_resumes(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    first = torchrun("fsdp2_train.py", "--steps", "3", "--dtype", "float16", "--ckpt", ckpt)
    assert "step    2" in first and "scale 65536" in first
    resumed = torchrun("fsdp2_train.py", "--steps", "2", "--dtype", "float16", "--ckpt", ckpt)
    assert "step    4" in resumed and "step    0" not in resumed     # went on from step 3
