#!/usr/bin/env bash
# Sets up .venv (torch 2.14.1, pytest, numpy, tqdm, matplotlib, torchvision, transformers) and
# builds ampc into it from source.
# Idempotent: a second run only rebuilds what changed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
if ! .venv/bin/python -c "import torch, pytest, numpy; assert torch.__version__.startswith('2.14.1')" 2>/dev/null; then
    .venv/bin/pip install -q torch==2.14.1 pytest numpy
fi
# The demo's progress bars and pictures (both optional for the library itself).
if ! .venv/bin/python -c "import tqdm, matplotlib" 2>/dev/null; then
    .venv/bin/pip install -q tqdm==4.70.1 matplotlib==3.11.2
fi
# Real models for the autocast tests (a fresh-config transformers model, torchvision's ResNet-18);
# torchvision 0.29.1 is the release built against torch 2.14.1, so pip keeps that torch.
if ! .venv/bin/python -c "import torchvision, transformers" 2>/dev/null; then
    .venv/bin/pip install -q torchvision==0.29.1 transformers==5.24.0
fi
# No build isolation: the build needs only setuptools, and isolation could pull a torch.
.venv/bin/pip install -q --no-build-isolation --no-deps -e .
