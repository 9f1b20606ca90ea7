#!/usr/bin/env bash
# Proves that one build of ampc loads and works under several torch releases without
# rebuilding: builds once (in .venv, torch 2.14.1, CUDA build), then runs the smoke
# tests against the very same libampc*.so under torch 2.14.1 and torch 2.13.0 (CPU
# build, in .venv-torch213).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
if ! .venv-torch213/bin/python -c "import torch, pytest, numpy; assert torch.__version__.startswith('2.13.0')" 2>/dev/null; then
    python3 -m venv .venv-torch213
    .venv-torch213/bin/pip install -q torch==2.13.0 pytest numpy
fi
sum_before=$(sha256sum ampc/*.so)
for py in .venv/bin/python .venv-torch213/bin/python; do
    echo "== $($py -c 'import torch; print("torch", torch.__version__)')"
    # the source tree on PYTHONPATH: the same built libraries, no install step
    # the smoke subset has no framework test, and the torch 2.13 venv has no framework
    PYTHONPATH="$PWD" $py -m pytest -q -m smoke -p no:cacheprovider --ignore=tests/integrations tests
done
[ "$sum_before" = "$(sha256sum ampc/*.so)" ] || { echo "libraries changed during the check"; exit 1; }
echo "abi check passed: one build, torch 2.14.1 and 2.13.0"
