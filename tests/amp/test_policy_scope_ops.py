"""A scope's ``ops`` are honoured for every op the policy knows, or refused by name.

A scope's op policies are applied by autocast's mode, which sees Python-level calls only; an
op nothing had indexed yet (batch_norm: on no default list) used to be ignored in silence, and
an op with no Python-level call at all (it runs only inside another op's C++ code) cannot be
seen, so the scope must refuse it."""
import re
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ampc
from ampc import policy
from ampc._walk import tensors

BF16, FP32 = torch.bfloat16, torch.float32


@pytest.fixture(autouse=True)
def clean_registry():
    yield
    policy.reset()


def _bn_net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4))


def test_scope_ops_batch_norm_is_honoured_inside_autocast():
    net, x = _bn_net(), torch.randn(2, 3, 5, 5)
    with ampc.autocast("cpu"):
        assert net(x).dtype is BF16                          # default: the conv's dtype
        with policy.scope(ops={"batch_norm": "fp32"}):
            assert net(x).dtype is FP32
        with policy.scope(ops={F.batch_norm: "fp32"}):       # the callable names it too
            assert net(x).dtype is FP32
        h = net[0](x)
        with policy.scope(ops={"batch_norm": "fp32"}):
            y = F.batch_norm(h, torch.zeros(4), torch.ones(4))
        assert h.dtype is BF16 and y.dtype is FP32
        net.eval()
        with policy.scope(ops={"batch_norm": "fp32"}):
            assert net(x).dtype is FP32
    want = F.batch_norm(h.float(), torch.zeros(4), torch.ones(4))
    assert torch.equal(y, want)


def test_scope_ops_batch_norm_opened_outside_autocast():
    net, x = _bn_net(), torch.randn(2, 3, 5, 5)
    with policy.scope(ops={"batch_norm": "fp32"}):
        assert net(x).dtype is FP32
        with ampc.autocast("cpu"):
            assert net(x).dtype is FP32


def test_module_scope_ops_batch_norm():
    net, x = _bn_net(), torch.randn(2, 3, 5, 5)
    handle = policy.module_scope(net[1], ops={"batch_norm": "fp32"})
    for mode in (net.train, net.eval):
        mode()
        with ampc.autocast("cpu"):
            assert net(x).dtype is FP32
    handle.remove()
    with ampc.autocast("cpu"):
        assert net(x).dtype is BF16


def test_scope_lowers_batch_norm_as_a_search_measures_it():
    # the unit search scopes a norm to 16 bits with ops={"batch_norm": "lower_precision_fp"};
    # ignored, it measured BatchNorm's 16-bit error as exactly 0
    net, x = _bn_net(), torch.randn(2, 3, 5, 5)
    with ampc.autocast("cpu"), policy.scope(dtype=FP32):
        assert net(x).dtype is FP32
        with policy.scope(dtype=BF16, ops={"batch_norm": "lower_precision_fp"}):
            y = net[1](net[0](x).float())
    assert y.dtype is BF16


def test_table_lists_batch_norm():
    rows = {ln.split()[0]: ln.split()[1:] for ln in policy.table().splitlines()[1:-1]}
    assert rows["batch_norm"] == ["passthrough", "passthrough"]
    policy.set_policy("batch_norm", "fp32", "cpu")
    assert policy.table("cpu").count("\nbatch_norm ") == 1
    assert "fp32*" in next(ln for ln in policy.table("cpu").splitlines() if ln.startswith("batch_norm "))


@pytest.mark.parametrize("name", ["_thnn_fused_lstm_cell", "_thnn_fused_gru_cell",
                                  "multilabel_margin_loss_forward", "no_such_op",
                                  "nosuchlib::foo"])
def test_scope_refuses_an_op_it_cannot_see(name):
    with pytest.raises(ValueError, match=rf"ampc.policy.scope: ops\['{re.escape(name)}'\]: "
                                         rf"'{re.escape(name)}' has no Python-level call"):
        policy.scope(ops={name: "fp32"})
    with pytest.raises(ValueError, match=r"ampc.policy.scope: ops\["):
        policy.module_scope(nn.Linear(2, 2), ops={name: "fp32"})
    assert policy.current_scope() is None


_lib = torch.library.Library("ampc_test_scope_ops", "DEF")
_lib.define("twice(Tensor x) -> Tensor")
_lib.impl("twice", lambda x: x * 2, "CompositeExplicitAutograd")


