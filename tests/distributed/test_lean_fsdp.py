"""The lean optimizer state (8-bit moments, Kahan compensation) under DDP and FSDP2 on 2
ranks, gloo, CPU: the step on local shards against the same step on whole tensors (DDP),
DCP save and load resuming bit for bit, and a 2-rank checkpoint loaded into one process.

Under FSDP2 8-bit moments are quantized in blocks of each rank's shard. Where a shard
starts on a block boundary of the whole tensor, its blocks are the whole tensor's and
the step is bit-equal to DDP's; where it does not, the blocks hold other elements, their
absmax scales differ, and so do the quantization errors: that run is compared within a
tolerance (see _TOLERANCE)."""
import pytest
import torch
import torch.distributed as dist
from torch import nn

import ampc
from ampc.lean_state import decode_moments
from test_distributed import WORLD, assert_same_bits, ddp, full, run_ranks

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch without distributed")

LR = 1e-2


def make_model(seed=0, dtype=torch.float32, aligned=True):
    """(64, 256) and, aligned, (64, 64): shards of 32 rows, whole blocks of 256 (32 and 8),
    bit-equal to DDP. Not aligned, (67, 64): shards of 34 and 33 rows (2176 and 2112
    elements, 8.5 blocks), the second shard's blocks start mid-block of the whole tensor.
    The biases and the last layer are small: fp32 moments."""
    torch.manual_seed(seed)
    width = 64 if aligned else 67
    return nn.Sequential(nn.Linear(256, 64), nn.GELU(), nn.Linear(64, width), nn.Tanh(),
                         nn.Linear(width, 1)).to(dtype)


def batch(step, rank, dtype=torch.float32):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(8, 256, generator=g).to(dtype), torch.randn(8, 1, generator=g)


def fsdp(model):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh("cpu", (WORLD,))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


OPTIONS = {
    "8bit": dict(moments="8bit"),                                    # fp32 params
    "kahan_8bit": dict(moments="8bit", kahan_summation=True),        # bf16 params
    "bf16_moments": dict(moments="bf16", master_weights=True),       # bf16 params
    "lean": dict(state="lean"),     # bf16 params written by stochastic rounding, 8-bit
}



def dtype_of(name):
    return torch.float32 if name == "8bit" else torch.bfloat16


def train(model, opt, steps, rank, dtype, first=0, plants=(), clip=None):
    """Steps with a loss scaler, the folded clip (with `clip`), and an inf in rank 1's batch
    (DDP) or shard of a grad (FSDP2) at `plants`; the scale and norm of each step."""
    s = ampc.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=2)
    sharded = hasattr(next(model.parameters()), "to_local")
    trace = []
    for step in range(first, first + steps):
        x, y = batch(step, rank, dtype)
        if step in plants and rank == 1 and not sharded:
            x[0, 0] = float("inf")
        opt.zero_grad(set_to_none=True)
        loss = nn.functional.mse_loss(model(x).float(), y)
        s.scale(loss).backward()
        if step in plants and rank == 1 and sharded:
            g = next(model.parameters()).grad.to_local()
            g.view(-1)[0] = float("inf")
        norm = s.clip_grad_norm_(opt, clip) if clip else torch.zeros(())
        s.step(opt)
        s.update()
        trace.append((s.get_scale(), float(norm)))
    return trace


