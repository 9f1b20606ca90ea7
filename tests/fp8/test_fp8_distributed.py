"""ampc.fp8 under torch.distributed: delayed scaling's amaxes reduced (MAX) across ranks.

2 ranks, gloo, CPU, each fed its own data. With DelayedScaling(reduce_amax=True) (the
default) every rank ends each step with the same FP8 state, bit for bit, equal to a Python
reference of the rules (test_fp8_scaling.ref_step) fed the max over ranks and over a
module's uses; reduce_amax=False (the control) and current scaling keep each rank's own
amaxes, and their states differ. DDP and FSDP2 runs of a small model agree across ranks.
A count of the collectives shows one per region exit and one per backward pass.
"""
import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl, checkpoint_wrapper)

from ampc import fp8
from test_distributed import WORLD, assert_same_bits, ddp, fsdp, full, run_ranks
from test_fp8_scaling import f32_bits, ref_step

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch without distributed")

STEPS = 6
STATE = ("fp8_fwd_amax_history", "fp8_fwd_scale", "fp8_fwd_scale_inv",
         "fp8_bwd_amax_history", "fp8_bwd_scale", "fp8_bwd_scale_inv")
RECIPES = {
    "max": fp8.DelayedScaling(amax_history_len=4),
    "most_recent": fp8.DelayedScaling(amax_history_len=1, amax_compute_algo="most_recent",
                                      margin=1, fp8_format=fp8.Format.E4M3),
    "group": fp8.DelayedScaling(amax_history_len=4),      # an explicit group of both ranks
    "control": fp8.DelayedScaling(amax_history_len=4, reduce_amax=False),
    "current": fp8.Float8CurrentScaling(),
}


# ---- data: the larger rank alternates; zeros, an inf and a NaN at chosen steps ----

def step_data(step, rank):
    g = torch.Generator().manual_seed(100 * step + rank)
    size = 5.0 if (step + rank) % 2 else 1.0
    x1, x2, x3 = (torch.randn(r, 32, generator=g) * size for r in (24, 24, 8))
    g1, g2, g3 = (torch.randn(r, c, generator=g) * size for r, c in ((24, 32), (24, 32), (8, 16)))
    if step == 2 and rank == 0:
        x1.zero_()                  # one rank's use sees only zeros
    if step == 3 and rank == 1:
        x3[1, 2] = float("nan")     # the reduced amax is NaN on every rank
    if step == 4 and rank == 0:
        g1[0, 0] = float("inf")
    if step == 5:
        x3.zero_()                  # every rank zero: history and scale left alone
    return (x1, x2, x3), (g1, g2, g3)


def amax(t):
    v = [abs(a) for a in t.reshape(-1).tolist()]
    return math.nan if any(a != a for a in v) else max(v, default=0.0)


def union(values):
    """The amax of the union of the data: the max, NaN if any is NaN."""
    return math.nan if any(v != v for v in values) else max(values)


# ---- the ranks ----

def snapshot(*modules):
    return [{k: getattr(m, k).clone() for k in STATE} for m in modules]


def _two_linears(rank, recipe, group):
    torch.manual_seed(0)
    lin_a, lin_b = fp8.Linear(32, 32), fp8.Linear(32, 16)
    states = []
    for step in range(STEPS):
        (x1, x2, x3), (g1, g2, g3) = step_data(step, rank)
        with fp8.autocast(recipe=recipe, fp8_group=group):
            y1, y2, y3 = lin_a(x1), lin_a(x2), lin_b(x3)        # lin_a used twice
        ((y1 * g1).sum() + (y2 * g2).sum() + (y3 * g3).sum()).backward()
        states.append(snapshot(lin_a, lin_b))
    return {"states": states, "weights": [lin_a.weight.detach(), lin_b.weight.detach()]}


def _counts(rank, recipe, group=None):
    """The sizes of the all_reduce calls (dist.all_reduce wrapped in this process) of 2
    steps of a 3-layer model and a region left by an exception, after each phase."""
    calls, real = [], dist.all_reduce

    def counting(tensor, *args, **kwargs):
        calls.append(tensor.numel())
        return real(tensor, *args, **kwargs)
    dist.all_reduce = counting
    try:
        return _phases(rank, recipe, group, calls)
    finally:
        dist.all_reduce = real


