"""ampc.optim's packed state: per group, device and dtype one fp32 buffer and one tensor
of step counts, with optimizer.state[p] showing views into them; the cached plan that
makes a step two tensor lists per kernel call; and ops.adam_packed itself."""
import copy
import io

import pytest
import torch

import ampc
import ampc.optim
from reference import assert_same

f32, f16, bf16 = torch.float32, torch.float16, torch.bfloat16
SHAPES = [(3, 5), (17,), (1,), (64, 3), (0,), (33,)]


def make_params(dtype=f32, seed=0, shapes=SHAPES):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g).to(dtype)) for s in shapes]


def set_grads(params, k, present=None):
    g = torch.Generator().manual_seed(1000 + k)
    for i, p in enumerate(params):
        grad = torch.randn(p.shape, generator=g).to(p.dtype)
        p.grad = grad if present is None or present[i] else None


def step_both(opt, ref, mine, theirs, k, present=None):
    """One step of both optimizers on the same grads."""
    set_grads(mine, k, present)
    set_grads(theirs, k, present)
    opt.step()
    ref.step()


def assert_params_same(mine, theirs, what):
    for i, (p, q) in enumerate(zip(mine, theirs)):
        assert_same(p.detach(), q.detach(), f"{what} param {i}")


def packed_buffers(opt, p):
    """The distinct storages of p's state tensors."""
    return {t.untyped_storage().data_ptr() for t in opt.state[p].values()}


def assert_views_of_packs(opt, params):
    for p in params:
        state = opt.state[p]
        for key, t in state.items():
            assert t._base is not None, f"state '{key}' is not a view"
        assert len(packed_buffers(opt, p)) == 2        # the sections buffer, the steps


def test_state_is_views_into_one_buffer_with_torch_keys():
    params = make_params()
    opt = ampc.optim.AdamW(params, lr=1e-2, amsgrad=True)
    set_grads(params, 0)
    opt.step()
    assert_views_of_packs(opt, params)
    storages = {opt.state[p]["exp_avg"].untyped_storage().data_ptr() for p in params}
    assert len(storages) == 1
    for p in params:
        assert set(opt.state[p]) == {"step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"}
        assert opt.state[p]["step"].shape == () and opt.state[p]["exp_avg"].shape == p.shape


@pytest.mark.parametrize("amsgrad", [False, True])
def test_grads_missing_on_some_steps_match_torch(amsgrad):
    mine, theirs = make_params(), make_params()
    opt = ampc.optim.AdamW(mine, lr=1e-2, amsgrad=amsgrad)
    ref = torch.optim.AdamW(theirs, lr=1e-2, amsgrad=amsgrad, fused=True)
    patterns = [[1, 1, 1, 1, 1, 1], [1, 0, 1, 0, 1, 1], [1, 0, 1, 0, 1, 1], [0, 0, 0, 0, 0, 0],
                [1, 1, 1, 1, 1, 1], [0, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1]]
    for k, present in enumerate(patterns):
        step_both(opt, ref, mine, theirs, k, present)
        assert_params_same(mine, theirs, f"step {k}")
        for p, q in zip(mine, theirs):
            if q in ref.state:
                assert float(opt.state[p]["step"]) == float(ref.state[q]["step"])


def test_params_that_get_grads_late_have_no_state_until_then():
    mine, theirs = make_params(), make_params()
    opt = ampc.optim.AdamW(mine, lr=1e-2)
    ref = torch.optim.AdamW(theirs, lr=1e-2, fused=True)
    for k in range(4):
        step_both(opt, ref, mine, theirs, k, [1, 1, 0, 1, 0, 1] if k < 2 else None)
        assert (mine[2] in opt.state) == (theirs[2] in ref.state)
        assert_params_same(mine, theirs, f"step {k}")
    assert_views_of_packs(opt, mine)
    assert opt.state_dict()["state"].keys() == ref.state_dict()["state"].keys()


