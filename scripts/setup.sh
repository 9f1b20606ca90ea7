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
# The frameworks that ampc.integrations plugs into, for tests/integrations: releases that keep
# torch 2.14.1. torchtitan's own dependencies (datasets, wandb, ...) would move huggingface_hub
# below what transformers 5.24 needs, so it goes in without them, with the few its converter
# and optimizer modules import (tyro, spmd_types, einops).
if ! .venv/bin/python -c "import lightning, accelerate, torchtitan" 2>/dev/null; then
    .venv/bin/pip install -q lightning==2.6.6 accelerate==1.15.0 tyro==1.0.17 spmd_types==0.2.3 \
        einops==0.8.2
    .venv/bin/pip install -q --no-deps torchtitan==0.3.0
fi
# No build isolation: the build needs only setuptools, and isolation could pull a torch.
# Skipped where this tree is installed already and its libraries are newer than every C, CUDA
# and build file (pip would build them again: about 80 s on 2 cores); AMPC_REBUILD=1 forces it.
built() {
    [ -f ampc/libampc.so ] || return 1
    if command -v nvcc >/dev/null && [ "${AMPC_NO_CUDA:-0}" != 1 ]; then
        [ -f ampc/libampc_cuda.so ] || return 1
    fi
    [ -z "$(find csrc setup.py pyproject.toml -newer ampc/libampc.so -print -quit)" ] || return 1
    # -I: the installed ampc, not the one in the working directory
    .venv/bin/python -I -c "import sys, ampc; sys.exit(ampc.__file__ != sys.argv[1])" \
        "$PWD/ampc/__init__.py" 2>/dev/null
}
if [ "${AMPC_REBUILD:-0}" = 1 ] || ! built; then
    .venv/bin/pip install -q --no-build-isolation --no-deps -e .
fi
