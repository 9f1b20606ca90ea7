"""The lean state of small params packed: per group and layout one buffer of moments (two
sections), one of 8-bit scales and one of step counts, with optimizer.state[p] showing
views into them, stepped by one ops.adam_lean_packed call; and the op itself, against
ops.adam_lean bit for bit."""
import copy
import io

import pytest
import torch

import ampc
import ampc.optim
from ampc.ops import QBLOCK, blocks
from ampc.lean_state import state_bytes
from ampc.optim import _lean
from reference import assert_same

f32, bf16, u8 = torch.float32, torch.bfloat16, torch.uint8
# 8-bit moments (2-d, >= 4096 elements), fp32 moments (1-d or small), one that is not packed
SHAPES = [(64, 64), (17,), (300, 20), (5, 1000), (8,), (1,)]
BIG = (300, 300)            # over PACK_MAX


def make_params(shapes=SHAPES, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g).to(bf16)) for s in shapes]


def set_grads(params, k, present=None):
    g = torch.Generator().manual_seed(1000 + k)
    for i, p in enumerate(params):
        grad = (torch.randn(p.shape, generator=g) * 0.01).to(p.dtype)
        p.grad = grad if present is None or present[i] else None


def lean(params, **kw):
    return ampc.optim.AdamW(params, lr=1e-2, state="lean", **kw)


def unpacked(monkeypatch):
    """While in force, no param is small enough to pack."""
    monkeypatch.setattr(_lean, "PACK_MAX", -1)


def assert_same_training(a, b, opt_a, opt_b, what):
    for i, (p, q) in enumerate(zip(a, b)):
        assert_same(p.detach(), q.detach(), f"{what}: param {i}")
        assert opt_a.state[p].keys() == opt_b.state[q].keys(), f"{what}: keys of param {i}"
        for key, t in opt_a.state[p].items():
            assert_same(t, opt_b.state[q][key], f"{what}: '{key}' of param {i}")


def test_small_params_state_is_views_into_packs_with_the_lean_keys(monkeypatch):
    params = make_params(SHAPES + [BIG])
    opt = lean(params)
    set_grads(params, 0)
    opt.step()
    for p in params[:-1]:
        for key, t in opt.state[p].items():
            assert t._base is not None and t._base._ampc_packed, f"'{key}' is not a view"
    assert all(t._base is None for t in opt.state[params[-1]].values())   # large: its own
    codes = opt.state[params[0]]["exp_avg_codes"]
    assert codes.dtype == u8 and codes.shape == params[0].shape
    assert opt.state[params[0]]["exp_avg_scale"].shape == (blocks(params[0].numel()),)
    assert opt.state[params[1]]["exp_avg"].dtype == f32         # 1-d: fp32 moments
    # the bytes counted from the tensors are those of the unpacked state
    unpacked(monkeypatch)
    other = make_params(SHAPES + [BIG])
    ref = lean(other)
    set_grads(other, 0)
    ref.step()
    model, model_ref = torch.nn.ParameterList(params), torch.nn.ParameterList(other)
    assert (state_bytes(model, opt)["bytes"]
            == state_bytes(model_ref, ref)["bytes"])


@pytest.mark.parametrize("stochastic", [False, True])
def test_packed_steps_give_the_unpacked_bits(monkeypatch, stochastic):
    """Every param small: one packed call per layout, the same elements in the same
    order as the unpacked call, so the same bits (stochastic rounding included)."""
    mine, theirs = make_params(), make_params()
    opt = lean(mine, stochastic_rounding=stochastic, weight_decay=0.1)
    for k in range(4):
        set_grads(mine, k)
        opt.step()
    assert all(t._base is not None for t in opt.state[mine[0]].values())
    unpacked(monkeypatch)
    ref = lean(theirs, stochastic_rounding=stochastic, weight_decay=0.1)
    for k in range(4):
        set_grads(theirs, k)
        ref.step()
    assert all(t._base is None for t in ref.state[theirs[0]].values())
    assert_same_training(mine, theirs, opt, ref, "packed vs unpacked")


