#!/usr/bin/env bash
# cuda_emu.sh: builds the CUDA emulation under ASan/UBSan (scripts/build_cuda_emu.sh) and
# runs tests/kernels/test_cuda_emu.py through it: on the H200 in forward, reversed and
# shuffled thread order, then on the sm80 device (4 KB tables), two runs at a time
# (JOBS), each to build/emu/run-*.log. Every run must pass.
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
# two runs at a time (CI has two cores), each to its log, printed in order
runs="forward:h200 reverse:h200 shuffle:h200 shuffle:sm80"
failed=0
one() {
    AMPC_EMU_ORDER=${1%%:*} AMPC_EMU_DEVICE=${1##*:} AMPC_EMU_SEED=$2 \
        "$py" -m pytest -q -p no:cacheprovider --capture=sys tests/kernels/test_cuda_emu.py \
        "${@:3}" >"build/emu/run-${1/:/-}.log" 2>&1
}
pending=()
for run in $runs; do
    seed=$RANDOM
    one "$run" "$seed" "$@" &
    pending+=("$run:$seed:$!")
    if [ ${#pending[@]} -eq "${JOBS:-2}" ] || [ "$run" = "${runs##* }" ]; then
        for p in "${pending[@]}"; do
            IFS=: read -r order device seed pid <<<"$p"
            echo "== CUDA emulation: $order thread order (seed $seed), $device"
            if wait "$pid"; then
                tail -n 2 "build/emu/run-$order-$device.log"
            else
                cat "build/emu/run-$order-$device.log"
                failed=1
            fi
        done
        pending=()
    fi
done
[ "$failed" -eq 0 ] || { echo "cuda_emu: FAILED"; exit 1; }
echo "cuda_emu: ok"
