"""csrc/torch/torch_shim.h redeclares, in C, the stable-ABI functions ampc calls. This test
compiles it together with torch's real (C++) shim headers: a prototype that drifted
from torch's is a "conflicting declaration" error. A deliberately wrong prototype
checks that the test can fail."""
import os
import subprocess

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TORCH_INCLUDE = os.path.join(os.path.dirname(torch.__file__), "include")

pytestmark = [
    pytest.mark.smoke,
    pytest.mark.needs("g++"),
]


def compile_against_torch(tmp_path, extra=""):
    src = tmp_path / "check.cpp"
    src.write_text(
        "#include <torch/csrc/inductor/aoti_torch/c/shim.h>\n"
        "#include <torch/csrc/stable/c/shim.h>\n"
        "#include <torch/csrc/inductor/aoti_torch/generated/c_shim_aten.h>\n"
        '#include "torch_shim.h"\n' + extra)
    return subprocess.run(
        ["g++", "-std=c++17", "-fsyntax-only", "-DUSE_CUDA", "-I", TORCH_INCLUDE,
         "-I", os.path.join(ROOT, "csrc", "torch"), str(src)],
        capture_output=True, text=True)


def test_declarations_match_torch_headers(tmp_path):
    result = compile_against_torch(tmp_path)
    assert result.returncode == 0, result.stderr[-4000:]


def test_a_drifted_declaration_fails_to_compile(tmp_path):
    wrong = 'extern "C" AOTITorchError aoti_torch_get_numel(AtenTensorHandle tensor, int32_t *n);\n'
    result = compile_against_torch(tmp_path, wrong)
    assert result.returncode != 0
    assert "aoti_torch_get_numel" in result.stderr
