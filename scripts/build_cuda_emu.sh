#!/usr/bin/env bash
# build_cuda_emu.sh: builds the CUDA emulation library, build/emu/libampc_cuda_emu.so, from
# the same csrc/cuda/*.cu as the real one (all but fp8_gemm.cu, which is cuBLASLt's), as
# host C++ against csrc/cuda/emu (docs/cuda-emulation.md). No nvcc, no GPU: g++ only.
#
# Under AddressSanitizer and UndefinedBehaviorSanitizer, every finding fatal; no FP
# contraction (the --fmad=false of the real build). Load it into a Python that has
# `gcc -print-file-name=libasan.so` in LD_PRELOAD (scripts/cuda_emu.sh does).
# Rebuilds only when a source is newer than the library. SANITIZE=0 builds without the
# sanitizers (faster, for a quick look; CI always sanitizes).
set -euo pipefail
cd "$(dirname "$0")/.."
CXX=${CXX:-g++}
sanitize=${SANITIZE:-1}
out=build/emu/libampc_cuda_emu.so
[ "$sanitize" = 0 ] && out=build/emu/libampc_cuda_emu_nosan.so
out=${EMU_LIB:-$out}        # another place, for a second build beside the first
sources=$(ls csrc/cuda/*.cu | grep -v fp8_gemm.cu)
deps="$sources csrc/cuda/*.cuh csrc/cuda/emu/* csrc/api/*.h csrc/math/*.h csrc/torch/torch_shim.h scripts/build_cuda_emu.sh"
if [ -f "$out" ] && [ -z "$(find $deps -newer "$out" 2>/dev/null)" ]; then
    echo "$out is up to date"
    exit 0
fi
flags=(-std=c++17 -O1 -g -fPIC -fvisibility=hidden -ffp-contract=off -fno-math-errno
       -DAMPC_CUDA_EMULATION -Icsrc/cuda/emu -Icsrc/api -Icsrc/math -Icsrc/torch -include simt.h
       -Wall -Wno-unknown-pragmas -Wno-unused-function)
[ "$sanitize" = 0 ] || flags+=(-fsanitize=address,undefined -fno-sanitize-recover=all
                               -fno-omit-frame-pointer)
objdir=build/emu/obj/$(basename "$out" .so)
mkdir -p "$objdir" "$(dirname "$out")"
objects=()
pids=()
for src in $sources csrc/cuda/emu/*.cpp; do
    obj=$objdir/$(basename "$src").o
    objects+=("$obj")
    "$CXX" "${flags[@]}" -x c++ -c "$src" -o "$obj" &
    pids+=($!)
done
for p in "${pids[@]}"; do wait "$p"; done
"$CXX" "${flags[@]}" -shared -o "$out.tmp" "${objects[@]}" -lpthread
mv "$out.tmp" "$out"
echo "built $out"