def test_add_param_group_after_the_first_step_matches_torch():
    mine, theirs = make_params(), make_params()
    extra_mine, extra_theirs = make_params(seed=1), make_params(seed=1)
    opt = ampc.optim.AdamW(mine, lr=1e-2)
    ref = torch.optim.AdamW(theirs, lr=1e-2, fused=True)
    for k in range(5):
        if k == 2:
            opt.add_param_group({"params": extra_mine, "lr": 3e-3, "weight_decay": 0.1})
            ref.add_param_group({"params": extra_theirs, "lr": 3e-3, "weight_decay": 0.1})
        step_both(opt, ref, mine + (extra_mine if k >= 2 else []),
                  theirs + (extra_theirs if k >= 2 else []), k)
        assert_params_same(mine + extra_mine, theirs + extra_theirs, f"step {k}")
    assert_views_of_packs(opt, mine + extra_mine)


def test_mixed_dtypes_in_one_group_match_one_group_per_param():
    shapes = SHAPES * 2
    dtypes = [bf16, f32, f16, bf16, f32, f16, f16, bf16, f32, bf16, f16, f32]

    def params():
        return [p.to(d).detach().requires_grad_() for p, d in zip(make_params(shapes=shapes), dtypes)]

    mine, alone = params(), params()
    opt = ampc.optim.AdamW(mine, lr=1e-2)
    one_by_one = ampc.optim.AdamW([{"params": [p]} for p in alone], lr=1e-2)
    for k in range(3):
        step_both(opt, one_by_one, mine, alone, k)
    assert_params_same(mine, alone, "mixed")
    for i, (p, q) in enumerate(zip(mine, alone)):
        assert_same(opt.state[p]["exp_avg"], one_by_one.state[q]["exp_avg"], f"exp_avg {i}")
        assert ("master" in opt.state[p]) == (p.dtype != f32)
    # one buffer per dtype: bf16 and fp16 (with masters) and fp32 (without)
    assert len({opt.state[p]["exp_avg"].untyped_storage().data_ptr() for p in mine}) == 3


def checkpoint_copies():
    """The ways a state dict comes back: the same objects, a deep copy, through torch.save,
    and one saved before the packing (every state tensor its own)."""
    def saved(sd):
        buf = io.BytesIO()
        torch.save(sd, buf)
        buf.seek(0)
        return torch.load(buf)

    def unpacked(sd):
        sd = copy.deepcopy(sd)
        for s in sd["state"].values():
            for k, v in s.items():
                s[k] = v.clone()
        return sd

    return {"same": lambda sd: sd, "deepcopy": copy.deepcopy, "saved": saved,
            "unpacked": unpacked}


@pytest.mark.parametrize("how", sorted(checkpoint_copies()))
@pytest.mark.parametrize("dtype", [f32, bf16])
def test_views_stay_views_after_load_state_dict_and_resume_bitwise(how, dtype):
    mine = make_params(dtype)
    opt = ampc.optim.AdamW(mine, lr=1e-2, amsgrad=True)
    for k in range(2):
        set_grads(mine, k)
        opt.step()
    sd = checkpoint_copies()[how](opt.state_dict())
    snapshot = copy.deepcopy(opt.state_dict())
    weights = [p.detach().clone() for p in mine]
    views = [dict(opt.state[p]) for p in mine]
    for k in range(2, 4):                   # move on, then go back to the checkpoint
        set_grads(mine, k)
        opt.step()
    if how == "same":                       # the saved objects are the live views
        sd = snapshot
    with torch.no_grad():
        for p, w in zip(mine, weights):
            p.copy_(w)
    opt.load_state_dict(sd)
    for i, p in enumerate(mine):
        for key, t in opt.state[p].items():
            assert t is views[i][key], f"'{key}' of param {i} was replaced, not copied into"
            assert_same(t, snapshot["state"][i][key], f"'{key}' of param {i}")
    # resume: the same bits as a fresh optimizer loading the checkpoint
    resumed = [torch.nn.Parameter(w.clone()) for w in weights]
    other = ampc.optim.AdamW(resumed, lr=1e-2, amsgrad=True)
    other.load_state_dict(copy.deepcopy(snapshot))
    for k in range(2, 4):
        step_both(opt, other, mine, resumed, k)
    assert_params_same(mine, resumed, "resumed")
    for i, (p, q) in enumerate(zip(mine, resumed)):
        assert_same(opt.state[p]["exp_avg"], other.state[q]["exp_avg"], f"exp_avg {i}")


