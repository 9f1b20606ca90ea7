"""The cast-policy registry that ampc.autocast consults for every call it intercepts.

A policy says what autocast does to an op's floating-point tensor arguments:

    lower_precision_fp   cast them to the autocast dtype (fp16/bf16), run the op
    fp32                 cast them to float32
    fp32_set_opt_dtype   pass dtype=float32 to an op that takes one (softmax, sum, ...),
                         unless the caller gave a dtype; inputs are not cast
    fp32_append_dtype    the same for norm, whose dtype-taking form is another overload
    promote              cast them all to the widest dtype among them (fp32 wins)
    banned               raise: the op is unsafe under autocast (binary_cross_entropy on CUDA)
    fp32_keep_dtype      compute in float32, return outputs in the first input's dtype
                         (offered for norms: an fp32 norm otherwise doubles the memory of
                         the activations after it; not a default)
    passthrough          leave the op alone (useful to undo a default)

Only "eligible" tensors are touched: floating point, not float64, on the autocast device.
The defaults are PyTorch's own lists (aten/src/ATen/autocast_mode.cpp, torch 2.12+) per
device, keyed by the Python-level name of the op (overloads share one policy). Inside an
ampc.autocast region torch's own autocast is on and applies them (the ops C++ composites call
inside included); ampc steps in only where the effective policy differs from these lists.

Users can read the effective policy of any op (:func:`get_policy`), change it globally or
per device (:func:`set_policy`), add their own functions and custom ops (:func:`register`),
scope a policy to a region or a module and its children (:func:`scope`,
:func:`module_scope`), and print the whole table (:func:`table`).
"""
from __future__ import annotations  # "X | None" hints on Python 3.9 too; none evaluated at import

import enum
import functools
import threading
from collections.abc import Callable, Mapping
from typing import Any, Union

import torch
from torch.overrides import handle_torch_function, has_torch_function

__all__ = ["CastPolicy", "DEVICES", "DEFAULTS", "Scope", "ScopeHandle", "scope", "op_name", "get_policy",
           "set_policy", "reset", "register", "current_scope", "module_scope", "module_scope_of",
           "table", "print_table"]

DEVICES = ("cpu", "cuda")


class CastPolicy(str, enum.Enum):
    LOWER_PRECISION_FP = "lower_precision_fp"
    FP32 = "fp32"
    FP32_SET_OPT_DTYPE = "fp32_set_opt_dtype"
    FP32_APPEND_DTYPE = "fp32_append_dtype"
    PROMOTE = "promote"
    BANNED = "banned"
    FP32_KEEP_DTYPE = "fp32_keep_dtype"
    PASSTHROUGH = "passthrough"

    def __str__(self) -> str:
        return self.value


P = CastPolicy
# what names an op: its registry name, a torch callable, a custom op, a registered function
Op = Union[str, Callable[..., Any]]

# ---- defaults: PyTorch's lists, one name per Python-level op ----

_CUDA = {
    P.LOWER_PRECISION_FP: """_convolution conv1d conv2d conv3d conv_tbc conv_transpose1d
        conv_transpose2d conv_transpose3d convolution prelu addmm addmv addr matmul einsum mm mv
        linalg_vecdot linear addbmm baddbmm bmm chain_matmul linalg_multi_dot
        _thnn_fused_lstm_cell _thnn_fused_gru_cell lstm_cell gru_cell rnn_tanh_cell rnn_relu_cell
        _scaled_dot_product_flash_attention scaled_dot_product_attention cudnn_convolution
        cudnn_convolution_transpose""",
    P.FP32: """acos asin cosh erfinv exp expm1 log log10 log2 log1p reciprocal rsqrt sinh tan pow
        softplus layer_norm native_layer_norm rms_norm group_norm frobenius_norm nuclear_norm
        cosine_similarity poisson_nll_loss cosine_embedding_loss nll_loss nll_loss2d
        hinge_embedding_loss kl_div l1_loss smooth_l1_loss huber_loss mse_loss margin_ranking_loss
        multilabel_margin_loss soft_margin_loss triplet_margin_loss multi_margin_loss
        binary_cross_entropy_with_logits dist pdist cdist renorm logsumexp upsample_nearest1d
        _upsample_nearest_exact1d upsample_nearest2d _upsample_nearest_exact2d upsample_nearest3d
        _upsample_nearest_exact3d upsample_linear1d upsample_bilinear2d _upsample_bilinear2d_aa
        upsample_trilinear3d upsample_bicubic2d _upsample_bicubic2d_aa""",
    P.FP32_SET_OPT_DTYPE: """prod softmax log_softmax cumprod cumsum linalg_vector_norm
        linalg_matrix_norm sum""",
    P.FP32_APPEND_DTYPE: "norm",
    P.PROMOTE: """addcdiv addcmul atan2 bilinear cross dot vdot grid_sampler index_put tensordot
        scatter_add""",
    P.BANNED: "binary_cross_entropy",
}

