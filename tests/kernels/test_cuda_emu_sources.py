"""The CUDA sources stay buildable by the emulation (docs/cuda-emulation.md): every launch
goes through AMPC_LAUNCH, and no source branches on the emulation outside common.cuh."""
import glob
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SOURCES = sorted(glob.glob(os.path.join(ROOT, "csrc", "cuda", "*.cu")) +
                 glob.glob(os.path.join(ROOT, "csrc", "cuda", "*.cuh")))


def code(path):
    """The file without its comments."""
    text = open(path).read()
    return re.sub(r"/\*.*?\*/|//[^\n]*", "", text, flags=re.S)


def test_every_launch_is_ampc_launch():
    assert SOURCES
    for path in SOURCES:
        for line in code(path).splitlines():
            if "<<<" in line:
                assert os.path.basename(path) == "common.cuh" and "#define AMPC_LAUNCH" in line, \
                    f"{os.path.basename(path)}: launch without AMPC_LAUNCH: {line.strip()}"


def test_only_common_cuh_knows_the_emulation():
    for path in SOURCES:
        if os.path.basename(path) != "common.cuh":
            assert "AMPC_CUDA_EMULATION" not in code(path) and "simt" not in code(path), path