def test_torch_checkpoint_loads_into_packed_state():
    theirs, mine = make_params(), make_params()
    ref = torch.optim.AdamW(theirs, lr=1e-2, fused=True)
    opt = ampc.optim.AdamW(mine, lr=1e-2)
    set_grads(mine, 0)
    opt.step()                              # packed before the load
    for k in range(3):
        set_grads(theirs, k)
        ref.step()
    opt.load_state_dict(copy.deepcopy(ref.state_dict()))
    for p, q in zip(mine, theirs):
        p.data.copy_(q.detach())
    assert_views_of_packs(opt, mine)
    for k in range(3, 5):
        step_both(opt, ref, mine, theirs, k)
    assert_params_same(mine, theirs, "resumed")


def test_a_replaced_state_tensor_is_taken_up():
    mine, theirs = make_params(), make_params()
    opt = ampc.optim.AdamW(mine, lr=1e-2)
    ref = torch.optim.AdamW(theirs, lr=1e-2, fused=True)
    for k in range(3):
        if k == 2:                          # reset one param's moments by assignment
            opt.state[mine[1]]["exp_avg"] = torch.zeros_like(mine[1], dtype=f32)
            ref.state[theirs[1]]["exp_avg"] = torch.zeros_like(theirs[1])
        step_both(opt, ref, mine, theirs, k)
    assert_params_same(mine, theirs, "reset")
    assert_views_of_packs(opt, mine)


def test_params_that_stop_fitting_the_packing_take_the_unpacked_path():
    mine, theirs = make_params(), make_params()
    opt = ampc.optim.AdamW(mine, lr=1e-2)
    ref = torch.optim.AdamW(theirs, lr=1e-2, fused=True)
    for k in range(3):
        set_grads(mine, k)
        set_grads(theirs, k)
        if k >= 1:                          # a transposed (non-contiguous) grad
            mine[3].grad = mine[3].grad.t().contiguous().t()
        opt.step()
        ref.step()
    for i, (p, q) in enumerate(zip(mine, theirs)):
        assert_same(p.detach(), q.detach(), f"param {i}")
    # a param replaced by one of another shape: the unpacked path names it
    mine[0].data = torch.zeros(4, 4)
    set_grads(mine, 9)
    with pytest.raises(RuntimeError, match="shape"):
        opt.step()


def test_adam_packed_matches_adam_master_and_refuses_a_bad_layout():
    params = make_params(bf16)
    copies = [p.detach().clone() for p in params]
    grads = [torch.randn(p.shape).to(bf16) for p in params]
    numels = [p.numel() for p in params]
    offsets = [sum(numels[:i]) for i in range(len(numels))]
    size = sum(numels)
    state = torch.zeros(3 * size)
    state[2 * size:] = torch.cat([p.detach().float().reshape(-1) for p in params])
    steps = torch.zeros(len(params))
    layout = torch.tensor([[o, n, i] for i, (o, n) in enumerate(zip(offsets, numels))])
    with torch.no_grad():
        assert ampc.ops.adam_packed([p.detach() for p in params], grads, state, steps,
                                    layout.reshape(-1), lr=1e-2, master=True)
        masters = [p.float() for p in copies]
        m = [torch.zeros(p.shape) for p in copies]
        v = [torch.zeros(p.shape) for p in copies]
        st = [torch.zeros(()) for _ in copies]
        ampc.ops.adam_master(copies, grads, m, v, st, lr=1e-2, masters=masters)
    for i, p in enumerate(params):
        assert_same(p.detach(), copies[i], f"param {i}")
        sl = slice(offsets[i], offsets[i] + numels[i])
        assert_same(state[sl].reshape(p.shape), m[i], f"exp_avg {i}")
        assert_same(state[2 * size:][sl].reshape(p.shape), masters[i], f"master {i}")
    assert steps.tolist() == [1.0] * len(params)
    bad = layout.clone()
    bad[1, 0] = 0                           # overlaps param 0's range
    with pytest.raises(RuntimeError, match="ampc.adam_packed: layout of param 1"):
        ampc.ops.adam_packed([p.detach() for p in params], grads, state, steps,
                             bad.reshape(-1), lr=1e-2, master=True)
    assert steps.tolist() == [1.0] * len(params)
    # grads of mixed dtypes do not fit: nothing is done, False comes back
    mixed = grads[:1] + [g.float() for g in grads[1:]]
    assert not ampc.ops.adam_packed([p.detach() for p in params], mixed, state, steps,
                                    layout.reshape(-1), lr=1e-2, master=True)
    assert steps.tolist() == [1.0] * len(params)


