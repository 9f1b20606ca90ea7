#!/usr/bin/env bash
# Sets up and runs ampc's main job: for now the benchmarks of the fused ops against torch.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/python benchmarks/bench_cast.py "$@"
.venv/bin/python benchmarks/bench_unscale.py "$@"