def test_scope_honours_a_custom_op_never_registered():
    x = torch.ones(3)
    for key in ("ampc_test_scope_ops::twice", torch.ops.ampc_test_scope_ops.twice):
        with ampc.autocast("cpu"), policy.scope(ops={key: "lower_precision_fp"}):
            assert torch.ops.ampc_test_scope_ops.twice(x).dtype is BF16
            assert torch.ops.ampc_test_scope_ops.twice.default(x).dtype is BF16


# ---- the audit: every op the policy knows ----

_NAMESPACES = (F, torch, torch._C._nn, torch._C._linalg, torch._C._fft, torch._C._special,
               torch.Tensor)


def _callable_of(name):
    """A Python-level callable that autocast's mode knows by ``name``, or None."""
    for ns in _NAMESPACES:
        fn = getattr(ns, name, None)
        if callable(fn) and policy.FUNCS.get(fn) == name:
            return fn
    return None


def _spd():
    a = torch.randn(4, 4)
    return a @ a.T + 4 * torch.eye(4)


def _m(*shape):
    return torch.randn(*shape)


# argument lists tried in turn; the first that runs in fp32 outside autocast is the sample
_GENERIC = [lambda: (_spd(),), lambda: (_spd(), _spd()), lambda: (_spd(), _spd(), _spd()),
            lambda: (_m(2, 3, 4, 4),), lambda: (_m(2, 3, 4, 4), _m(2, 3, 4, 4)),
            lambda: (_m(4, 4), torch.tensor([0, 2, 1, 3])), lambda: (_m(2, 3, 8),),
            lambda: (_m(2, 3, 4, 4, 4),), lambda: (_m(4, 4), _m(4, 4), 2.0),
            lambda: (_m(4), _m(4)), lambda: ([_m(4), _m(4)],),
            lambda: (_m(2, 3, 8), _m(3, 3, 1)), lambda: (_m(2, 3, 4, 4), _m(3, 3, 1, 1)),
            lambda: (_m(2, 3, 4, 4, 4), _m(3, 3, 1, 1, 1)),
            lambda: (_m(4, 4), _m(4, 4), _m(4, 4), 0.5)]
