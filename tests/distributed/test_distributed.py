"""ampc under torch.distributed: DDP and FSDP2 on 2 ranks, gloo, CPU.

Each test runs its ranks in fresh processes (spawned, a free port each) and judges what
they return. DDP needs nothing from ampc: its all-reduce gives every rank the same
grads. Under FSDP2 (fully_shard, DTensor params) the optimizer runs on local shards and
the scaler agrees on inf/nan and the norm across ranks; the oracle is DDP on the same
model and data, bit for bit, with shards of uneven sizes (one rank's shard empty).
"""
import os
import socket
import sys
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import ampc

WORLD = 2
TIMEOUT_S = 300          # a loaded 2-core machine starts two torch processes slowly

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch without distributed")


# ---- running ranks ----

def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank, port, fn, args, out_dir, backend):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD))
    torch.set_num_threads(1)
    dist.init_process_group(backend, rank=rank, world_size=WORLD,
                            timeout=timedelta(seconds=TIMEOUT_S))
    try:
        result = fn(rank, *args)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    torch.save(result, os.path.join(out_dir, f"{rank}.pt"))
    # The result is on disk: leave without the interpreter's teardown, in which torch now and
    # then aborts a rank ("terminate called without an active exception") as it frees what
    # holds a gloo group (seen under load, after FSDP2 runs; docs/distributed.md)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_ranks(fn, *args, tmp_path, backend="gloo"):
    """fn(rank, *args) on WORLD fresh processes with a process group; what each returned,
    by rank. An exception in a rank fails the test with that rank's traceback."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    ctx = mp.start_processes(_entry, args=(_free_port(), fn, args, str(tmp_path), backend),
                             nprocs=WORLD, join=False, start_method="spawn")
    deadline = time.monotonic() + 2 * TIMEOUT_S
    while not ctx.join(timeout=5):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail(f"{fn.__name__}: ranks still running after {2 * TIMEOUT_S} s")
    return [torch.load(tmp_path / f"{r}.pt", weights_only=False) for r in range(WORLD)]


# ---- model, data, the two wrappers ----

def make_model(seed=0):
    """Dims chosen so that FSDP2's shards are uneven (37 rows: 19 and 18; 1 row: 1 and 0)
    and the flat sizes leave different tails of 16 on the full tensors and the shards."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(24, 37), nn.GELU(), nn.Linear(37, 11), nn.Tanh(),
                         nn.Linear(11, 1))


def batch(step, rank):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(8, 24, generator=g), torch.randn(8, 1, generator=g)


def ddp(model):
    return nn.parallel.DistributedDataParallel(model)


def fsdp(model, **kwargs):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh("cpu", (WORLD,))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh, **kwargs)
    return fully_shard(model, mesh=mesh, **kwargs)


def full(t):
    """The whole tensor on every rank: a DTensor gathered, anything else as it is."""
    t = t.full_tensor() if hasattr(t, "full_tensor") else t
    return t.detach().clone()


def snapshot(model, opt=None):
    out = {"params": [full(p) for p in model.parameters()]}
    if opt is not None:
        out["state"] = [{k: full(v) for k, v in sorted(opt.state[p].items())}
                        for g in opt.param_groups for p in g["params"]]
    return out


@torch.no_grad()
def plant(model, value):
    """value into the first element of this rank's local shard of the last grad that has
    one there (under FSDP2 the other rank's shards stay finite)."""
    for p in reversed(list(model.parameters())):
        g = p.grad.to_local()
        if g.numel():
            g.view(-1)[0] = value
            return