_CPU = {
    P.LOWER_PRECISION_FP: """conv1d conv2d conv3d bmm mm linalg_vecdot baddbmm addmm
        _addmm_activation addbmm linear _convolution matmul conv_tbc mkldnn_rnn_layer
        conv_transpose1d conv_transpose2d conv_transpose3d prelu scaled_dot_product_attention
        _native_multi_head_attention""",
    P.FP32: """avg_pool3d binary_cross_entropy grid_sampler polar prod quantile nanquantile stft
        cdist grid_sampler_2d _grid_sampler_2d_cpu_fallback grid_sampler_3d trace view_as_complex
        cholesky cholesky_inverse cholesky_solve inverse lu_solve orgqr ormqr pinverse max_pool3d
        max_unpool2d max_unpool3d adaptive_avg_pool3d reflection_pad1d reflection_pad2d
        replication_pad1d replication_pad2d replication_pad3d mse_loss cosine_embedding_loss
        nll_loss nll_loss2d hinge_embedding_loss poisson_nll_loss smooth_l1_loss cross_entropy_loss
        l1_loss huber_loss margin_ranking_loss soft_margin_loss triplet_margin_loss
        multi_margin_loss ctc_loss kl_div multilabel_margin_loss binary_cross_entropy_with_logits
        fft_fft fft_ifft fft_fft2 fft_ifft2 fft_fftn fft_ifftn fft_rfft fft_irfft fft_rfft2
        fft_irfft2 fft_rfftn fft_irfftn fft_hfft fft_ihfft linalg_cond linalg_matrix_rank
        linalg_solve linalg_cholesky linalg_svdvals linalg_eigvals linalg_eigvalsh linalg_inv
        linalg_householder_product linalg_tensorinv linalg_tensorsolve
        fake_quantize_per_tensor_affine geqrf _lu_with_info qr svd triangular_solve
        fractional_max_pool2d fractional_max_pool3d adaptive_max_pool3d
        multilabel_margin_loss_forward linalg_qr linalg_cholesky_ex linalg_svd linalg_eig
        linalg_eigh linalg_lstsq linalg_inv_ex""",
    P.PROMOTE: "stack cat index_copy",
}

# Python-level spellings whose name differs from the op's
_ALIASES = {"cross_entropy": "cross_entropy_loss", "__matmul__": "matmul", "__pow__": "pow"}

BCE_MESSAGE = (
    "torch.nn.functional.binary_cross_entropy and torch.nn.BCELoss are unsafe to autocast.\n"
    "Many models use a sigmoid layer right before the binary cross entropy layer.\n"
    "In this case, combine the two layers using torch.nn.functional.binary_cross_entropy_with_logits\n"
    "or torch.nn.BCEWithLogitsLoss.  binary_cross_entropy_with_logits and BCEWithLogits are\n"
    "safe to autocast.")


def _expand(lists):
    return {name: policy for policy, names in lists.items() for name in names.split()}


DEFAULTS = {"cuda": _expand(_CUDA), "cpu": _expand(_CPU)}

# ops torch's lists leave in their inputs' dtype on purpose, listed in the table all the
# same (as passthrough) so that a reader looking for a norm finds it
_SHOWN = ("batch_norm", "instance_norm", "layer_norm", "group_norm", "rms_norm")

# ---- the registry ----

