"""What the build produced: plain C libraries on torch's stable C ABI only, the CUDA
library whenever nvcc is there, and both loaded into the running torch."""
import ctypes
import glob
import os
import re
import shutil
import subprocess

import pytest
import torch

import ampc

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LIB = os.path.join(ROOT, "ampc", "libampc.so")
CUDA_LIB = os.path.join(ROOT, "ampc", "libampc_cuda.so")
# the one list of kernels and ops that registration and the CUDA table are generated from
OPS_LIST = os.path.join(ROOT, "csrc", "api", "ampc_ops.h")
# the stable C ABI, libc/libm and the gcc runtime; nothing from ATen or c10
ALLOWED_UNDEFINED = re.compile(r"^(aoti_torch_\w+|torch_\w+|_ITM_\w+|__gmon_start__|__cxa_finalize"
                               r"|__cpu_\w+|[a-z_0-9]+@GLIBC\S*|[a-z_0-9]+@GCC\S*)$")


def symbols(path, kind):
    out = subprocess.run(["nm", "-D", kind, path], check=True, capture_output=True,
                         text=True).stdout
    return [line.split()[-1] for line in out.splitlines() if line.strip()]


needs_nm = pytest.mark.needs("nm")


def listed(kind):
    """The names of the AMPC_OP, AMPC_KERNEL or AMPC_CUDA_KERNEL entries of the list."""
    with open(OPS_LIST) as f:
        return re.findall(rf"^{kind}\((\w+),", f.read(), flags=re.M)


@pytest.mark.smoke
@needs_nm
def test_library_exports_only_its_entry_points():
    exported = [s for s in symbols(LIB, "--defined-only") if not s.startswith("_")]
    assert sorted(exported) == ["ampc_cache_bytes", "ampc_cpu_isa_name", "ampc_cuda_refusal",
                                "ampc_lean_layout", "ampc_refuse_cuda", "ampc_register", "ampc_set_cuda_api",
                                "ampc_set_cuda_emulation"]


@pytest.mark.smoke
@needs_nm
def test_library_needs_only_the_stable_abi():
    undefined = symbols(LIB, "--undefined-only")
    assert any(s.startswith("torch_library_impl") for s in undefined)
    bad = [s for s in undefined if not ALLOWED_UNDEFINED.match(s)]
    assert bad == [], f"symbols outside torch's stable C ABI: {bad}"


def test_sources_use_no_aten_cpp_api():
    banned = re.compile(r'#include\s*[<"](torch/extension\.h|ATen/|c10/|torch/library\.h)'
                        r"|at::Tensor|TORCH_LIBRARY")
    for path in glob.glob(os.path.join(ROOT, "csrc", "**", "*.*"), recursive=True):
        with open(path) as f:
            assert not banned.search(f.read()), path


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on the PATH")
def test_cuda_library_was_built_with_nvcc_present():
    # a CUDA source that does not compile fails the build; this catches a silent skip
    assert os.path.exists(CUDA_LIB)


@needs_nm
@pytest.mark.skipif(not os.path.exists(CUDA_LIB), reason="built without nvcc")
def test_cuda_library_exports_its_table_only():
    exported = [s for s in symbols(CUDA_LIB, "--defined-only") if not s.startswith("_")]
    assert exported == ["ampc_cuda_get_api"]
    torch_symbols = [s for s in symbols(CUDA_LIB, "--undefined-only")
                     if "torch" in s or s.startswith("_Z")]
    assert all(s.startswith("aoti_torch_") for s in torch_symbols), torch_symbols


@pytest.mark.smoke
def test_cuda_kernels_loaded_exactly_when_torch_has_cuda():
    expected = torch.version.cuda is not None and os.path.exists(CUDA_LIB)
    assert ampc._lib.HAS_CUDA_KERNELS == expected


@pytest.mark.smoke
def test_ops_registered_for_cpu_and_cuda():
    ops = listed("AMPC_OP")
    assert "cast" in ops and len(set(ops)) == len(ops), ops
    registered = [n.split("::")[1] for n in torch._C._dispatch_get_all_op_names()
                  if n.startswith("ampc::")]
    assert sorted(registered) == sorted(ops)
    for op in ops:
        packet = getattr(torch.ops.ampc, op)
        for key in ("CPU", "CUDA"):
            assert torch._C._dispatch_has_kernel_for_dispatch_key(packet.default.name(), key), (op, key)


