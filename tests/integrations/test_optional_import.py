"""`import ampc` (and `import ampc.integrations`) load no framework: each integration is an
optional import of its own."""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FRAMEWORKS = ("lightning", "pytorch_lightning", "lightning_fabric", "accelerate", "transformers",
              "torchtitan")


def test_import_ampc_loads_no_framework():
    code = ("import sys, ampc, ampc.integrations\n"
            f"loaded = [m for m in {FRAMEWORKS!r} if m in sys.modules]\n"
            "print(loaded)\n"
            "assert not loaded, loaded\n")
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.strip() == "[]"


def test_a_missing_framework_is_named():
    # sys.modules[name] = None makes `import name` fail as if it were not installed
    code = ("import sys\n"
            "for name, module in (('lightning', 'lightning'), ('accelerate', 'accelerate'),\n"
            "                     ('torchtitan', 'torchtitan')):\n"
            "    sys.modules[name] = None\n"
            "    try:\n"
            "        __import__('ampc.integrations.' + module)\n"
            "    except ImportError as e:\n"
            "        assert f'ampc.integrations.{module} needs' in str(e), e\n"
            "    else:\n"
            "        raise AssertionError(module)\n"
            "print('ok')\n")
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stdout + out.stderr
