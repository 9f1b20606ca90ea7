#!/usr/bin/env bash
# Sets up and runs ampc's main job: a small language model trained three ways (fp32,
# torch.amp, ampc's master-weight training) side by side, then the benchmarks of the
# fused ops against torch.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/python benchmarks/bench_train.py
.venv/bin/python benchmarks/bench_adam.py "$@"
.venv/bin/python benchmarks/bench_cast.py "$@"
.venv/bin/python benchmarks/bench_unscale.py "$@"