_lock = threading.Lock()
_overrides = {"*": {}, "cpu": {}, "cuda": {}}   # user changes: all devices, then per device
EFFECTIVE = {}                                   # device -> {name: policy}, rebuilt on change
FUNCS = {}                                       # callable -> op name (or None: not an op)
_named = set()                                   # callables named by the registry itself
_labels = set()                                  # names given to registered functions and ops
_reachable = set()                               # names some indexed callable carries: what
                                                 # autocast's mode can see a call of
EDITED = False                                   # whether a change touches one of torch's own ops
CHANGED = False                                  # whether there is any change or registration


def _rebuild():
    global EDITED, CHANGED
    for dev in DEVICES:
        eff = {**DEFAULTS[dev], **_overrides["*"], **_overrides[dev]}
        EFFECTIVE[dev] = {k: v for k, v in eff.items() if v is not P.PASSTHROUGH}
    EDITED = any(name not in _labels for table in _overrides.values() for name in table)
    CHANGED = any(_overrides.values())


_NAMESPACES = (torch, torch.Tensor, torch._C._nn, torch._C._linalg, torch._C._fft,
               torch._C._special, torch.nn.functional)


def _index_names(names):
    """Maps every Python-level callable spelled like an op name to that name."""
    for name in names:
        for ns in _NAMESPACES:
            fn = getattr(ns, name, None)
            if callable(fn) and fn not in _named:
                FUNCS[fn] = name
                _named.add(fn)
            if callable(fn) and FUNCS.get(fn) == name:
                _reachable.add(name)


def _index_packet(packet, label):
    """Maps a custom op (its packet and every overload) to ``label``."""
    FUNCS[packet] = label
    for overload in packet.overloads():
        FUNCS[getattr(packet, overload)] = label
    _reachable.add(label)


def _all_names():
    names = set(_ALIASES.values())
    for table in (*DEFAULTS.values(), *_overrides.values()):
        names.update(table)
    return names


def _init():
    _rebuild()
    _index_names(_all_names() | set(_SHOWN))
    for alias, name in _ALIASES.items():
        for ns in _NAMESPACES:
            fn = getattr(ns, alias, None)
            if callable(fn):
                FUNCS[fn] = name
                _named.add(fn)
                _reachable.add(name)


def _check_device(fn, device_type):
    if device_type is not None and device_type not in DEVICES:
        raise ValueError(f"ampc.policy.{fn}: device_type must be one of {DEVICES} or None, "
                         f"got {device_type!r}")


def _check_policy(fn, policy):
    try:
        return CastPolicy(policy)
    except ValueError:
        raise ValueError(f"ampc.policy.{fn}: policy must be one of "
                         f"{[p.value for p in CastPolicy]}, got {policy!r}") from None


def op_name(op: Op) -> str:
    """The registry's name for ``op``: a name string (``"layer_norm"``, ``"aten::pow.Scalar"``),
    a torch callable (``torch.mm``, ``F.layer_norm``, ``torch.Tensor.softmax``), a custom op
    (``torch.ops.mylib.foo``) or a function given to :func:`register`."""
    if isinstance(op, str):
        if op in _labels:
            return op
        name = op.split("::", 1)[1] if op.startswith("aten::") else op
        name = name.split(".", 1)[0] if "::" not in name else name
        # the Python name of an op whose aten name differs ("cross_entropy" is F.cross_entropy,
        # aten's cross_entropy_loss): its policy must reach the op the call runs
        return _ALIASES.get(name, name)
    if isinstance(op, torch._ops.OpOverload):
        op = op._overloadpacket
    if isinstance(op, torch._ops.OpOverloadPacket):
        ns, name = op._qualified_op_name.split("::")
        return name if ns == "aten" else f"{ns}::{name}"
    name = FUNCS.get(op)
    if name is None:        # a torch callable no table names yet (F.gelu): its own name
        name = getattr(op, "__name__", None)
        if name and any(getattr(ns, name, None) is op for ns in _NAMESPACES):
            _index_names([name])
            return name
        raise ValueError(f"ampc.policy: {op!r} is not an op the registry knows; pass its name, "
                         "or register it with ampc.policy.register")
    return name