def train(model, opt, steps, *, rank, scaler=None, autocast=None, clip=None, plants=(),
          torch_clip=False):
    """A few steps; `plants`: the steps at which rank 1 gets an inf: in its input under
    DDP (whose all-reduce spreads it), in its local shard of a grad under FSDP2. Returns
    the scale, skip count and norm of every step."""
    trace = []
    skips = 0
    sharded = hasattr(next(model.parameters()), "to_local")
    for step in range(steps):
        x, y = batch(step, rank)
        if step in plants and rank == 1 and not sharded:
            x[0, 0] = float("inf")
        opt.zero_grad(set_to_none=True)
        with autocast() if autocast else torch.enable_grad():
            loss = nn.functional.mse_loss(model(x).float(), y)
        (scaler.scale(loss) if scaler else loss).backward()
        if step in plants and rank == 1 and sharded:
            plant(model, float("inf"))
        norm = None
        if clip and scaler and not torch_clip:
            norm = scaler.clip_grad_norm_(opt, clip)
        elif clip:
            if scaler:
                scaler.unscale_(opt)
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        if scaler:
            scaler.step(opt)
            # torch's scaler has no skip counter: both have this flag per device
            skips += any(bool(f) for f in scaler._found_inf_per_device(opt).values())
            scaler.update()
            trace.append((scaler.get_scale(), skips, None if norm is None else float(norm)))
        else:
            opt.step()
            trace.append((None, None, None if norm is None else float(norm)))
    return trace


def adamw(model):
    return ampc.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)


def scaler(cls=ampc.GradScaler):
    return cls("cpu", init_scale=2.0 ** 10, growth_interval=2)


def assert_same_bits(a, b, what):
    if isinstance(a, dict):
        assert a.keys() == b.keys(), what
        for k in a:
            assert_same_bits(a[k], b[k], f"{what}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), what
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same_bits(x, y, f"{what}[{i}]")
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, what
        assert torch.equal(a.view(-1).view(torch.uint8) if a.numel() else a,
                           b.view(-1).view(torch.uint8) if b.numel() else b), \
            f"{what}: bits differ (max diff {(a.double() - b.double()).abs().max()})"
    else:
        both_nan = isinstance(a, float) and isinstance(b, float) and a != a and b != b
        assert a == b or both_nan, f"{what}: {a} != {b}"


# ---- DDP: works as it is ----

def _ddp_runs(rank):
    plants = (2,)
    out = {}
    # fp32 weights, bf16 autocast, loss scaling: ampc's three parts against torch's three
    model = ddp(make_model())
    opt = adamw(model)
    out["ampc"] = train(model, opt, 6, rank=rank, scaler=scaler(), plants=plants,
                        autocast=lambda: ampc.autocast("cpu", dtype=torch.bfloat16)), \
        snapshot(model, opt)
    model = ddp(make_model())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01, fused=True)
    out["torch"] = train(model, opt, 6, rank=rank, scaler=scaler(torch.amp.GradScaler),
                         plants=plants,
                         autocast=lambda: torch.autocast("cpu", dtype=torch.bfloat16)), \
        snapshot(model)
    # bf16 weights through prepare (fp32 masters), no scaler
    model, opt = ampc.prepare(make_model(), ampc.optim.AdamW, torch.bfloat16, lr=1e-2)
    model = ddp(model)
    out["prepare"] = train(model, opt, 4, rank=rank), snapshot(model, opt)
    # fp16 autocast with the folded clip
    model = ddp(make_model())
    opt = adamw(model)
    out["fp16_clip"] = train(model, opt, 6, rank=rank, scaler=scaler(), clip=0.5, plants=plants,
                             autocast=lambda: ampc.autocast("cpu", dtype=torch.float16)), \
        snapshot(model, opt)
    return out


@pytest.fixture(scope="module")
def ddp_runs(tmp_path_factory):
    return run_ranks(_ddp_runs, tmp_path=tmp_path_factory.mktemp("ddp"))


def test_ddp_ranks_stay_bit_identical(ddp_runs):
    r0, r1 = ddp_runs
    for name in r0:
        assert_same_bits(r0[name], r1[name], name)