# ops none of those fit
_SAMPLES = {
    "batch_norm": lambda: (_m(2, 3, 4), torch.zeros(3), torch.ones(3)),
    "layer_norm": lambda: (_m(2, 8), (8,)), "rms_norm": lambda: (_m(2, 8), (8,)),
    "group_norm": lambda: (_m(2, 4, 3), 2), "native_layer_norm": lambda: (_m(2, 8), (8,), None, None, 1e-5),
    "bmm": lambda: (_m(2, 3, 3), _m(2, 3, 3)), "baddbmm": lambda: (_m(2, 3, 3), _m(2, 3, 3), _m(2, 3, 3)),
    "addbmm": lambda: (_m(3, 3), _m(2, 3, 3), _m(2, 3, 3)), "mv": lambda: (_m(3, 3), _m(3)),
    "addmv": lambda: (_m(3), _m(3, 3), _m(3)), "addr": lambda: (_m(3, 3), _m(3), _m(3)),
    "einsum": lambda: ("ij,jk->ik", _m(3, 3), _m(3, 3)),
    "cumsum": lambda: (_m(4), 0), "cumprod": lambda: (_m(4), 0), "logsumexp": lambda: (_m(4), 0),
    "prelu": lambda: (_m(2, 3), torch.full((1,), 0.25)),
    "bilinear": lambda: (_m(2, 3), _m(2, 3), _m(4, 3, 3)),
    "scatter_add": lambda: (_m(4), 0, torch.tensor([0, 1, 1, 3]), _m(4)),
    "index_copy": lambda: (_m(4), 0, torch.tensor([0, 2]), _m(2)),
    "index_put": lambda: (_m(4), (torch.tensor([0, 2]),), _m(2)),
    "renorm": lambda: (_m(3, 3), 2, 0, 1.0),
    "cosine_embedding_loss": lambda: (_m(2, 3), _m(2, 3), torch.tensor([1.0, -1.0])),
    "multilabel_margin_loss": lambda: (_m(2, 3), torch.tensor([[0, 1, -1], [2, -1, 0]])),
    "nll_loss2d": lambda: (_m(2, 3, 4, 4), torch.zeros(2, 4, 4, dtype=torch.long)),
    "quantile": lambda: (_m(8), 0.5), "nanquantile": lambda: (_m(8), 0.5),
    "polar": lambda: (_m(3).abs(), _m(3)),
    "view_as_complex": lambda: (_m(3, 2),),
    "mkldnn_rnn_layer": None, "ctc_loss": None, "cholesky": None, "qr": None,
    "lstm_cell": lambda: (_m(2, 3), (_m(2, 4), _m(2, 4)), _m(16, 3), _m(16, 4)),
    "gru_cell": lambda: (_m(2, 3), _m(2, 4), _m(12, 3), _m(12, 4)),
    "rnn_tanh_cell": lambda: (_m(2, 3), _m(2, 4), _m(4, 3), _m(4, 4)),
    "rnn_relu_cell": lambda: (_m(2, 3), _m(2, 4), _m(4, 3), _m(4, 4)),
    "upsample_nearest1d": lambda: (_m(1, 2, 4), [8]), "upsample_nearest2d": lambda: (_m(1, 2, 4, 4), [8, 8]),
    "upsample_nearest3d": lambda: (_m(1, 2, 4, 4, 4), [8, 8, 8]),
    "_upsample_nearest_exact1d": lambda: (_m(1, 2, 4), [8]),
    "_upsample_nearest_exact2d": lambda: (_m(1, 2, 4, 4), [8, 8]),
    "_upsample_nearest_exact3d": lambda: (_m(1, 2, 4, 4, 4), [8, 8, 8]),
    "upsample_linear1d": lambda: (_m(1, 2, 4), [8], False),
    "upsample_bilinear2d": lambda: (_m(1, 2, 4, 4), [8, 8], False),
    "_upsample_bilinear2d_aa": lambda: (_m(1, 2, 4, 4), [8, 8], False),
    "upsample_bicubic2d": lambda: (_m(1, 2, 4, 4), [8, 8], False),
    "_upsample_bicubic2d_aa": lambda: (_m(1, 2, 4, 4), [8, 8], False),
    "upsample_trilinear3d": lambda: (_m(1, 2, 4, 4, 4), [8, 8, 8], False),
    "reflection_pad1d": lambda: (_m(1, 2, 4), [1, 1]), "reflection_pad2d": lambda: (_m(1, 2, 4, 4), [1, 1, 1, 1]),
    "replication_pad1d": lambda: (_m(1, 2, 4), [1, 1]),
    "replication_pad2d": lambda: (_m(1, 2, 4, 4), [1, 1, 1, 1]),
    "replication_pad3d": lambda: (_m(1, 2, 4, 4, 4), [1, 1, 1, 1, 1, 1]),
    "avg_pool3d": lambda: (_m(1, 2, 4, 4, 4), 2), "max_pool3d": lambda: (_m(1, 2, 4, 4, 4), 2),
    "adaptive_avg_pool3d": lambda: (_m(1, 2, 4, 4, 4), 2),
    "adaptive_max_pool3d": lambda: (_m(1, 2, 4, 4, 4), 2),
    "fractional_max_pool2d": lambda: (_m(1, 2, 8, 8), 2, (4, 4)),
    "fractional_max_pool3d": lambda: (_m(1, 2, 8, 8, 8), 2, (4, 4, 4)),
    "max_unpool2d": lambda: (*F.max_pool2d(_m(1, 2, 4, 4), 2, return_indices=True), 2),
    "max_unpool3d": lambda: (*F.max_pool3d(_m(1, 2, 4, 4, 4), 2, return_indices=True), 2),
    "grid_sampler": lambda: (_m(1, 2, 4, 4), _m(1, 3, 3, 2).tanh(), 0, 0, False),
    "grid_sampler_2d": lambda: (_m(1, 2, 4, 4), _m(1, 3, 3, 2).tanh(), 0, 0, False),
    "_grid_sampler_2d_cpu_fallback": lambda: (_m(1, 2, 4, 4), _m(1, 3, 3, 2).tanh(), 0, 0, False),
    "grid_sampler_3d": lambda: (_m(1, 2, 4, 4, 4), _m(1, 3, 3, 3, 3).tanh(), 0, 0, False),
    "fft_fft": lambda: (_m(8),), "fft_ifft": lambda: (_m(8),), "fft_rfft": lambda: (_m(8),),
    "fft_ihfft": lambda: (_m(8),), "fft_fft2": lambda: (_m(4, 4),), "fft_ifft2": lambda: (_m(4, 4),),
    "fft_rfft2": lambda: (_m(4, 4),), "fft_fftn": lambda: (_m(4, 4),), "fft_ifftn": lambda: (_m(4, 4),),
    "fft_rfftn": lambda: (_m(4, 4),),
    "stft": lambda: (_m(64), 16, None, None, None, True, "reflect", False, None, True), "frobenius_norm": lambda: (_m(3, 3), [0, 1]),
    "cholesky": lambda: (_spd(),), "qr": lambda: (_spd(),),
    "lu_solve": lambda: (_m(4, 1), *torch.linalg.lu_factor(_spd())),
    "orgqr": lambda: torch.geqrf(_spd()), "ormqr": lambda: (*torch.geqrf(_spd()), _spd()),
    "linalg_householder_product": lambda: torch.geqrf(_spd()),
    "linalg_eig": lambda: (_spd(),), "linalg_eigvals": lambda: (_spd(),),
    "linalg_matrix_rank": None,   # an integer result: no dtype to see
    "linalg_tensorinv": lambda: (_spd().reshape(4, 2, 2), 1),
    "linalg_tensorsolve": lambda: (_spd(), _m(4)),
    "fake_quantize_per_tensor_affine": lambda: (_m(4), 0.1, 0, -128, 127),
    "binary_cross_entropy": lambda: (_m(4).sigmoid(), _m(4).sigmoid()),
    "conv_tbc": lambda: (_m(5, 2, 3), _m(1, 3, 4), _m(4), 0),
    # the overload torch's CPU list names (without allow_tf32)
    "_convolution": lambda: (_m(1, 3, 4, 4), _m(2, 3, 1, 1), None, [1, 1], [0, 0], [1, 1], False,
                             [0, 0], 1, False, False, True),
    "convolution": lambda: (_m(1, 3, 4, 4), _m(2, 3, 1, 1), None, [1, 1], [0, 0], [1, 1], False,
                            [0, 0], 1),
    "_native_multi_head_attention": lambda: (_m(1, 2, 4), _m(1, 2, 4), _m(1, 2, 4), 4, 2,
                                             _m(12, 4), _m(12), _m(4, 4), _m(4)),
    "cudnn_convolution": None, "cudnn_convolution_transpose": None,     # CUDA only
    "_scaled_dot_product_flash_attention": None,                        # CUDA only
}
_LOW_KERNEL_MISSING = re.compile(r"BFloat16|other than float and double|Low precision|"
                                 r"float or double")
