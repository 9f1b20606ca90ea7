"""ampc.policy: the default tables, reading and changing policies, user functions and custom
ops, scopes (as a context and as a module property), the keep-dtype norm policy, the table,
and the overflow locator."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ampc
from ampc import policy
from ampc.policy import CastPolicy as P

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


@pytest.fixture(autouse=True)
def clean_registry():
    yield
    policy.reset()


# ---- defaults ----

def test_policy_defaults_follow_torch_lists():
    assert policy.get_policy("layer_norm", "cuda") is P.FP32
    assert policy.get_policy("layer_norm", "cpu") is P.PASSTHROUGH      # not on torch's CPU list
    assert policy.get_policy(F.layer_norm, "cuda") is P.FP32            # callables resolve too
    assert policy.get_policy(torch.Tensor.softmax, "cuda") is P.FP32_SET_OPT_DTYPE
    assert policy.get_policy(torch.norm, "cuda") is P.FP32_APPEND_DTYPE
    assert policy.get_policy("aten::pow.Tensor_Scalar", "cuda") is P.FP32
    assert policy.get_policy(torch.ops.aten.mm, "cpu") is P.LOWER_PRECISION_FP
    assert policy.get_policy("cat", "cpu") is P.PROMOTE and policy.get_policy("cat", "cuda") is P.PASSTHROUGH
    assert policy.get_policy("binary_cross_entropy", "cuda") is P.BANNED
    assert policy.get_policy("binary_cross_entropy", "cpu") is P.FP32
    assert policy.get_policy(F.cross_entropy, "cpu") is P.FP32             # cross_entropy_loss
    # one name per Python-level op: torch's 126 CUDA registrations less 15 overloads of ops
    # listed already (pow, prod, sum, softmax, ...), its 129 CPU ones less 14
    assert len(policy.DEFAULTS["cuda"]) == 111 and len(policy.DEFAULTS["cpu"]) == 115


def test_a_python_name_reaches_the_aten_op_it_calls():
    # F.cross_entropy runs aten's cross_entropy_loss: a policy or a scope set under the
    # Python name must change what the call does (it used to be kept, and ignored)
    x, t = torch.randn(4, 10), torch.randint(0, 10, (4,))
    assert policy.op_name("cross_entropy") == "cross_entropy_loss"
    assert policy.op_name("__matmul__") == "matmul"
    with ampc.autocast("cpu", dtype=torch.bfloat16):
        assert F.cross_entropy(x, t).dtype == torch.float32
        with policy.scope(ops={"cross_entropy": "lower_precision_fp"}):
            assert F.cross_entropy(x, t).dtype == torch.bfloat16
    policy.set_policy("cross_entropy", "lower_precision_fp", "cpu")
    assert policy.get_policy(F.cross_entropy, "cpu") is P.LOWER_PRECISION_FP
    with ampc.autocast("cpu", dtype=torch.bfloat16):
        assert F.cross_entropy(x, t).dtype == torch.bfloat16


def test_policy_table_prints_every_op(capsys):
    policy.print_table("cpu")
    assert capsys.readouterr().out == policy.table("cpu") + "\n"
    text = policy.table()
    assert "layer_norm" in text and "fp32_set_opt_dtype" in text
    policy.set_policy("gelu", "fp32", "cpu")
    line = next(ln for ln in policy.table("cpu").splitlines() if ln.startswith("gelu "))
    assert line.split()[1] == "fp32*"


# ---- changing policies ----

def test_set_policy_per_device_and_globally():
    x = torch.randn(4, 4)
    policy.set_policy(torch.mm, "fp32", "cpu")
    assert policy.get_policy("mm", "cpu") is P.FP32 and policy.get_policy("mm", "cuda") is P.LOWER_PRECISION_FP
    with ampc.autocast("cpu"):
        assert torch.mm(x, x).dtype is FP32 and torch.mm(x.bfloat16(), x).dtype is FP32
    policy.set_policy("mm", None, "cpu")
    with ampc.autocast("cpu"):
        assert torch.mm(x, x).dtype is BF16
    policy.set_policy(F.gelu, "lower_precision_fp")                     # all devices
    assert policy.get_policy("gelu", "cuda") is P.LOWER_PRECISION_FP
    with ampc.autocast("cpu"):
        y = F.gelu(x)
    assert y.dtype is BF16 and torch.equal(y, F.gelu(x.bfloat16()))


def test_passthrough_undoes_a_default():
    x = torch.randn(4, 4)
    policy.set_policy("mm", "passthrough", "cpu")
    with ampc.autocast("cpu"):
        assert torch.mm(x, x).dtype is FP32
    assert policy.get_policy("mm", "cpu") is P.PASSTHROUGH


def test_banned_op_raises_torchs_message():
    policy.set_policy("binary_cross_entropy", "banned", "cpu")
    p = torch.rand(4)
    with ampc.autocast("cpu"), pytest.raises(RuntimeError, match="are unsafe to autocast"):
        F.binary_cross_entropy(p, p)
    F.binary_cross_entropy(p, p)                     # fine outside


def test_registry_errors_name_the_function_and_argument():
    with pytest.raises(ValueError, match=r"ampc.policy.set_policy: policy must be one of"):
        policy.set_policy("mm", "half")
    with pytest.raises(ValueError, match=r"ampc.policy.get_policy: device_type must be one of"):
        policy.get_policy("mm", "tpu")
    with pytest.raises(ValueError, match=r"is not an op the registry knows"):
        policy.get_policy(lambda x: x, "cpu")
    with pytest.raises(TypeError, match=r"ampc.policy.register: fn must be callable"):
        policy.register(3, policy="fp32")
    with pytest.raises(ValueError, match=r"ampc.policy.scope: dtype must be"):
        policy.scope(dtype=torch.float64)
    with pytest.raises(TypeError, match=r"ampc.policy.module_scope: module must be"):
        policy.module_scope("block", dtype=FP32)


# ---- user functions and custom ops ----

def test_register_user_function():
    seen = []

    @policy.register(policy="lower_precision_fp", device_type="cpu")
    def my_matmul(a, b):
        seen.append((a.dtype, b.dtype))
        return a @ b

    x = torch.randn(4, 4)
    assert my_matmul(x, x).dtype is FP32                  # outside autocast: untouched
    with ampc.autocast("cpu"):
        assert my_matmul(x, x).dtype is BF16
    assert seen == [(FP32, FP32), (BF16, BF16)]
    assert policy.get_policy(my_matmul, "cpu") is P.LOWER_PRECISION_FP
    assert policy.get_policy(my_matmul, "cuda") is P.PASSTHROUGH
    name = "test_policy.test_register_user_function.<locals>.my_matmul"
    policy.set_policy(name, "fp32", "cpu")                # its name, dots and all
    with ampc.autocast("cpu"):
        assert my_matmul(x, x.bfloat16()).dtype is FP32


_lib = torch.library.Library("ampc_test_policy", "DEF")
_lib.define("scale2(Tensor x) -> Tensor")
_lib.impl("scale2", lambda x: x * 2, "CompositeExplicitAutograd")


def test_register_custom_op():
    op = torch.ops.ampc_test_policy.scale2
    policy.register(op, policy="fp32", device_type="cpu")
    assert policy.get_policy("ampc_test_policy::scale2", "cpu") is P.FP32
    with ampc.autocast("cpu"):
        assert op(torch.ones(3, dtype=BF16)).dtype is FP32
        assert op.default(torch.ones(3, dtype=BF16)).dtype is FP32


# ---- scopes ----

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        self.seen = []
        h = self.body(x)
        self.seen.append(h.dtype)
        return self.head(h)


def test_scope_context_keeps_a_region_in_fp32():
    x = torch.randn(2, 8)
    with ampc.autocast("cpu"):
        with policy.scope(dtype=FP32):
            assert torch.mm(x, x.t()).dtype is FP32
            with policy.scope(ops={"mm": "passthrough"}):
                assert torch.mm(x.bfloat16(), x.t().bfloat16()).dtype is BF16
            with policy.scope(dtype=FP16):                # inner scope wins
                assert torch.mm(x, x.t()).dtype is FP16
        with policy.scope(enabled=False):
            assert torch.mm(x, x.t()).dtype is FP32
            with policy.scope(enabled=True):
                assert torch.mm(x, x.t()).dtype is BF16
        assert torch.mm(x, x.t()).dtype is BF16
    assert policy.current_scope() is None


def test_module_scope_keeps_block_in_fp32_and_runs_head_in_other_dtype():
    torch.manual_seed(0)
    net, x = Net(), torch.randn(2, 8)
    h1 = policy.module_scope(net.body, dtype=FP32)
    h2 = policy.module_scope(net.head, dtype=FP16)
    assert policy.module_scope_of(net.body).dtype is FP32
    with ampc.autocast("cpu"):
        out = net(x.bfloat16())                          # a bf16 input is cast to fp32 on entry
    assert net.seen == [FP32] and out.dtype is FP16
    with torch.autocast("cpu", enabled=False):
        want = net.body(x.bfloat16().float())
    assert torch.equal(net.body(x.bfloat16().float()), want)
    out.float().sum().backward()
    assert all(p.grad.dtype is FP32 for p in net.parameters())
    h1.remove()
    h2.remove()
    assert policy.module_scope_of(net.body) is None
    with ampc.autocast("cpu"):
        assert net(x).dtype is BF16 and net.seen == [BF16]


def test_module_scope_does_nothing_outside_autocast():
    net, x = Net(), torch.randn(2, 8)
    policy.module_scope(net.body, dtype=FP16)
    assert net(x).dtype is FP32 and net.seen == [FP32]


# ---- fp32 compute, input dtype out ----

def test_fp32_keep_dtype_norm_returns_input_dtype():
    ln = nn.LayerNorm(64)
    x = torch.randn(4, 64, dtype=BF16, requires_grad=True)
    with ampc.autocast("cpu"), policy.scope(ops={"layer_norm": "fp32_keep_dtype"}):
        y = ln(x)
    assert y.dtype is BF16
    want = F.layer_norm(x.detach().float(), (64,), ln.weight.detach(), ln.bias.detach()).to(BF16)
    assert torch.equal(y.detach(), want)
    y.float().sum().backward()
    assert x.grad.dtype is BF16 and ln.weight.grad.dtype is FP32
    policy.set_policy("layer_norm", "fp32")
    with ampc.autocast("cpu"):
        assert ln(x).dtype is FP32                      # the plain fp32 policy doubles the bytes


# ---- the overflow locator ----

class Overflow(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(4, 4), nn.Linear(4, 4)
        with torch.no_grad():
            self.fc2.weight.fill_(300.0)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)) + 100.0)


def test_check_finite_names_the_op_and_module():
    model, x = Overflow(), torch.randn(2, 4)
    with ampc.autocast("cpu", dtype=FP16):
        assert not torch.isfinite(model(x)).all()            # off by default: inf flows on
    with ampc.autocast("cpu", dtype=FP16, check_finite=True), \
            pytest.raises(FloatingPointError, match=r"linear returned a non-finite torch.float16 value "
                                                    r"from finite inputs, in module Overflow.fc2"):
        model(x)
    with ampc.autocast("cpu", dtype=BF16, check_finite=True):
        assert torch.isfinite(model(x)).all()                # bf16 has the range


def test_scopes_are_per_thread():
    import threading
    seen = []
    x = torch.randn(2, 8)

    def worker():
        with ampc.autocast("cpu"):
            seen.append(torch.mm(x, x.t()).dtype)

    with ampc.autocast("cpu"), policy.scope(dtype=FP32):
        t = threading.Thread(target=worker)
        t.start()
        t.join()
        assert torch.mm(x, x.t()).dtype is FP32
    assert seen == [BF16]