def test_ddp_ampc_matches_torch_autocast_scaler_fused_adamw(ddp_runs):
    (trace, ours), (their_trace, theirs) = ddp_runs[0]["ampc"], ddp_runs[0]["torch"]
    assert trace == their_trace
    # fused AdamW rounds the last numel % 16 elements of each tensor within an ulp of ampc
    for a, b in zip(ours["params"], theirs["params"]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_ddp_inf_on_one_rank_skips_on_both(ddp_runs):
    for rank, run in enumerate(ddp_runs):
        for name in ("ampc", "torch", "fp16_clip"):
            trace = run[name][0]
            assert [skips for _, skips, _ in trace] == [0, 0, 1, 1, 1, 1], (rank, name)
            assert trace[2][0] == trace[1][0] / 2, (rank, name)     # backed off at the plant


# ---- FSDP2: the optimizer on local shards ----

def _fsdp_vs_ddp(rank):
    out = {}
    for name, wrap in (("ddp", ddp), ("fsdp", fsdp)):
        model = wrap(make_model())
        opt = adamw(model)
        out[name] = train(model, opt, 6, rank=rank, scaler=scaler()), snapshot(model, opt)
        if name == "fsdp":
            out["fsdp_local_shapes"] = [tuple(opt.state[p]["exp_avg"].to_local().shape)
                                        for p in model.parameters()]
    # against torch's fused AdamW on the same shards (no scaler: torch's has no DTensor path)
    for name, make_opt in (("ampc", adamw), ("torch", lambda m: torch.optim.AdamW(
            m.parameters(), lr=1e-2, weight_decay=0.01, fused=True))):
        model = fsdp(make_model())
        opt = make_opt(model)
        train(model, opt, 6, rank=rank)
        out["fsdp_" + name] = snapshot(model)
    return out


@pytest.fixture(scope="module")
def fsdp_vs_ddp(tmp_path_factory):
    return run_ranks(_fsdp_vs_ddp, tmp_path=tmp_path_factory.mktemp("fsdp_vs_ddp"))


def test_fsdp2_adamw_equals_ddp_bit_for_bit_on_uneven_shards(fsdp_vs_ddp):
    r0, r1 = fsdp_vs_ddp
    # the shards are uneven, one of them empty
    assert r0["fsdp_local_shapes"] == [(19, 24), (19,), (6, 37), (6,), (1, 11), (1,)]
    assert r1["fsdp_local_shapes"] == [(18, 24), (18,), (5, 37), (5,), (0, 11), (0,)]
    for r in (r0, r1):
        assert_same_bits(r["fsdp"], r["ddp"], "fsdp vs ddp")
    assert_same_bits(r0["fsdp"], r1["fsdp"], "rank 0 vs rank 1")


def test_fsdp2_adamw_matches_torch_fused_adamw_on_the_same_shards(fsdp_vs_ddp):
    r0, _ = fsdp_vs_ddp
    # torch's scalar tail (numel % 16 of each shard) rounds within an ulp of ampc's
    for a, b in zip(r0["fsdp_ampc"]["params"], r0["fsdp_torch"]["params"]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


# ---- FSDP2: the scaler agrees across ranks ----

def _inf_in_one_shard(rank):
    plants = (1, 3, 4)
    out = {}
    for path in ("check", "unscale", "fold_clip", "torch_clip"):
        model = fsdp(make_model())
        opt = adamw(model)
        s = scaler()
        kwargs = {"check": {}, "unscale": {"clip": 1e9, "torch_clip": True},
                  "fold_clip": {"clip": 0.5}, "torch_clip": {"clip": 0.5, "torch_clip": True}}
        out[path] = train(model, opt, 6, rank=rank, scaler=s, plants=plants, **kwargs[path]), \
            snapshot(model, opt)
    # an optimizer without fused scaling: the scaler's own skip decision (one host read)
    model = fsdp(make_model())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = snapshot(model)
    trace = train(model, opt, 2, rank=rank, scaler=scaler(), plants=(0, 1))
    out["sgd"] = trace, before, snapshot(model)
    return out


def test_fsdp2_inf_in_one_ranks_shard_skips_on_every_rank(tmp_path):
    r0, r1 = run_ranks(_inf_in_one_shard, tmp_path=tmp_path)
    for path in ("check", "unscale", "fold_clip", "torch_clip"):
        trace0, trace1 = r0[path][0], r1[path][0]
        assert [t[:2] for t in trace0] == [t[:2] for t in trace1], path
        assert [skips for _, skips, _ in trace0] == [0, 1, 1, 2, 3, 3], path
        assert [scale for scale, _, _ in trace0] == [2.0 ** 10, 2.0 ** 9, 2.0 ** 9, 2.0 ** 8,
                                                     2.0 ** 7, 2.0 ** 7], path
        assert_same_bits(r0[path][1], r1[path][1], path)
        steps = {float(st["step"]) for st in r0[path][1]["state"]}
        assert steps == {3.0}, path
    trace, before, after = r0["sgd"]
    assert [skips for _, skips, _ in trace] == [1, 2]
    assert_same_bits(before, after, "sgd after skipped steps")
    assert_same_bits(r0["sgd"], r1["sgd"], "sgd")


def clip_adamw(model):
    # eps of the grads' size: the step depends on the clip factor (with eps ~0 Adam's
    # first step would not)
    return ampc.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-3)


def _folded_clip(rank):
    return _folded_clip_fsdp(rank), _folded_clip_ddp(rank)


def _folded_clip_fsdp(rank):
    model = fsdp(make_model())
    opt = clip_adamw(model)
    s = scaler()
    x, y = batch(0, rank)
    s.scale(nn.functional.mse_loss(model(x), y)).backward()
    full_grads = [full(p.grad) / s.get_scale() for p in model.parameters()]
    own_norm = torch.stack([p.grad.to_local().norm() for p in model.parameters()]).norm()
    norm = s.clip_grad_norm_(opt, 0.01)
    s.step(opt)
    s.update()
    return {"norm": norm, "full_grads": full_grads, "fsdp": snapshot(model, opt),
            "sharded_norm": own_norm / s.get_scale()}


def _folded_clip_ddp(rank):
    model = ddp(make_model())
    opt = clip_adamw(model)
    s = scaler()
    x, y = batch(0, rank)
    s.scale(nn.functional.mse_loss(model(x), y)).backward()
    norm = s.clip_grad_norm_(opt, 0.01)
    s.step(opt)
    s.update()
    return {"norm": norm, "ddp": snapshot(model, opt)}


def test_fsdp2_folded_clip_norm_is_the_norm_of_the_full_grads(tmp_path):
    (r0, d0), (r1, _) = run_ranks(_folded_clip, tmp_path=tmp_path)
    expected = torch.cat([g.double().reshape(-1) for g in r0["full_grads"]]).norm()
    torch.testing.assert_close(r0["norm"].double(), expected, rtol=1e-5, atol=0)
    assert_same_bits(r0["norm"], r1["norm"], "the norm on both ranks")
    # a local norm alone would be smaller: the test would notice a missing reduction
    assert r0["sharded_norm"] < 0.99 * r0["norm"]
    assert r0["norm"] > 0.01                    # so the clip is active
    # the same clip factor on every rank: the same step as DDP's (norm rounding aside)
    torch.testing.assert_close(r0["norm"], d0["norm"], rtol=1e-5, atol=0)
    for a, b in zip(r0["fsdp"]["params"], d0["ddp"]["params"]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    assert_same_bits(r0["fsdp"], r1["fsdp"], "rank 0 vs rank 1")


# ---- FSDP2: torch.distributed.checkpoint ----

def _dcp_resume(rank, ckpt_dir):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    def setup(seed=0, init_scale=2.0 ** 10):
        model = fsdp(make_model(seed).to(torch.bfloat16))    # bf16 shards, fp32 masters
        return model, adamw(model), ampc.GradScaler("cpu", init_scale, growth_interval=2)

    def run(model, opt, s, first):
        trace = []
        for step in range(first, first + 3):
            x, y = batch(step, rank)
            opt.zero_grad(set_to_none=True)
            s.scale(nn.functional.mse_loss(model(x.bfloat16()).float(), y)).backward()
            if step == 1 and rank == 1:
                plant(model, float("inf"))
            s.clip_grad_norm_(opt, 1.0)
            s.step(opt)
            s.update()
            trace.append((s.get_scale(), s.state_dict()["_growth_tracker"]))
        return trace

    model, opt, s = setup()
    run(model, opt, s, 0)
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd, "scaler": s.state_dict()}, checkpoint_id=ckpt_dir)
    straight = run(model, opt, s, 3), snapshot(model, opt)

    model, opt, s = setup(seed=1, init_scale=3.0)    # fresh: other weights and scale
    msd, osd = get_state_dict(model, opt)
    loaded = {"model": msd, "optim": osd, "scaler": scaler().state_dict()}
    dcp.load(loaded, checkpoint_id=ckpt_dir)
    set_state_dict(model, opt, model_state_dict=loaded["model"], optim_state_dict=loaded["optim"])
    s.load_state_dict(loaded["scaler"])
    kinds = sorted({(k, type(v).__name__) for st in opt.state.values() for k, v in st.items()})
    resumed = run(model, opt, s, 3), snapshot(model, opt)
    return straight, resumed, kinds