def get_policy(op: Op, device_type: str = "cuda") -> CastPolicy:
    """The effective policy of ``op`` on ``device_type`` (outside any scope), or
    ``CastPolicy.PASSTHROUGH`` when autocast leaves it alone."""
    _check_device("get_policy", device_type)
    return EFFECTIVE[device_type].get(op_name(op), P.PASSTHROUGH)


def set_policy(op: Op, policy: CastPolicy | str | None, device_type: str | None = None) -> None:
    """Sets the policy of ``op`` for every device (``device_type=None``) or for one.
    ``policy=None`` removes the change and restores the default. Takes effect from the
    next call on, in every thread; a region opened while the registry had no changes at all
    (it then leaves everything to torch's autocast) sees it from its next region on."""
    _check_device("set_policy", device_type)
    _set(op_name(op), policy, device_type)


def _set(name, policy, device_type):
    with _lock:
        table = _overrides[device_type or "*"]
        if policy is None:
            table.pop(name, None)
        else:
            table[name] = _check_policy("set_policy", policy)
        _index_names([name])
        _rebuild()


def reset() -> None:
    """Removes every change made with :func:`set_policy` (registered functions keep their
    names but lose their policies)."""
    with _lock:
        for table in _overrides.values():
            table.clear()
        _rebuild()


def register(fn: Callable[..., Any] | None = None, *, policy: CastPolicy | str,
             device_type: str | None = None, name: str | None = None) -> Callable[..., Any]:
    """Puts a function or a custom op under autocast with ``policy``.

    A ``torch.library`` custom op (``torch.ops.mylib.foo``) is registered as is and
    returned. A plain Python function is wrapped so that autocast sees its calls; use the
    returned function (or use ``register`` as a decorator)::

        @ampc.policy.register(policy="fp32")
        def my_loss(logits, target): ...

    Inside the function, calls are not autocast again (as for torch's own ops).
    """
    if fn is None:
        return functools.partial(register, policy=policy, device_type=device_type, name=name)
    policy = _check_policy("register", policy)
    _check_device("register", device_type)
    if isinstance(fn, (torch._ops.OpOverloadPacket, torch._ops.OpOverload)):
        label = name or op_name(fn)
        packet = fn._overloadpacket if isinstance(fn, torch._ops.OpOverload) else fn
        _labels.add(label)
        with _lock:
            _index_packet(packet, label)
        _set(label, policy, device_type)
        return fn
    if not callable(fn):
        raise TypeError(f"ampc.policy.register: fn must be callable, got {type(fn).__name__}")

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
        if has_torch_function(tensors):
            return handle_torch_function(wrapper, tensors, *args, **kwargs)
        return fn(*args, **kwargs)

    label = name or f"{fn.__module__}.{fn.__qualname__}"
    FUNCS[wrapper] = label
    _labels.add(label)
    _reachable.add(label)
    _set(label, policy, device_type)
    return wrapper


# ---- scopes: a policy for a region or a module and its children ----

class Scope:
    """What a scope changes: the dtype of lower-precision ops (None: the region's),
    per-op policies, or autocast as a whole (``enabled=False``)."""

    __slots__ = ("dtype", "ops", "enabled", "base", "outer", "from_module")

    def __init__(self, dtype: torch.dtype | None = None, ops: Mapping[Op, CastPolicy | str] | None = None,
                 enabled: bool | None = None) -> None:
        if dtype is not None and dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise ValueError("ampc.policy.scope: dtype must be torch.float32, torch.float16, "
                             f"torch.bfloat16 or None, got {dtype}")
        self.dtype, self.enabled = dtype, enabled    # enabled None: as the enclosing scope
        self.base = self.outer = None
        self.from_module = False
        self.ops = {_scoped_name(k, v): _check_policy("scope", v) for k, v in (ops or {}).items()}

    def merged(self, parent: "Scope | None") -> "Scope":
        """This scope seen from inside ``parent``: unset fields come from the parent."""
        out = Scope.__new__(Scope)
        out.base = None       # torch's autocast state outside the outermost scope (set by autocast)
        out.from_module = self.from_module
        # the merged scope of the innermost ``with scope(...)``, module scopes left out: what a
        # checkpoint's recomputation restores (module scopes come back with their modules)
        out.outer = parent.outer if parent is not None and self.from_module else \
            None if self.from_module else out
        if parent is None:
            out.dtype, out.ops = self.dtype, self.ops
            out.enabled = self.enabled is not False
            return out
        out.dtype = self.dtype or parent.dtype
        out.ops = {**parent.ops, **self.ops}
        out.enabled = parent.enabled if self.enabled is None else self.enabled
        return out


