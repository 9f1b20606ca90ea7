"""The settings check every integration shares (ampc/integrations/_settings.py): each refusal is
written once, so each integration refuses the same bad argument with the same message, before
it changes anything."""
import pytest
import torch
from torch import nn

from integration_helpers import need

need("lightning")
accelerate = need("accelerate")
from accelerate.state import AcceleratorState, GradientState  # noqa: E402

import ampc  # noqa: E402
from ampc.integrations._settings import check  # noqa: E402
from ampc.integrations.accelerate import use_ampc  # noqa: E402
from ampc.integrations.lightning import AmpcFabricPrecision, AmpcPrecision  # noqa: E402

ACCELERATE = "ampc.integrations.accelerate.use_ampc"


def _accelerator(mixed_precision):
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    return accelerate.Accelerator(mixed_precision=mixed_precision, cpu=True)


def _use_ampc(precision, **kw):
    acc = _accelerator("fp16" if precision == "16-mixed" else "bf16")
    try:
        return use_ampc(acc, **kw)
    except (TypeError, ValueError):     # a refused call leaves the accelerator as it was
        assert type(acc) is accelerate.Accelerator and acc.scaler is None
        assert not hasattr(acc, "_ampc")
        raise


# each integration as (its name in messages, a call with the shared arguments)
INTEGRATIONS = [
    ("AmpcPrecision", lambda precision, **kw: AmpcPrecision(precision, "cpu", **kw)),
    ("AmpcFabricPrecision", lambda precision, **kw: AmpcFabricPrecision(precision, "cpu", **kw)),
    (ACCELERATE, _use_ampc),
]


@pytest.mark.parametrize("name,make", INTEGRATIONS, ids=[n for n, _ in INTEGRATIONS])
def test_a_scaler_that_is_not_ampcs_is_refused(name, make):
    with pytest.raises(TypeError) as e:
        make("16-mixed", scaler=torch.amp.GradScaler("cpu"))
    assert str(e.value) == f"{name}: scaler must be an ampc.GradScaler, got GradScaler"


@pytest.mark.parametrize("name,make", INTEGRATIONS, ids=[n for n, _ in INTEGRATIONS])
def test_bf16_with_a_scaler_is_refused(name, make):
    scaler = ampc.GradScaler("cpu")
    with pytest.raises(ValueError) as e:
        make("bf16-mixed", scaler=scaler)
    assert str(e.value) == f"{name}: bfloat16 needs no loss scaling; got scaler={scaler!r}"


@pytest.mark.parametrize("name,make", INTEGRATIONS, ids=[n for n, _ in INTEGRATIONS])
def test_a_bad_fp8_argument_is_refused(name, make):
    with pytest.raises(TypeError) as e:
        make("bf16-mixed", fp8="yes")
    assert str(e.value) == f"{name}: fp8 must be a bool or an ampc.fp8 recipe, got str"


@pytest.mark.parametrize("name,make", INTEGRATIONS, ids=[n for n, _ in INTEGRATIONS])
def test_fp16_gets_ampcs_scaler_and_bf16_none(name, make):
    made = make("16-mixed")
    assert type(made.scaler) is ampc.GradScaler and made.scaler.get_scale() == 2.0 ** 16
    assert make("bf16-mixed").scaler is None
    mine = ampc.GradScaler("cpu", init_scale=8.0)
    assert make("16-mixed", scaler=mine).scaler is mine


def test_check_refuses_a_dtype_that_is_not_low():
    with pytest.raises(ValueError, match="^x: dtype must be torch.bfloat16 or torch.float16, "
                                         "got torch.float32$"):
        check("x", "cpu", torch.float32)
    # the accelerate integration takes a dtype itself: the same check
    with pytest.raises(ValueError, match=f"^{ACCELERATE}: dtype must be torch.bfloat16"):
        use_ampc(_accelerator("bf16"), dtype=torch.float64)


def test_check_builds_the_scaler_it_is_asked_for():
    s = check("x", "cpu", torch.float16, dynamic=False, init_scale=1024.0,
              policy={"softmax": "fp32"}, fp8=True, fp8_modules=[nn.Linear])
    assert not s.scaler.is_dynamic() and s.scaler.get_scale() == 1024.0
    assert s.policy == {"softmax": "fp32"} and s.fp8_modules == (nn.Linear,)
    assert isinstance(s.fp8, ampc.fp8.DelayedScaling)
    assert check("x", "cpu", torch.bfloat16, fp8=False).fp8 is None


def test_master_weights_refuse_other_optimizers_with_one_message():
    net = nn.Linear(4, 4)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    s = check("x", "cpu", torch.bfloat16, master_weights=True)
    with pytest.raises(TypeError) as e:
        s.make_master_weights("x", "optimizer 0", net, opt)
    assert str(e.value) == ("x(master_weights=True): optimizer 0 is SGD; master weights need "
                            "ampc.optim.Adam or ampc.optim.AdamW")
    assert net.weight.dtype == torch.float32        # refused before anything changed
    opt = ampc.optim.AdamW(net.parameters())
    s.make_master_weights("x", "optimizer 0", net, opt)
    assert net.weight.dtype == torch.bfloat16
    assert opt.state[net.weight]["master"].dtype == torch.float32