@pytest.mark.parametrize("dtype, master, amsgrad", [(f32, False, False), (bf16, True, True)])
def test_opcheck_adam_packed(dtype, master, amsgrad):
    sizes = [17, 40]
    sections = 2 + amsgrad + master
    layout = torch.tensor([0, 17, 0, 32, 40, 1])
    args = ([torch.randn(n).to(dtype) for n in sizes], [torch.randn(n).to(dtype) for n in sizes],
            torch.randn(sections * 72).abs(), torch.zeros(2), layout, [torch.full((1,), 1e-3)],
            [torch.ones(1)], [torch.full((1,), 0.5)], [torch.zeros(1)], 0.0, 0.9, 0.999, 1e-8,
            0.01, True, False, amsgrad, master, master, 3)
    # schema, fake kernel and autograd registration; aot dispatch does not functionalize a
    # mutating custom op that returns an int, so the op is not traced by torch.compile
    torch.library.opcheck(torch.ops.ampc.adam_packed.default, args,
                          test_utils=("test_schema", "test_autograd_registration",
                                      "test_faketensor"))


def test_adam_packed_refuses_what_is_not_a_tensor_list():
    state, steps, layout = torch.zeros(4), torch.zeros(1), torch.tensor([0, 1, 0])
    with pytest.raises(TypeError, match=r"ampc.adam_packed: grads\[0\] must be a Tensor"):
        ampc.ops.adam_packed([torch.zeros(1)], [1.0], state, steps, layout, lr=1e-3)
    with pytest.raises(TypeError, match="ampc.adam_packed: params must be a list"):
        ampc.ops.adam_packed(torch.zeros(1), [torch.zeros(1)], state, steps, layout, lr=1e-3)
    assert steps.tolist() == [0.0]


@pytest.mark.parametrize("dtype, options", [(f32, {}), (bf16, {}), (bf16, {"state": "lean"})],
                         ids=["fp32", "bf16", "lean"])
def test_compiled_step_equals_eager(dtype, options):
    """opt.step() inside a torch.compile'd function (the packed ops return an int, which
    compile cannot functionalize) runs and gives the eager bits, params and state: the
    master-weight packing and the lean one (its 64 x 64 param in 8-bit moments)."""
    torch._dynamo.reset()
    shapes = SHAPES[:4] + [(64, 64)]
    mine, theirs = make_params(dtype, shapes=shapes), make_params(dtype, shapes=shapes)
    opt = ampc.optim.AdamW(mine, lr=1e-2, **options)
    ref = ampc.optim.AdamW(theirs, lr=1e-2, **options)
    compiled = torch.compile(opt.step)
    for k in range(3):
        set_grads(mine, k)
        set_grads(theirs, k)
        compiled()
        ref.step()
    assert_params_same(mine, theirs, "compiled")
    for i, (p, q) in enumerate(zip(mine, theirs)):
        for key, t in ref.state[q].items():
            assert_same(opt.state[p][key], t, f"compiled: '{key}' of param {i}")