def test_fsdp2_dcp_save_load_resumes_bit_exact(tmp_path):
    r0, r1 = run_ranks(_dcp_resume, str(tmp_path / "ckpt"), tmp_path=tmp_path)
    for r in (r0, r1):
        straight, resumed, kinds = r
        assert kinds == [("exp_avg", "DTensor"), ("exp_avg_sq", "DTensor"),
                         ("master", "DTensor"), ("step", "Tensor")]
        assert_same_bits(resumed, straight, "resumed vs straight")
        (trace, snap) = straight
        # saved: scale 2**9 (backed off at step 1), 1 clean step: grows at once
        assert trace == [(2.0 ** 10, 0), (2.0 ** 10, 1), (2.0 ** 11, 0)]
        assert {st["master"].dtype for st in snap["state"]} == {torch.float32}
    assert_same_bits(r0[0], r1[0], "rank 0 vs rank 1")


# ---- bad setups get clear errors ----

def _error(call):
    try:
        call()
    except Exception as e:          # noqa: BLE001: the message is what is judged
        return f"{type(e).__name__}: {e}"
    return "no error"


def _bad_setups(rank):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, Partial, Shard, distribute_tensor

    out = {}
    mesh = init_device_mesh("cpu", (WORLD,))
    mesh2d = init_device_mesh("cpu", (WORLD, 1), mesh_dim_names=("dp", "tp"))
    a = nn.Parameter(distribute_tensor(torch.ones(4, 3), mesh, [Shard(0)]))
    b = nn.Parameter(distribute_tensor(torch.ones(4, 3), mesh2d, [Shard(0), Shard(1)]))
    out["meshes"] = _error(lambda: ampc.optim.AdamW([a, b]))
    out["mixed"] = _error(lambda: ampc.optim.AdamW([a, nn.Parameter(torch.ones(2))]))
    partial = nn.Parameter(DTensor.from_local(torch.ones(2), mesh, [Partial()]))
    out["partial"] = _error(lambda: ampc.optim.AdamW([partial]))
    # a separate group per mesh is fine
    ampc.optim.AdamW([{"params": [a]}, {"params": [b]}])

    # a Partial grad reaching the scaler
    opt = ampc.optim.AdamW([a])
    a.grad = DTensor.from_local(torch.ones(4, 3), mesh, [Partial()])
    s = scaler()
    s.scale(torch.ones(()))
    out["partial_grad"] = _error(lambda: s.step(opt))

    model = fsdp(make_model())
    out["prepare_after"] = _error(lambda: ampc.prepare(model, ampc.optim.AdamW))

    model, opt = ampc.prepare(make_model(), ampc.optim.AdamW, torch.bfloat16)
    fsdp(model)
    out["prepare_before"] = _error(lambda: model(batch(0, rank)[0]))

    # the process group gone before the scaler needs it
    model = fsdp(make_model())
    opt = adamw(model)
    s = scaler()
    s.scale(model(batch(0, rank)[0]).sum()).backward()
    dist.barrier()
    dist.destroy_process_group()
    out["no_process_group"] = _error(lambda: s.step(opt))
    return out