def _phases(rank, recipe, group, calls):
    torch.manual_seed(0)
    model = nn.Sequential(fp8.Linear(32, 32), nn.GELU(), fp8.Linear(32, 32), nn.GELU(),
                          fp8.Linear(32, 16))
    seen = []
    for step in range(2):
        (x, _, _), _ = step_data(step, rank)
        with fp8.autocast(recipe=recipe, fp8_group=group):
            out = model(x)
            seen.append(("in region", list(calls)))
        seen.append(("exit", list(calls)))
        out.square().mean().backward()
        seen.append(("backward", list(calls)))
    try:                    # a region left by an exception reduces nothing
        with fp8.autocast(recipe=recipe, fp8_group=group):
            model(x)
            raise KeyError("stop")
    except KeyError:
        pass
    seen.append(("exception", list(calls)))
    return seen


def _reductions(rank):
    out = {}
    both = dist.new_group([0, 1])
    for name, recipe in RECIPES.items():
        out[name] = _two_linears(rank, recipe, both if name == "group" else None)
    out["counts"] = _counts(rank, fp8.DelayedScaling())
    out["counts_control"] = _counts(rank, fp8.DelayedScaling(reduce_amax=False))
    out["counts_current"] = _counts(rank, fp8.Float8CurrentScaling())
    alone = dist.new_group([0])     # every rank takes part; rank 1 is not a member
    if rank == 0:
        out["counts_one_rank_group"] = _counts(rank, fp8.DelayedScaling(), alone)
    else:
        try:
            fp8.autocast(fp8_group=alone)
        except ValueError as e:
            out["not_member"] = str(e)
    return out


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return run_ranks(_reductions, tmp_path=tmp_path_factory.mktemp("fp8_reduce"))


# ---- the Python reference ----

def reference(recipe, weights, reduced, rank=None):
    """The states after each step by ref_step: the amaxes reduced over ranks and uses and
    applied once at the region's exit and once after backward (`reduced`), or each use's
    own amax applied right after its cast, this rank's only (forward in call order,
    backward in reverse)."""
    bwd_fmax = 448.0 if recipe.fp8_format is fp8.Format.E4M3 else 57344.0
    fmax = {"fwd": 448.0, "bwd": bwd_fmax}
    w_amax = [amax(w) for w in weights]
    # per module and kind, per tensor: (history, scale, scale_inv)
    state = [{kind: [([0.0] * recipe.history_len, 1.0, 1.0) for _ in range(n)]
              for kind, n in (("fwd", 2), ("bwd", 1))} for _ in weights]
    out = []
    for step in range(STEPS):
        data = [step_data(step, r) for r in range(WORLD)]
        # uses[module][kind]: per use (in the order they update), per rank, the amaxes
        uses = [{"fwd": [[[amax(x[0]), w_amax[0]] for x, _ in data],
                         [[amax(x[1]), w_amax[0]] for x, _ in data]],
                 "bwd": [[[amax(g[1])] for _, g in data], [[amax(g[0])] for _, g in data]]},
                {"fwd": [[[amax(x[2]), w_amax[1]] for x, _ in data]],
                 "bwd": [[[amax(g[2])] for _, g in data]]}]
        for m, module_uses in enumerate(uses):
            for kind, per_use in module_uses.items():
                if reduced:
                    steps = [[union([u[r][j] for u in per_use for r in range(WORLD)])
                              for j in range(len(per_use[0][0]))]]
                else:
                    steps = [u[rank] for u in per_use]
                for amaxes in steps:
                    state[m][kind] = [
                        ref_step(hist, a, scale, fmax[kind], recipe.margin,
                                 recipe.amax_compute_algo)
                        for (hist, scale, _), a in zip(state[m][kind], amaxes)]
        out.append(state)
        state = [{k: list(v) for k, v in s.items()} for s in state]
    return out


def bits(x):
    return "nan" if x != x else f32_bits(x)


def assert_matches_reference(got_states, want_states, what):
    for step, (got, want) in enumerate(zip(got_states, want_states)):
        for m, (g, w) in enumerate(zip(got, want)):
            for kind in ("fwd", "bwd"):
                hist = g[f"fp8_{kind}_amax_history"]
                scale, scale_inv = g[f"fp8_{kind}_scale"], g[f"fp8_{kind}_scale_inv"]
                for j, (h, s, s_inv) in enumerate(w[kind]):
                    where = f"{what}: step {step}, module {m}, {kind} tensor {j}"
                    assert [bits(v) for v in hist[:, j].tolist()] == [bits(v) for v in h], \
                        f"{where}: history {hist[:, j].tolist()}, want {h}"
                    assert bits(scale[j].item()) == bits(s), f"{where}: scale"
                    assert bits(scale_inv[j].item()) == bits(s_inv), f"{where}: scale_inv"


# ---- the tests ----