def local_state(model, opt):
    """Each param's lean state as this rank holds it, and the moments it decodes to."""
    out = []
    for p in model.parameters():
        st = {k: (v.to_local() if hasattr(v, "to_local") else v).detach().clone()
              for k, v in opt.state[p].items()}
        local = {k: v for k, v in st.items()}
        if "exp_avg_scale" in local:   # this rank's row of the per-shard scales, its blocks
            need = -(-local["exp_avg_codes"].numel() // ampc.ops.QBLOCK)
            for k in ("exp_avg_scale", "exp_avg_sq_scale"):
                local[k] = local[k].reshape(-1)[:need]
        out.append((st, decode_moments(local)))
    return out


def _replicated(rank):
    """8-bit moments of a Replicate DTensor param: whole-tensor blocks, replicated scales;
    the step of a plain tensor with the same values, bit for bit."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor
    mesh = init_device_mesh("cpu", (WORLD,))
    torch.manual_seed(0)
    w, grads = torch.randn(64, 100), [torch.randn(64, 100) for _ in range(3)]
    out = []
    for sharded in (True, False):
        p = nn.Parameter(distribute_tensor(w.clone(), mesh, [Replicate()]) if sharded
                         else w.clone())
        opt = ampc.optim.AdamW([p], lr=LR, moments="8bit")
        for g in grads:
            p.grad = distribute_tensor(g, mesh, [Replicate()]) if sharded else g.clone()
            opt.step()
        out.append([full(p)] + [full(opt.state[p][k]) for k in
                                ("exp_avg_codes", "exp_avg_sq_codes", "exp_avg_scale",
                                 "exp_avg_sq_scale")])
    return out


def test_replicated_dtensor_8bit_step_is_the_plain_step(tmp_path):
    for sharded, plain in run_ranks(_replicated, tmp_path=tmp_path):
        assert sharded[3].shape == (25,)        # 6400 elements: 25 blocks of the whole
        assert_same_bits(sharded, plain, "Replicate DTensor vs plain")


def _runs(rank, name, ckpt):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (get_optimizer_state_dict,
                                                         set_optimizer_state_dict)
    dtype = dtype_of(name)
    out = {}
    for aligned in (True, False):
        for wrap in (ddp, fsdp):
            model = wrap(make_model(dtype=dtype, aligned=aligned))
            opt = ampc.optim.AdamW(model.parameters(), lr=LR, **OPTIONS[name])
            out[wrap.__name__, aligned] = train(model, opt, 6, rank, dtype, plants=(2,)), \
                [full(p) for p in model.parameters()]

    # with the folded clip: 3 steps, saved, 3 more
    model = fsdp(make_model(dtype=dtype, aligned=False))
    opt = ampc.optim.AdamW(model.parameters(), lr=LR, **OPTIONS[name])
    trace = train(model, opt, 3, rank, dtype, plants=(2,), clip=0.5)
    out["scales_shape"] = [tuple(opt.state[p]["exp_avg_scale"].shape)
                           if "exp_avg_scale" in opt.state[p] else None
                           for p in model.parameters()]
    dcp.save({"model": model.state_dict(), "optim": get_optimizer_state_dict(model, opt)},
             checkpoint_id=ckpt)
    out["at_save"] = [full(p) for p in model.parameters()], local_state(model, opt)
    trace += train(model, opt, 3, rank, dtype, first=3, clip=0.5)
    out["clipped"] = trace, [full(p) for p in model.parameters()], local_state(model, opt)

    # resume: a fresh model and optimizer, the checkpoint, the same 3 steps
    model = fsdp(make_model(seed=1, dtype=dtype, aligned=False))
    opt = ampc.optim.AdamW(model.parameters(), lr=LR, **OPTIONS[name])
    sd = {"model": model.state_dict(), "optim": get_optimizer_state_dict(model, opt)}
    dcp.load(sd, checkpoint_id=ckpt)
    model.load_state_dict(sd["model"])
    set_optimizer_state_dict(model, opt, sd["optim"])
    # a state of another layout (plain tensors, as torch.load gives) is refused, unchanged
    before = local_state(model, opt)
    plain = opt.state_dict()
    plain["state"] = {k: {n: full(t) for n, t in v.items()} for k, v in plain["state"].items()}
    try:
        opt.load_state_dict(plain)
        out["refused"] = None
    except ValueError as e:
        out["refused"] = str(e)
    out["unchanged"] = before, local_state(model, opt)
    out["resumed"] = train(model, opt, 3, rank, dtype, first=3, clip=0.5), \
        [full(p) for p in model.parameters()], local_state(model, opt)
    return out


@pytest.fixture(scope="module", params=list(OPTIONS))
def runs(request, tmp_path_factory):
    tmp = tmp_path_factory.mktemp(request.param)
    return request.param, tmp / "ckpt", run_ranks(_runs, request.param, str(tmp / "ckpt"),
                                                  tmp_path=tmp / "ranks")


def test_ddp_ranks_agree(runs):
    _, _, (r0, r1) = runs
    for aligned in (True, False):
        assert_same_bits(r0["ddp", aligned], r1["ddp", aligned], "ddp rank 0 vs 1")


def test_fsdp2_scales_are_per_shard(runs):
    name, _, (r0, _) = runs
    if name == "bf16_moments":
        assert r0["scales_shape"] == [None] * 6
    else:   # (ranks, blocks of the larger shard): 32 and ceil(34 * 64 / 256) = 9
        assert r0["scales_shape"] == [(2, 32), None, (2, 9), None, None, None]


def _max_diff(a, b):
    return max((x.double() - y.double()).abs().max().item() for x, y in zip(a, b))


# Every layout here draws random bits (the 8-bit second moment's codes, bf16 moments,
# stochastic rounding), keyed by the element's index in the shard, so FSDP2's steps are
# DDP's up to other rounding (and, unaligned, other blocks): that moves each step's update
# by a fraction of lr (Adam's update is at most about lr an element); over 6 steps, 4 of
# them taken, under lr per element. (fp32 moments, which draw none, are bit for bit DDP's:
# tests/distributed/test_distributed.py.)
_TOLERANCE = 4 * LR


def test_fsdp2_lean_step_matches_ddp(runs):
    name, _, (r0, r1) = runs
    for aligned in (True, False):
        trace, params = r0["fsdp", aligned]
        ddp_trace, ddp_params = r0["ddp", aligned]
        # the skip at the planted inf and the scale: the same on both ranks and as DDP
        assert trace == ddp_trace, aligned
        assert_same_bits(r0["fsdp", aligned], r1["fsdp", aligned], "rank 0 vs rank 1")
        assert 0 < _max_diff(params, ddp_params) <= _TOLERANCE, (aligned, name)


def test_fsdp2_clip_norm_and_skip_agree_across_ranks(runs):
    _, _, (r0, r1) = runs
    assert_same_bits(r0["clipped"][:2], r1["clipped"][:2], "rank 0 vs rank 1")
    trace = r0["clipped"][0]
    assert trace[2][0] == trace[1][0] / 2        # backed off at the planted inf
    assert all(n > 0 for _, n in trace[:2] + trace[3:])


def test_dcp_save_load_resumes_bit_exactly(runs):
    _, _, ranks = runs
    for r in ranks:
        assert_same_bits(r["resumed"], (r["clipped"][0][3:],) + r["clipped"][1:], "resumed")


def test_sharded_load_of_plain_tensors_is_refused_before_anything_changes(runs):
    _, _, ranks = runs
    for r in ranks:
        assert "is a plain tensor but the param is a DTensor" in r["refused"]
        assert_same_bits(*r["unchanged"], "state after the refused load")


def test_two_rank_checkpoint_loads_into_one_process(runs, tmp_path):
    """The DCP checkpoint consolidated (dcp_to_torch_save) loads into a plain single-process
    optimizer: the per-shard 8-bit codes decode to the very moments the ranks held, are
    re-encoded in blocks of the whole tensor, and training goes on."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    name, ckpt, (r0, r1) = runs
    dtype = dtype_of(name)
    dcp_to_torch_save(ckpt, tmp_path / "whole.pt")
    sd = torch.load(tmp_path / "whole.pt", weights_only=True)
    model = make_model(seed=1, dtype=dtype, aligned=False)
    model.load_state_dict(sd["model"])
    params, _ = r0["at_save"]
    assert_same_bits([p.detach() for p in model.parameters()], params, "weights")
    fqns = [n for n, _ in model.named_parameters()]
    saved = sd["optim"]
    optim_sd = {"state": {i: saved["state"][f] for i, f in enumerate(fqns)},
                "param_groups": [dict(g, params=[fqns.index(f) for f in g["params"]])
                                 for g in saved["param_groups"]]}
    for i, f in enumerate(fqns):    # the whole checkpoint decodes to what the ranks held
        m, v = decode_moments(saved["state"][f])
        m0, v0 = r0["at_save"][1][i][1]
        m1, v1 = r1["at_save"][1][i][1]
        assert_same_bits((m, v), (torch.cat([m0, m1]), torch.cat([v0, v1])), f"moments {f}")
    opt = ampc.optim.AdamW(model.parameters(), lr=LR, **OPTIONS[name])
    opt.load_state_dict(optim_sd)
    for i, p in enumerate(model.parameters()):
        st = opt.state[p]
        if name != "bf16_moments" and i in (0, 2):     # whole-tensor blocks now
            assert st["exp_avg_scale"].shape == (-(-p.numel() // ampc.ops.QBLOCK),)
        m, v = decode_moments(st)
        m_ref, v_ref = decode_moments(saved["state"][fqns[i]])
        # re-encoded in other blocks: within the 8-bit codes' relative step (1/8 for
        # exp_avg, about 1/8 for the square of exp_avg_sq's 4-bit-mantissa root) of the
        # block's absmax
        torch.testing.assert_close(m, m_ref, rtol=0.13, atol=1e-12)
        torch.testing.assert_close(v, v_ref, rtol=0.13, atol=1e-20)
        assert float(st["step"]) == float(saved["state"][fqns[i]]["step"])
    x, y = batch(3, 0, dtype)
    nn.functional.mse_loss(model(x).float(), y).backward()
    opt.step()
    assert all(torch.isfinite(p).all() for p in model.parameters())