# what each AMPC_ARG kind is in a schema: (type, list, written)
KINDS = {"TENSORS": ("Tensor", True, False), "TENSORS_OUT": ("Tensor", True, True),
         "OPTION": ("Tensor", True, False), "OPTION_OUT": ("Tensor", True, True),
         "TENSOR": ("Tensor", False, False), "TENSOR_OUT": ("Tensor", False, True),
         "HOST_TENSOR": ("Tensor", False, False), "FLOAT": ("float", False, False),
         "INT": ("int", False, False), "BOOL": ("bool", False, False)}
RETURNS = {"NONE": [], "TENSOR": ["Tensor"], "INT": ["int"]}


@pytest.fixture(scope="module")
def generated_readers(tmp_path_factory):
    """Each op of the list as the C preprocessor expands it for the glue: its return and its
    arguments, in the order the generated reader takes them off the stack, with the size
    of the struct it fills (a C program built against csrc/torch/call.h)."""
    src = tmp_path_factory.mktemp("readers") / "readers.c"
    src.write_text(
        '#include <stdio.h>\n#include "call.h"\n'
        "#define AMPC_ARG(kind, name, ...) "
        'printf(" %s %s %s;", #kind, #name, #__VA_ARGS__[0] ? #__VA_ARGS__ : "-");\n'
        "#define AMPC_OP(op, ret, args) "
        'printf("%s %s %zu:", #op, #ret, sizeof(struct op##_args)); args printf("\\n");\n'
        "int main(void)\n{\n#include \"ampc_ops.h\"\n    return 0;\n}\n")
    exe = src.with_suffix("")
    subprocess.run(["gcc", "-std=c11", *(f"-I{os.path.join(ROOT, 'csrc', d)}"
                                        for d in ("api", "math", "cpu", "torch")),
                    str(src), "-o", str(exe)], check=True, capture_output=True, text=True)
    ops = {}
    for line in subprocess.run([str(exe)], check=True, capture_output=True,
                               text=True).stdout.splitlines():
        head, args = line.split(":", 1)
        name, ret, size = head.split()
        ops[name] = (ret, int(size), [a.split() for a in args.split(";") if a.strip()])
    return ops


@pytest.mark.needs("gcc")
def test_generated_readers_take_each_schema_argument_in_order(generated_readers):
    # the reader of each op takes exactly the arguments of the schema torch holds, in
    # its order, each as its kind's C type, so no argument can be read from another slot
    assert sorted(generated_readers) == sorted(listed("AMPC_OP"))
    for op, (ret, size, args) in generated_readers.items():
        schema = getattr(torch.ops.ampc, op).default._schema
        assert len(args) == len(schema.arguments), op
        assert [str(r.type) for r in schema.returns] == RETURNS[ret], op
        for (kind, name, default), arg in zip(args, schema.arguments):
            kind_type, is_list, written = KINDS[kind]
            assert arg.name == name, (op, name)
            expected = f"List[{kind_type}]" if is_list else kind_type
            assert str(arg.type) == expected, (op, name, str(arg.type))
            assert (arg.alias_info is not None and arg.alias_info.is_write) == written, (op, name)
            assert (default != "-") == arg.has_default_value(), (op, name)
        assert size > 0, op


def test_op_bodies_read_no_stack_position_by_hand():
    for path in glob.glob(os.path.join(ROOT, "csrc", "torch", "ops_*.c")):
        with open(path) as f:
            assert "stack" not in f.read(), path


@pytest.mark.skipif(not ampc._lib.HAS_CUDA_KERNELS, reason="no CUDA library loaded")
def test_cuda_table_fills_every_slot_of_the_list():
    # probe, begin, end and last_error, then one launcher per kernel of the list
    kernels = listed("AMPC_KERNEL") + listed("AMPC_CUDA_KERNEL")
    assert "cast" in kernels and "fp8_gemm" in kernels, kernels
    get_api = ctypes.CDLL(CUDA_LIB).ampc_cuda_get_api   # its own handle: restype is ours
    get_api.restype = ctypes.POINTER(ctypes.c_void_p * (4 + len(kernels)))
    slots = list(get_api().contents)
    assert all(slots), slots
    assert len(set(slots)) == len(slots)