_REAL = {torch.complex64: FP32, torch.complex128: torch.float64, torch.complex32: torch.float16}


def _first_float(out):
    """The dtype of the first floating result (a complex one as its real part's)."""
    return next((_REAL.get(t.dtype, t.dtype) for t in tensors(out)
                 if t.is_floating_point() or t.is_complex()), None)


def _sample(name, fn):
    makers = [_SAMPLES[name]] if name in _SAMPLES else _GENERIC
    for make in makers:
        if make is None:
            return None
        try:
            args = make()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                if _first_float(fn(*args)) is not None:
                    return args
        except (RuntimeError, TypeError, ValueError, IndexError):
            continue
    return None


def _audit(name):
    """'ran', 'refused' or 'no sample': what a scope with another dtype does to ``name``."""
    fn = _callable_of(name)
    if fn is None:
        with pytest.raises(ValueError, match=rf"ampc.policy.scope: ops\['{name}'\]"):
            policy.scope(ops={name: "fp32"})
        return "refused"
    policy.scope(ops={name: "fp32"})          # accepted: the mode can see its calls
    torch.manual_seed(0)
    args = _sample(name, fn)
    if args is None:
        return "no sample"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with ampc.autocast("cpu"):
            plain = _first_float(fn(*args))
            pol, want = ("fp32", FP32) if plain is BF16 else ("lower_precision_fp", BF16)
            with policy.scope(ops={name: pol}):
                try:
                    got = _first_float(fn(*args))
                except (RuntimeError, TypeError) as e:
                    # no bf16 kernel: the error shows the op was given bf16, as scoped
                    assert pol == "lower_precision_fp" and _LOW_KERNEL_MISSING.search(str(e)), \
                        (name, e)
                    return "ran"
    assert got is want, f"{name}: scope {pol} gave {got} (default {plain})"
    return "ran"


def test_every_op_the_policy_knows_obeys_a_scope_or_is_refused():
    names = sorted(policy._all_names() | set(policy._SHOWN))
    seen = {name: _audit(name) for name in names}
    refused = sorted(n for n, r in seen.items() if r == "refused")
    unsampled = sorted(n for n, r in seen.items() if r == "no sample")
    assert refused == ["_thnn_fused_gru_cell", "_thnn_fused_lstm_cell",
                       "multilabel_margin_loss_forward"]
    # ops with no CPU sample here: CUDA-only kernels, torch.cholesky and torch.qr (removed
    # from torch's Python API, still on its list), an integer result, and two whose arguments
    # are a model's worth (accepted by the scope all the same)
    assert unsampled == ["_scaled_dot_product_flash_attention", "cholesky", "ctc_loss",
                         "cudnn_convolution", "cudnn_convolution_transpose",
                         "linalg_matrix_rank", "mkldnn_rnn_layer", "qr"], unsampled
    assert sum(r == "ran" for r in seen.values()) == len(names) - 11 > 170
