"""What ``import ampc`` costs after ``import torch``: none of the heavy modules below. Dynamo
is loaded on first use of ampc.fp8 (or by torch.compile), DTensor's module by whoever makes
a DTensor. Checked in a fresh process, against the set that ``import torch`` loads by itself
(in torch 2.14.1 none of them), so that a torch that loads one does not fail the test."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HEAVY = ("torch._dynamo", "torch.distributed.tensor", "matplotlib", "transformers", "lightning",
         "accelerate", "torchtitan")

PROBE = """
import json, sys
heavy = json.loads(sys.argv[1])
import torch
torch_loads = [m for m in heavy if m in sys.modules]
import ampc
ampc_loads = [m for m in heavy if m in sys.modules]
fp8 = ampc.fp8.autocast.__module__          # the lazy attribute still works
print(json.dumps({"torch": torch_loads, "ampc": ampc_loads, "fp8": fp8,
                  "dynamo_after_fp8": "torch._dynamo" in sys.modules}))
"""


def _probe():
    out = subprocess.run([sys.executable, "-c", PROBE, json.dumps(HEAVY)], capture_output=True,
                         text=True, timeout=300, cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT))
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.smoke
def test_import_ampc_loads_no_heavy_module_beyond_torchs_own():
    got = _probe()
    assert got["ampc"] == got["torch"], f"import ampc loaded {set(got['ampc']) - set(got['torch'])}"
    assert got["fp8"] == "ampc.fp8.autocast_mode"
    assert got["dynamo_after_fp8"]      # the probe sees a module appear when it is imported