@pytest.mark.parametrize("name", ["max", "most_recent", "group"])
def test_reduced_states_agree_across_ranks_and_match_the_reference(ranks, name):
    r0, r1 = ranks[0][name], ranks[1][name]
    assert_same_bits(r0, r1, name)
    want = reference(RECIPES[name], r0["weights"], reduced=True)
    assert_matches_reference(r0["states"], want, name)


@pytest.mark.parametrize("name", ["control", "current"])
def test_without_reduction_each_rank_keeps_its_own_amaxes(ranks, name):
    """The control: the same test data, each rank's state from its own data, the ranks'
    states differ."""
    for rank in range(WORLD):
        got = ranks[rank][name]
        want = reference(RECIPES[name], got["weights"], reduced=False, rank=rank)
        assert_matches_reference(got["states"], want, f"{name}, rank {rank}")
    with pytest.raises(AssertionError):
        assert_same_bits(ranks[0][name]["states"], ranks[1][name]["states"], name)


def test_one_all_reduce_per_region_exit_and_per_backward(ranks):
    # 3 modules: forward 3 x 2 amaxes, backward 3 x 1, each with its NaN flags
    fwd, bwd = 2 * 6, 2 * 3
    for rank in range(WORLD):
        assert ranks[rank]["counts"] == [
            ("in region", []), ("exit", [fwd]), ("backward", [fwd, bwd]),
            ("in region", [fwd, bwd]), ("exit", [fwd, bwd, fwd]),
            ("backward", [fwd, bwd, fwd, bwd]), ("exception", [fwd, bwd, fwd, bwd])]
        for name in ("counts_control", "counts_current"):
            assert all(calls == [] for _, calls in ranks[rank][name]), name
    assert all(calls == [] for _, calls in ranks[0]["counts_one_rank_group"])


def test_a_group_without_this_rank_is_refused(ranks):
    assert "ampc.fp8.autocast: fp8_group is a group this rank is not a member of" in \
        ranks[1]["not_member"]


def test_bad_group_and_recipe_arguments_name_them():
    with pytest.raises(TypeError, match=r"ampc\.fp8\.autocast: fp8_group must be a "
                                        r"torch\.distributed ProcessGroup or None .* got str"):
        fp8.autocast(fp8_group="world")
    with pytest.raises(TypeError, match=r"ampc\.fp8\.DelayedScaling: reduce_amax must be a "
                                        r"bool, got 1"):
        fp8.DelayedScaling(reduce_amax=1)


# ---- DDP and FSDP2 train a small model ----

TRAIN_STEPS = 4
TRAIN_RECIPES = {"reduced": fp8.DelayedScaling(amax_history_len=8),
                 "control": fp8.DelayedScaling(amax_history_len=8, reduce_amax=False)}


# DDP takes reentrant checkpointing only with static_graph=True: that pair is left out
CHECKPOINTED = [(ddp, CheckpointImpl.NO_REENTRANT), (fsdp, CheckpointImpl.NO_REENTRANT),
                (fsdp, CheckpointImpl.REENTRANT)]


def train_batch(step, rank):
    """Rank 1's inputs are 4x rank 0's: scales made from rank 0's alone saturate them."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(16, 32, generator=g) * (4.0 if rank else 1.0), \
        torch.randn(16, 16, generator=g)


def _train(rank, wrap, recipe, checkpointed=None, compiled=False):
    torch.manual_seed(0)
    model = fp8.convert(nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 16)))
    layers = [model[0], model[2]]
    if checkpointed:    # the first layer recomputed in the backward, outside the region
        first = checkpoint_wrapper(nn.Sequential(model[0], model[1]), checkpoint_impl=checkpointed)
        model = nn.Sequential(first, model[2])
    model = wrap(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    call = torch.compile(model, backend="aot_eager") if compiled else model
    losses = []
    for step in range(TRAIN_STEPS):
        x, y = train_batch(step, rank)
        # reentrant checkpointing gives no param a gradient unless an input requires one
        x.requires_grad_(checkpointed is CheckpointImpl.REENTRANT)
        opt.zero_grad(set_to_none=True)
        with fp8.autocast(recipe=recipe):
            out = call(x)
        loss = F.mse_loss(out.float(), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return {"states": snapshot(*layers), "params": [full(p) for p in model.parameters()],
            "losses": losses}


def _trainings(rank):
    runs = {(wrap.__name__, name): _train(rank, wrap, recipe)
            for wrap in (ddp, fsdp) for name, recipe in TRAIN_RECIPES.items()}
    for wrap, impl in CHECKPOINTED:
        runs[(wrap.__name__, impl.name)] = _train(rank, wrap, TRAIN_RECIPES["reduced"], impl)
    for wrap in (ddp, fsdp):
        runs[(wrap.__name__, "compiled")] = _train(rank, wrap, TRAIN_RECIPES["reduced"],
                                                   compiled=True)
    return runs


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    return run_ranks(_trainings, tmp_path=tmp_path_factory.mktemp("fp8_train"))


def input_amaxes(rank):
    """Layer 0's input amaxes of the steps, newest first, as its history holds them."""
    return [amax(train_batch(step, rank)[0]) for step in reversed(range(TRAIN_STEPS))]