def test_small_and_large_params_round_from_streams_of_their_own():
    """A large param's call and the packed call of the small ones beside it must not draw
    the same random bits: element i of each would round alike. Two params with the same
    values and grads on their first 4,096 elements: their roundings differ."""
    g = torch.Generator().manual_seed(3)
    head = torch.randn(4096, generator=g)
    big = torch.cat([head, torch.randn(BIG[0] * BIG[1] - 4096, generator=g)]).view(BIG)
    params = [torch.nn.Parameter(big.to(bf16)), torch.nn.Parameter(head.view(64, 64).to(bf16))]
    opt = ampc.optim.AdamW(params, lr=1e-3, state="lean", weight_decay=0.0)
    grad_head = torch.randn(4096, generator=g) * 0.01
    params[0].grad = torch.cat([grad_head, torch.zeros(BIG[0] * BIG[1] - 4096)]).view(BIG).to(bf16)
    params[1].grad = grad_head.view(64, 64).to(bf16)
    opt.step()
    assert opt.state[params[1]]["step"]._base is not None          # packed
    a, b = params[0].detach().flatten()[:4096], params[1].detach().flatten()
    differ = (a != b).float().mean().item()
    assert differ > 0.05, f"only {differ:.3f} of the shared elements rounded differently"


def test_small_and_large_params_code_v_from_streams_of_their_own():
    """The same with bf16 weights rounded to nearest: the second moment's 8-bit code still
    draws random bits, and the two calls' codes of the shared elements differ."""
    g = torch.Generator().manual_seed(4)
    head = torch.randn(4096, generator=g)
    big = torch.cat([head, torch.randn(BIG[0] * BIG[1] - 4096, generator=g)]).view(BIG)
    params = [torch.nn.Parameter(big.to(bf16)), torch.nn.Parameter(head.view(64, 64).to(bf16))]
    opt = ampc.optim.AdamW(params, lr=1e-3, moments="8bit", master_weights=False,
                           stochastic_rounding=False)
    grad_head = torch.randn(4096, generator=g) * 0.01
    params[0].grad = torch.cat([grad_head, torch.zeros(BIG[0] * BIG[1] - 4096)]).view(BIG).to(bf16)
    params[1].grad = grad_head.view(64, 64).to(bf16)
    opt.step()
    assert opt.state[params[1]]["step"]._base is not None          # packed
    sa, sb = (opt.state[p]["exp_avg_sq_scale"].flatten()[:16] for p in params)
    assert_same(sa, sb, "the shared blocks' scales")
    a = opt.state[params[0]]["exp_avg_sq_codes"].flatten()[:4096]
    b = opt.state[params[1]]["exp_avg_sq_codes"].flatten()
    differ = (a != b).float().mean().item()
    assert differ > 0.05, f"only {differ:.3f} of the shared elements coded differently"


def test_mixed_sizes_train_like_the_unpacked_state(monkeypatch):
    """Small and large params in one group (two calls): 30 steps track the unpacked
    optimizer as closely as two unpacked runs with different seeds track each other."""
    shapes = SHAPES + [BIG]
    runs = {}
    for name, seed in (("packed", 0), ("unpacked", 0), ("unpacked, seed 1", 1)):
        if name != "packed":
            unpacked(monkeypatch)
        params = make_params(shapes)
        opt = lean(params, seed=seed)
        for k in range(30):
            set_grads(params, k)
            opt.step()
        assert (opt.state[params[0]]["step"]._base is not None) == (name == "packed")
        runs[name] = torch.cat([p.detach().float().flatten() for p in params])
    gap = (runs["packed"] - runs["unpacked"]).abs().max().item()
    seeds = (runs["unpacked, seed 1"] - runs["unpacked"]).abs().max().item()
    assert 0 < gap <= 2 * seeds, (gap, seeds)