def _scoped_name(op, policy):
    """The registry name of scope op ``op``, its Python-level calls made visible to autocast's
    mode. A scope's ops are seen only through those calls (the defaults live in torch's
    dispatcher, a scope does not), so an op that has none raises rather than being ignored."""
    name = op_name(op)
    if name in _reachable:
        return name
    with _lock:
        _index_names([name])
        packet = op if isinstance(op, torch._ops.OpOverloadPacket) else \
            op._overloadpacket if isinstance(op, torch._ops.OpOverload) else _custom_op(name)
        if packet is not None:
            _index_packet(packet, name)
    if name not in _reachable:
        raise ValueError(
            f"ampc.policy.scope: ops[{op!r}]: {name!r} has no Python-level call for the scope "
            f"to see (it runs only inside other ops), so the scope cannot apply {policy!r} to "
            "it; scope the op that calls it, or register a function or custom op under that name")
    return name


def _custom_op(name):
    """torch.ops.<ns>.<name> for a name spelled 'ns::name' (not aten's), or None."""
    if "::" not in name:
        return None
    ns, _, op = name.partition("::")
    try:
        return getattr(getattr(torch.ops, ns), op)
    except (AttributeError, RuntimeError):
        return None


class _ScopeState(threading.local):
    def __init__(self):
        self.scope = None     # the current merged Scope of this thread, or None
        self.saved = []       # (owner, what to restore), one per open scope


_tls = _ScopeState()


def current_scope() -> Scope | None:
    return _tls.scope


def _push(s):
    """Enters scope ``s`` (merged into the current one); returns what to restore."""
    prev = current_scope()
    _tls.scope = s.merged(prev)
    return prev, (_scope_entered(_tls.scope, prev) if _scope_entered is not None else None)


def _pop(saved):
    prev, token = saved
    _tls.scope = prev
    if token is not None:
        _scope_left(token)


def _enter(owner, s):
    _tls.saved.append((owner, _push(s)))


def _leave(owner):
    """Leaves the innermost scope ``owner`` entered, and any entered after it whose exit
    never ran; nothing when ``owner`` has none open. A module scope's hooks traced by
    torch.compile, whose compilation then failed, leave no entry for the forward hook
    that still runs: popping another's entry made the enclosing scope's exit fail."""
    stack = _tls.saved
    for i in range(len(stack) - 1, -1, -1):
        if stack[i][0] is owner:
            while len(stack) > i:
                _pop(stack.pop()[1])
            return


# set by ampc.autocast: make torch's autocast state follow a scope's dtype and enabled
_scope_entered = None     # (merged scope, parent scope) -> what to restore, or None
_scope_left = None


class scope:
    """A context manager that applies a policy to the autocast ops run inside it::

        with ampc.autocast("cuda"), ampc.policy.scope(dtype=torch.float32):
            y = block(x)           # lower-precision ops run in float32 here

        with ampc.policy.scope(ops={"softmax": "fp32", "layer_norm": "fp32_keep_dtype"}):
            ...

    Args:
        dtype (torch.dtype): the dtype of lower-precision ops inside (float32 keeps the
            region in full precision). Default: the autocast region's.
        ops (dict): op (name or callable) -> policy, overriding the registry inside.
        enabled (bool): ``False`` turns autocast off inside, ``True`` back on inside an
            enclosing scope that turned it off. Default: None (as the enclosing scope).
    """

    def __init__(self, dtype: torch.dtype | None = None, ops: Mapping[Op, CastPolicy | str] | None = None,
                 enabled: bool | None = None) -> None:
        self._scope = Scope(dtype, ops, enabled)

    def __enter__(self) -> "scope":
        _enter(self, self._scope)
        return self

    def __exit__(self, *exc: Any) -> bool:
        _leave(self)
        return False