@pytest.mark.parametrize("wrap", ["ddp", "fsdp"])
def test_ddp_and_fsdp2_ranks_agree_on_the_reduced_state(trained, wrap):
    r0, r1 = trained[0][(wrap, "reduced")], trained[1][(wrap, "reduced")]
    assert_same_bits(r0["states"], r1["states"], f"{wrap}: FP8 state")
    assert_same_bits(r0["params"], r1["params"], f"{wrap}: params")
    assert all(math.isfinite(v) for v in r0["losses"] + r1["losses"])
    want = [max(a, b) for a, b in zip(input_amaxes(0), input_amaxes(1))]
    history = r0["states"][0]["fp8_fwd_amax_history"][:, 0].tolist()
    assert history == want + [0.0] * (8 - TRAIN_STEPS)


@pytest.mark.parametrize("wrap, impl", [(w.__name__, i.name) for w, i in CHECKPOINTED])
def test_a_checkpointed_layer_reduces_as_without_checkpointing(trained, wrap, impl):
    """The recomputed forward casts with the forward's scales, and its backward's amaxes
    are reduced over the forward's group (reentrant checkpointing runs the backward of the
    recomputed graph): state, params and losses those of the run without checkpointing, on
    every rank."""
    for rank in range(WORLD):
        want, got = trained[rank][(wrap, "reduced")], trained[rank][(wrap, impl)]
        assert_same_bits(got["states"], want["states"], f"{wrap}, rank {rank}: FP8 state")
        assert_same_bits(got["params"], want["params"], f"{wrap}, rank {rank}: params")
        assert got["losses"] == want["losses"]


@pytest.mark.parametrize("wrap", ["ddp", "fsdp"])
def test_compiled_training_reduces_as_eager(trained, wrap):
    """torch.compile (aot_eager) around the wrapped model: the FP8 calls run eagerly between
    its graphs and hand their amaxes to the region's reduction as in eager."""
    for rank in range(WORLD):
        want, got = trained[rank][(wrap, "reduced")], trained[rank][(wrap, "compiled")]
        assert_same_bits(got["states"], want["states"], f"{wrap}, rank {rank}: FP8 state")
        assert_same_bits(got["params"], want["params"], f"{wrap}, rank {rank}: params")
        assert got["losses"] == want["losses"]


@pytest.mark.parametrize("wrap", ["ddp", "fsdp"])
def test_ddp_and_fsdp2_without_reduction_drift_apart(trained, wrap):
    """The control. Under DDP, whose buffer broadcast hands every rank rank 0's state at
    each forward, rank 1's history holds its own last amax on top of rank 0's; under FSDP2
    each rank keeps its own."""
    r0, r1 = trained[0][(wrap, "control")], trained[1][(wrap, "control")]
    own0, own1 = input_amaxes(0), input_amaxes(1)
    h0 = r0["states"][0]["fp8_fwd_amax_history"][:TRAIN_STEPS, 0].tolist()
    h1 = r1["states"][0]["fp8_fwd_amax_history"][:TRAIN_STEPS, 0].tolist()
    assert h0 == own0
    assert h1 == (own1[:1] + own0[1:] if wrap == "ddp" else own1)
    with pytest.raises(AssertionError):
        assert_same_bits(r0["states"], r1["states"], wrap)


# ---- one process ----

def test_a_one_rank_process_group_changes_nothing(tmp_path, monkeypatch):
    """torch.distributed initialized with one rank: no collective, and the states of the
    run without it, bit for bit: each cast updates its scales right after it."""
    recipe = RECIPES["max"]
    alone = _two_linears(0, recipe, None)
    assert_matches_reference(alone["states"],
                             reference(recipe, alone["weights"], reduced=False, rank=0), "one")
    calls = []
    real = dist.all_reduce
    monkeypatch.setattr(dist, "all_reduce", lambda t, *a, **k: (calls.append(t), real(t, *a, **k)))
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0,
                            world_size=1)
    try:
        grouped = _two_linears(0, recipe, None)
    finally:
        dist.destroy_process_group()
    assert calls == []
    assert_same_bits(grouped, alone, "world size 1")