@pytest.fixture(scope="module")
def bad_setups(tmp_path_factory):
    return run_ranks(_bad_setups, tmp_path=tmp_path_factory.mktemp("errors"))


@pytest.mark.parametrize("case, pattern", [
    ("meshes", r"ValueError: ampc.optim.AdamW: params 0 and 1 of param group 0 are DTensors "
               r"on different device meshes"),
    ("mixed", r"ValueError: ampc.optim.AdamW: param group 0 mixes DTensor params .* and plain"),
    ("partial", r"ValueError: ampc.optim.AdamW: param 0 of group 0 has a Partial placement"),
    ("partial_grad", r"ValueError: ampc.GradScaler: a gradient has a Partial placement"),
    ("prepare_after", r"RuntimeError: ampc.prepare: parameter 0.weight is a DTensor .*"
                      r"MixedPrecisionPolicy\(param_dtype=torch.bfloat16"),
    ("prepare_before", r"RuntimeError: ampc.prepare: the optimizer's params are no longer the "
                       r"model's \(fully_shard"),
    ("no_process_group", r"RuntimeError: ampc.GradScaler: .* process group, which is not "
                         r"initialized"),
])
def test_bad_setup_gets_a_clear_error(bad_setups, case, pattern):
    import re
    for rank, got in enumerate(bad_setups):
        assert re.match(pattern, got[case], re.S), f"rank {rank}: {got[case]}"