def module_scope(module: torch.nn.Module, *, dtype: torch.dtype | None = None,
                 ops: Mapping[Op, CastPolicy | str] | None = None, enabled: bool | None = None,
                 cast_inputs: bool = True, cast_outputs: torch.dtype | None = None
                 ) -> "ScopeHandle":
    """Makes a scope a property of ``module``: it applies to every call of the module and
    of its children. With ``dtype`` set and ``cast_inputs=True`` the module's floating
    tensor arguments are also cast to ``dtype`` on entry (inside autocast regions only),
    so that "keep this block in fp32" holds for its first op too. With ``cast_outputs``
    its floating outputs are cast to that dtype on the way out (inside autocast regions
    only): an fp16 block inside a bf16 region hands back float32, since torch's autocast
    refuses a 16-bit dtype other than the region's in its promote ops (``cat``, ``stack``)
    and torch itself promotes fp16 with bf16 to float32. Returns a handle whose
    ``remove()`` undoes it; ``ampc.policy.module_scope_of(module)`` reads it."""
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"ampc.policy.module_scope: module must be a torch.nn.Module, "
                        f"got {type(module).__name__}")
    if cast_outputs is not None and cast_outputs not in (torch.float32, torch.float16,
                                                         torch.bfloat16):
        raise ValueError("ampc.policy.module_scope: cast_outputs must be torch.float32, "
                         f"torch.float16, torch.bfloat16 or None, got {cast_outputs}")
    s = Scope(dtype, ops, enabled)
    s.from_module = True

    def pre(mod, args, kwargs):
        cast = None
        if s.dtype is not None and cast_inputs and _cast_inputs_hook is not None:
            cast = _cast_inputs_hook(args, kwargs, s.dtype)
        _enter(s, s)       # after the cast: post() leaves only what was entered
        return cast

    def post(mod, args, out):
        _leave(s)
        if cast_outputs is not None and _cast_inputs_hook is not None:
            cast = _cast_inputs_hook((out,), {}, cast_outputs)
            return None if cast is None else cast[0][0]
        return None

    handles = [module.register_forward_pre_hook(pre, with_kwargs=True),
               module.register_forward_hook(post, always_call=True)]
    module._ampc_scope = s
    return ScopeHandle(module, s, handles)


class ScopeHandle:
    """What :func:`module_scope` returns: ``remove()`` takes the scope off its module."""

    def __init__(self, module: torch.nn.Module, scope: Scope, hooks: list) -> None:
        self._module, self._scope, self._hooks = module, scope, hooks

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()
        if getattr(self._module, "_ampc_scope", None) is self._scope:
            del self._module._ampc_scope


def module_scope_of(module: torch.nn.Module) -> Scope | None:
    """The :class:`Scope` attached to ``module`` by :func:`module_scope`, or None."""
    return getattr(module, "_ampc_scope", None)


_cast_inputs_hook = None   # set by ampc.autocast: casts a module's inputs inside regions


# ---- the table ----

def table(device_type: str | None = None) -> str:
    """The effective policy table as text: one line per op that autocast changes, with its
    policy on each device and a mark on entries changed from the defaults."""
    _check_device("table", device_type)
    devs = [device_type] if device_type else list(DEVICES)
    names = sorted(set().union(_SHOWN, *(EFFECTIVE[d] for d in devs)))
    width = max([len(n) for n in names] + [2])
    lines = [(f"{'op':<{width}}  " + "  ".join(f"{d:<19}" for d in devs)).rstrip()]
    for n in names:
        cells = []
        for d in devs:
            pol = EFFECTIVE[d].get(n, P.PASSTHROUGH)
            changed = n in _overrides["*"] or n in _overrides[d]
            cells.append(f"{pol.value + ('*' if changed else ''):<19}")
        lines.append(f"{n:<{width}}  " + "  ".join(cells).rstrip())
    lines.append("(* changed from the default; passthrough, and ops not listed, run in their "
                 "inputs' dtype)")
    return "\n".join(lines)


def print_table(device_type: str | None = None) -> None:
    print(table(device_type))


_init()
