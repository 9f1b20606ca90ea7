"""ampc.fp32_state_dict on FSDP2 models (fully_shard, DTensor params), 2 ranks, gloo, CPU.

Two ways to train under FSDP2: a bf16 model whose fp32 masters ampc's AdamW keeps (as
DTensors sharded like the params), and an fp32 model with FSDP2's MixedPrecisionPolicy
(the sharded fp32 params are the masters). For both, after a few steps:
- by default the export is laid out as torch.distributed.checkpoint's get_model_state_dict
  lays it out (same keys, DTensors with the same mesh, placements, shapes and local shapes),
  with the masters' values;
- with full_state_dict=True every entry is a plain fp32 tensor equal to the gathered
  master, and the dict loads (strict) into the unsharded fp32 model;
- the bf16 model's params are its masters rounded to bf16, bit for bit, and the masters
  hold bits the bf16 params lost (the export is not the params widened).
"""
import pytest
import torch
import torch.distributed as dist
from torch import nn

import ampc
from test_distributed import batch, fsdp, full, make_model, run_ranks

pytestmark = [
    pytest.mark.skipif(not dist.is_available(), reason="torch without distributed"),
    pytest.mark.slow,
]


def _layout(t):
    return (tuple(t.placements), tuple(t.shape), tuple(t.to_local().shape),
            t.device_mesh.mesh.tolist())


def _train(rank, variant):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if variant == "bf16_masters":
        model = fsdp(make_model().to(torch.bfloat16))
    else:
        model = fsdp(make_model(), mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    opt = ampc.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(3):
        x, y = batch(step, rank)
        opt.zero_grad(set_to_none=True)
        nn.functional.mse_loss(model(x.to(next(model.parameters()).dtype)).float(),
                               y).backward()
        opt.step()

    sharded = ampc.fp32_state_dict(model, opt)
    whole = ampc.fp32_state_dict(model, opt, full_state_dict=True)
    dcp_sharded = get_model_state_dict(model)
    dcp_whole = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    names = dict(model.named_parameters())
    masters = {k: opt.state[p]["master"] if "master" in opt.state[p] else p
               for k, p in names.items()}

    fp32 = make_model()
    missing = fp32.load_state_dict(whole, strict=True)
    return {
        "keys": (list(sharded), list(whole), list(dcp_sharded)),
        "layouts": {k: (_layout(sharded[k]), _layout(dcp_sharded[k])) for k in sharded},
        "dtypes": {k: (v.dtype, type(v).__name__) for k, v in whole.items()},
        "sharded_local": {k: v.to_local().clone() for k, v in sharded.items()},
        "master_local": {k: m.detach().to_local().clone() for k, m in masters.items()},
        "whole": whole,
        "full_masters": {k: full(m) for k, m in masters.items()},
        "full_params": {k: full(p) for k, p in names.items()},
        "dcp_whole": {k: v.detach().clone() for k, v in dcp_whole.items()},
        "loaded": (missing.missing_keys, missing.unexpected_keys,
                   {k: v.detach().clone() for k, v in fp32.state_dict().items()}),
    }


def _both(rank):
    return {v: _train(rank, v) for v in ("bf16_masters", "fp32_mp_policy")}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return run_ranks(_both, tmp_path=tmp_path_factory.mktemp("fp32_sd"))


VARIANTS = ["bf16_masters", "fp32_mp_policy"]


@pytest.mark.parametrize("variant", VARIANTS)
def test_sharded_export_is_laid_out_as_get_model_state_dict(runs, variant):
    for out in (r[variant] for r in runs):
        ours, ours_whole, dcp = out["keys"]
        assert ours == dcp == ours_whole
        for key, (mine, theirs) in out["layouts"].items():
            assert mine == theirs, key
        for key, local in out["sharded_local"].items():
            master = out["master_local"][key]
            assert local.dtype == torch.float32
            assert torch.equal(local, master.float()), key


@pytest.mark.parametrize("variant", VARIANTS)
def test_full_export_is_the_gathered_masters_and_loads_into_the_fp32_model(runs, variant):
    for out in (r[variant] for r in runs):
        for key, value in out["whole"].items():
            assert out["dtypes"][key] == (torch.float32, "Tensor"), key
            assert torch.equal(value, out["full_masters"][key]), key
        missing, unexpected, loaded = out["loaded"]
        assert not missing and not unexpected
        for key, value in loaded.items():
            assert torch.equal(value, out["whole"][key]), key
    # both ranks export the same whole model
    for key in runs[0][variant]["whole"]:
        assert torch.equal(runs[0][variant]["whole"][key], runs[1][variant]["whole"][key])


def test_fp32_params_under_mp_policy_export_as_dcp_full_state_dict(runs):
    for out in (r["fp32_mp_policy"] for r in runs):
        for key, value in out["whole"].items():
            assert torch.equal(value, out["dcp_whole"][key]), key


def test_bf16_params_are_their_masters_rounded_and_the_export_keeps_the_lost_bits(runs):
    for out in (r["bf16_masters"] for r in runs):
        lost = 0
        for key, value in out["whole"].items():
            param = out["full_params"][key]
            assert param.dtype == torch.bfloat16
            assert torch.equal(value.to(torch.bfloat16), param), key
            lost += int((value != param.float()).sum())
        assert lost > 0


def test_full_state_dict_changes_nothing_without_dtensors():
    # one process, no process group: the export is the same either way
    model, opt = ampc.prepare(make_model(), ampc.optim.AdamW, torch.bfloat16, lr=1e-2)
    x, y = batch(0, 0)
    nn.functional.mse_loss(model(x).float(), y).backward()
    opt.step()
    plain = ampc.fp32_state_dict(model, opt)
    whole = ampc.fp32_state_dict(model, opt, full_state_dict=True)
    assert list(plain) == list(whole)
    for key, value in plain.items():
        assert value.dtype == torch.float32 and torch.equal(value, whole[key]), key
