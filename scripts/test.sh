#!/usr/bin/env bash
# Sets up and runs the whole test suite (CUDA tests skip without a GPU).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/python -m pytest -q -rs "$@" tests