def test_prepare_refuses_a_model_whose_params_were_replaced_after_it():
    # what fully_shard after prepare does, in one process: the optimizer would step
    # tensors that no gradient reaches
    model, opt = ampc.prepare(make_model(), ampc.optim.AdamW)
    model[0].weight = nn.Parameter(model[0].weight.detach().clone())
    with pytest.raises(RuntimeError, match="the optimizer's params are no longer the model's"):
        model(batch(0, 0)[0])


def test_prepare_check_passes_once_and_spares_copies_of_the_model():
    import copy
    model, opt = ampc.prepare(make_model(), ampc.optim.AdamW)
    ema = copy.deepcopy(model)                  # holds other params: not the optimizer's
    x = batch(0, 0)[0]
    assert ema(x).dtype == model(x).dtype == torch.bfloat16
    assert len(model._forward_pre_hooks) == 1   # the check removed itself; the input cast stays


# ---- GPUs (NCCL): the same oracle, where there are two ----

@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < WORLD, reason=f"needs {WORLD} GPUs")
def test_fsdp2_adamw_equals_ddp_on_gpus_nccl(tmp_path):
    r0, r1 = run_ranks(_fsdp_vs_ddp_cuda, tmp_path=tmp_path, backend="nccl")
    for r in (r0, r1):
        assert_same_bits(r["fsdp"], r["ddp"], "fsdp vs ddp")


def _fsdp_vs_ddp_cuda(rank):
    torch.cuda.set_device(rank)
    out = {}
    for name in ("ddp", "fsdp"):
        model = make_model().cuda()
        if name == "ddp":
            model = nn.parallel.DistributedDataParallel(model)
        else:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard
            mesh = init_device_mesh("cuda", (WORLD,))
            for layer in model:
                if isinstance(layer, nn.Linear):
                    fully_shard(layer, mesh=mesh)
            fully_shard(model, mesh=mesh)
        opt = adamw(model)
        s = ampc.GradScaler("cuda", init_scale=2.0 ** 10, growth_interval=2)
        for step in range(4):
            x, y = (t.cuda() for t in batch(step, rank))
            opt.zero_grad(set_to_none=True)
            s.scale(nn.functional.mse_loss(model(x), y)).backward()
            s.step(opt)
            s.update()
        out[name] = {k: [t.cpu() for t in v] for k, v in snapshot(model).items()}
    return out