def checkpoint(sd):
    buffer = io.BytesIO()
    torch.save(sd, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


@pytest.mark.parametrize("how", ["saved", "deepcopy"])
def test_checkpoint_resumes_bit_for_bit(how):
    """Train 3 steps, checkpoint, train 3 more; a fresh optimizer loading the checkpoint
    and training the same 3 steps ends at the same bits, its state packed again."""
    shapes = SHAPES + [BIG]
    mine = make_params(shapes)
    opt = lean(mine)
    for k in range(3):
        set_grads(mine, k)
        opt.step()
    sd = checkpoint(opt.state_dict()) if how == "saved" else copy.deepcopy(opt.state_dict())
    weights = [p.detach().clone() for p in mine]
    for k in range(3, 6):
        set_grads(mine, k)
        opt.step()
    resumed = [torch.nn.Parameter(w) for w in weights]
    other = lean(resumed)
    other.load_state_dict(sd)
    for k in range(3, 6):
        set_grads(resumed, k)
        other.step()
    assert_same_training(mine, resumed, opt, other, "resumed")
    assert other.state[resumed[0]]["exp_avg_codes"]._base is not None


def test_load_into_a_packed_optimizer_takes_the_checkpoint():
    """An optimizer that has stepped (its state packed) loads an older checkpoint of
    itself: the next steps are those of the run that continued from it."""
    mine = make_params()
    opt = lean(mine)
    set_grads(mine, 0)
    opt.step()
    sd = copy.deepcopy(opt.state_dict())
    weights = [p.detach().clone() for p in mine]
    twin = [torch.nn.Parameter(w.clone()) for w in weights]
    ref = lean(twin)
    ref.load_state_dict(copy.deepcopy(sd))
    for k in range(1, 3):                   # move on, then go back
        set_grads(mine, k)
        opt.step()
    with torch.no_grad():
        for p, w in zip(mine, weights):
            p.copy_(w)
    opt.load_state_dict(sd)
    for k in range(5, 8):
        set_grads(mine, k)
        set_grads(twin, k)
        opt.step()
        ref.step()
    assert_same_training(mine, twin, opt, ref, "reloaded")


def packed_and_unpacked(monkeypatch, train):
    """train(params, opt) run on a packed optimizer, then on an unpacked one: both pairs."""
    runs = []
    for pack in (True, False):
        if not pack:
            unpacked(monkeypatch)
        params = make_params()
        opt = lean(params)
        train(params, opt)
        assert (opt.state[params[0]]["step"]._base is not None) == pack
        runs.append((params, opt))
    return runs


def test_grads_missing_and_not_contiguous_give_the_unpacked_bits(monkeypatch):
    """A step where some params have no grad (a new pack of the others) and one where a
    grad is not contiguous (the per-tensor call on the pack's views)."""
    present = [True, False, True, True, False, True]

    def train(params, opt):
        for k in range(5):
            set_grads(params, k, present if k in (1, 2) else None)
            if k == 3:
                params[2].grad = params[2].grad.t().contiguous().t()
                assert not params[2].grad.is_contiguous()
            opt.step()

    (mine, opt), (theirs, ref) = packed_and_unpacked(monkeypatch, train)
    assert_same_training(mine, theirs, opt, ref, "packed vs unpacked")


def test_a_replaced_state_tensor_is_taken_up(monkeypatch):
    def train(params, opt):
        for k in range(3):
            if k == 2:              # a user resets one param's first moment
                opt.state[params[0]]["exp_avg_codes"] = torch.zeros_like(params[0], dtype=u8)
            set_grads(params, k)
            opt.step()

    (mine, opt), (theirs, ref) = packed_and_unpacked(monkeypatch, train)
    assert_same_training(mine, theirs, opt, ref, "reset")
    assert opt.state[mine[0]]["exp_avg_codes"]._base is not None      # packed again


# ---- the op ----

def packed_inputs(shapes, moments, seed=0):
    """Params, grads, the packed moments, scales and steps, a layout, and the same state
    as adam_lean's per-tensor lists."""
    g = torch.Generator().manual_seed(seed)
    params = [torch.randn(s, generator=g).to(bf16) for s in shapes]
    grads = [(torch.randn(s, generator=g) * 0.01).to(bf16) for s in shapes]
    align = QBLOCK if moments == u8 else 1
    offsets, size = [], 0
    for p in params:
        offsets.append(size)
        size += -(-p.numel() // align) * align
    if moments == u8:
        buf = torch.randint(0, 256, (2 * size,), dtype=u8, generator=g)
        scales = torch.rand(2 * size // QBLOCK, generator=g) * 0.01
    else:
        buf = (torch.rand(2 * size, generator=g) * 0.01).to(moments)
        scales = torch.zeros(0)
    steps = torch.arange(len(shapes), dtype=f32) + 2
    layout = torch.tensor([[o, p.numel(), i] for i, (o, p) in enumerate(zip(offsets, params))],
                          dtype=torch.int64).reshape(-1)
    lists = dict(
        exp_avgs=[buf[o:o + p.numel()].clone().view(p.shape) for o, p in zip(offsets, params)],
        exp_avg_sqs=[buf[size + o:size + o + p.numel()].clone().view(p.shape)
                     for o, p in zip(offsets, params)],
        steps=[steps[i:i + 1].clone() for i in range(len(shapes))])
    if moments == u8:
        lists["exp_avg_scales"] = [scales[o // QBLOCK:o // QBLOCK + blocks(p.numel())].clone()
                                   for o, p in zip(offsets, params)]
        lists["exp_avg_sq_scales"] = [scales[(size + o) // QBLOCK:][:blocks(p.numel())].clone()
                                      for o, p in zip(offsets, params)]
    return params, grads, buf, scales, steps, layout, offsets, size, lists


@pytest.mark.parametrize("moments", [u8, f32, bf16], ids=str)
def test_adam_lean_packed_matches_adam_lean(moments):
    shapes = [(3, 300), (256,), (1,), (4097,), (0,), (40, 40)]
    params, grads, buf, scales, steps, layout, offsets, size, lists = packed_inputs(shapes, moments)
    copies = [p.clone() for p in params]
    control = dict(inv_scale=torch.full((1,), 0.5), clip_coef=torch.full((1,), 0.9))
    for k in range(3):
        assert ampc.ops.adam_lean_packed(params, grads, buf, scales, steps, layout, lr=1e-2,
                                         weight_decay=0.1, stochastic=True, seed=7 + k,
                                         **control)
        ampc.ops.adam_lean(copies, grads, lists["exp_avgs"], lists["exp_avg_sqs"],
                           lists["steps"], lr=1e-2, weight_decay=0.1, stochastic=True,
                           seed=7 + k, exp_avg_scales=lists.get("exp_avg_scales"),
                           exp_avg_sq_scales=lists.get("exp_avg_sq_scales"), **control)
    for i, (p, o) in enumerate(zip(params, offsets)):
        n = p.numel()
        assert_same(p, copies[i], f"param {i}")
        assert_same(buf[o:o + n].view(p.shape), lists["exp_avgs"][i], f"exp_avg {i}")
        assert_same(buf[size + o:size + o + n].view(p.shape), lists["exp_avg_sqs"][i],
                    f"exp_avg_sq {i}")
        if moments == u8:
            b = o // QBLOCK
            assert_same(scales[b:b + blocks(n)], lists["exp_avg_scales"][i], f"scale {i}")
            b += size // QBLOCK
            assert_same(scales[b:b + blocks(n)], lists["exp_avg_sq_scales"][i], f"sq scale {i}")
    assert_same(steps, torch.cat(lists["steps"]), "steps")
    # found_inf skips the step, the counts included
    before = [t.clone() for t in (buf, scales, steps, *params)]
    assert ampc.ops.adam_lean_packed(params, grads, buf, scales, steps, layout, lr=1e-2,
                                     found_inf=torch.ones(1))
    for i, (a, b) in enumerate(zip(before, (buf, scales, steps, *params))):
        assert_same(b, a, f"skipped: tensor {i}")


def test_adam_lean_packed_refuses_a_bad_state_before_anything_changes():
    shapes = [(300,), (600,)]
    params, grads, buf, scales, steps, layout, _, _, _ = packed_inputs(shapes, u8)
    before = [t.clone() for t in (buf, scales, steps, *params)]

    def call(**kw):
        args = dict(params=params, grads=grads, moments=buf, scales=scales, steps=steps,
                    layout=layout)
        args.update(kw)
        return ampc.ops.adam_lean_packed(lr=1e-2, **args)

    bad = layout.clone()
    bad[3] = 300                            # not at a block boundary: its scales would be another's
    with pytest.raises(RuntimeError, match="ampc.adam_lean_packed: layout of param 1 .* "
                                           "multiple of 256"):
        call(layout=bad)
    bad = layout.clone()
    bad[3] = 0                              # overlaps param 0
    with pytest.raises(RuntimeError, match="ampc.adam_lean_packed: layout of param 1"):
        call(layout=bad)
    with pytest.raises(RuntimeError, match="ampc.adam_lean_packed: moments must be "
                                           "torch.float32, torch.bfloat16 or torch.uint8"):
        call(moments=buf.to(torch.int16))
    with pytest.raises(RuntimeError, match="ampc.adam_lean_packed: moments must hold 2 sections"):
        call(scales=scales[:-1])
    with pytest.raises(RuntimeError, match="ampc.adam_lean_packed: steps and scales must be "
                                           "torch.float32"):
        call(scales=scales.double())
    with pytest.raises(RuntimeError, match="ampc.adam_lean_packed: layout must be a torch.int64"):
        call(layout=layout.int())
    # grads that do not fit the packing (mixed dtypes, a numel the layout does not say):
    # nothing done, False back
    assert not call(grads=[grads[0], grads[1].float()])
    assert not call(params=[params[0], params[1][:599]], grads=[grads[0], grads[1][:599]])
    for i, (a, b) in enumerate(zip(before, (buf, scales, steps, *params))):
        assert_same(b, a, f"refused: tensor {i}")


def test_opcheck_adam_lean_packed():
    params, grads, buf, scales, steps, layout, _, _, _ = packed_inputs([(300,), (20, 30)], u8)
    args = (params, grads, buf, scales, steps, layout, [torch.full((1,), 1e-3)],
            [torch.ones(1)], [torch.full((1,), 0.5)], [torch.zeros(1)], 0.0, 0.9, 0.999, 1e-8,
            0.01, True, False, True, 3)
    torch.library.opcheck(torch.ops.ampc.adam_lean_packed.default, args,
                          test_utils=("test_schema", "test_autograd_registration",
                                      "test_faketensor"))

