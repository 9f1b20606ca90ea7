#!/usr/bin/env bash
# Sets up and runs ampc's main job (python -m ampc.demo): a small GPT (4,096-piece vocabulary) trained on
# Python's standard library with fp32, torch.amp, the ampc drop-in, ampc master weights and
# the per-module plans of ampc.autoprecision for speed and for memory and the lean state
# (state="lean") side by side, each with its step time, peak memory and state bytes a
# parameter, checked against fp32, in under
# three minutes on any machine.
# Flags go to the demo (--device, --dtype, --steps, --size, --budget, --out; --help).
# The op benchmarks are in benchmarks/ (see docs/benchmarks.md).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/python -m ampc.demo "$@"
