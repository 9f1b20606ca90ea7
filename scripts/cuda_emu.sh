#!/usr/bin/env bash
# cuda_emu.sh: builds the CUDA emulation under ASan/UBSan (scripts/build_cuda_emu.sh) and
# runs tests/kernels/test_cuda_emu.py through it: on the H200 in forward, reversed and
# shuffled thread order, then on the sm80 device (4 KB tables). Every run must pass.
#
# Usage: bash scripts/cuda_emu.sh [pytest args...]     (PYTHON: the interpreter, default .venv)
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-.venv/bin/python}
if ! command -v "${CXX:-g++}" >/dev/null; then
    echo "cuda_emu: g++ is needed to build the emulation: skipped"
    [ -z "${CI:-}" ] || { echo "cuda_emu: CI is set, and CI must run it"; exit 1; }
    exit 0
fi
bash scripts/build_cuda_emu.sh
# Python is not built with ASan: its runtime goes first, and libstdc++ with it, so that
# ASan finds the C++ runtime torch throws through
export LD_PRELOAD="$(gcc -print-file-name=libasan.so) $(gcc -print-file-name=libstdc++.so)"
export ASAN_OPTIONS=detect_leaks=0:abort_on_error=1
export UBSAN_OPTIONS=print_stacktrace=1
export AMPC_CUDA_EMU=$PWD/build/emu/libampc_cuda_emu.so
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
for run in forward:h200 reverse:h200 shuffle:h200 shuffle:sm80; do
    echo "== CUDA emulation: ${run%%:*} thread order, ${run##*:}"
    AMPC_EMU_ORDER=${run%%:*} AMPC_EMU_DEVICE=${run##*:} AMPC_EMU_SEED=$RANDOM \
        "$py" -m pytest -q -p no:cacheprovider --capture=sys tests/kernels/test_cuda_emu.py "$@"
done
