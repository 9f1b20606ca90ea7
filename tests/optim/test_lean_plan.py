"""The lean step's cached plan (ampc/optim/_lean.py, _Plan): the calls a group's step makes
are found once and reused while nothing they depend on changes. A step from the plan must
give the bits a step that finds its calls afresh gives, whatever changed in between: grads
that come and go, a state tensor replaced, a grad of another dtype, a loaded checkpoint."""
import copy

import torch
from torch import nn

import ampc
import ampc.optim
from ampc.optim import _lean
from reference import assert_same

bf16 = torch.bfloat16


def model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 128), nn.LayerNorm(128), nn.GELU(),
                         nn.Linear(128, 64), nn.Linear(64, 8)).to(bf16)


def make_grads(m, step, drop=()):
    gen = torch.Generator().manual_seed(100 + step)
    for i, p in enumerate(m.parameters()):
        p.grad = None if i in drop else torch.randn(p.shape, generator=gen).to(p.dtype) * 0.1


def state_of(opt):
    return [t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)]


def twins(**kw):
    a, b = model(), model()
    kw = dict(lr=1e-2, state="lean", **kw)
    return a, ampc.optim.AdamW(a.parameters(), **kw), b, ampc.optim.AdamW(b.parameters(), **kw)


def step_both(a, oa, b, ob, step, drop=()):
    """oa steps from its plan; ob finds its calls afresh every step."""
    make_grads(a, step, drop)
    make_grads(b, step, drop)
    oa.step()
    ob.__dict__.pop("_ampc_lean_plans", None)
    ob.step()


def assert_twins(a, oa, b, ob):
    for x, y in zip(a.parameters(), b.parameters()):
        assert_same(x.detach(), y.detach(), "param")
    sa, sb = state_of(oa), state_of(ob)
    assert len(sa) == len(sb)
    for x, y in zip(sa, sb):
        assert_same(x, y, "state")


def test_steps_from_the_plan_equal_steps_that_find_their_calls_afresh():
    a, oa, b, ob = twins()
    drops = [(), (), (1, 3), (1, 3), (), (0,), ()]      # grads that come and go
    for step, drop in enumerate(drops):
        step_both(a, oa, b, ob, step, drop)
        assert_twins(a, oa, b, ob)


def test_the_plan_is_reused_while_nothing_changes(monkeypatch):
    a, oa, _, _ = twins()
    made = []
    real = _lean._buckets
    monkeypatch.setattr(_lean, "_buckets", lambda *args: made.append(1) or real(*args))
    for step in range(4):
        make_grads(a, step)
        oa.step()
    assert len(made) == 1           # the first step's; the others came from its plan
    make_grads(a, 4, drop=(2,))
    oa.step()
    assert len(made) == 2           # another set of params with grads: a new plan


def test_a_replaced_state_tensor_or_state_dict_is_taken_up():
    a, oa, b, ob = twins()
    for step in range(2):
        step_both(a, oa, b, ob, step)
    w = list(a.parameters())[0]
    for opt, p in ((oa, w), (ob, list(b.parameters())[0])):
        s = opt.state[p]
        s["exp_avg_codes"] = torch.zeros_like(s["exp_avg_codes"])     # a new tensor
    step_both(a, oa, b, ob, 2)
    assert_twins(a, oa, b, ob)
    for opt, p in ((oa, list(a.parameters())[3]), (ob, list(b.parameters())[3])):
        opt.state[p] = {k: v.clone() * (2 if k == "exp_avg" else 1)
                        for k, v in opt.state[p].items()}                  # a new dict
    step_both(a, oa, b, ob, 3)
    assert_twins(a, oa, b, ob)


def test_a_grad_of_another_dtype_and_a_loaded_checkpoint_are_taken_up():
    a, oa, b, ob = twins()
    for step in range(2):
        step_both(a, oa, b, ob, step)
    saved = copy.deepcopy(oa.state_dict())
    make_grads(a, 2)
    make_grads(b, 2)
    for m in (a, b):                # an fp32 grad on a bf16 param, as torch allows it
        m[0].weight.grad_dtype = None
        m[0].weight.grad = m[0].weight.grad.float()
    oa.step()
    ob.__dict__.pop("_ampc_lean_plans", None)
    ob.step()
    assert_twins(a, oa, b, ob)
    oa.load_state_dict(saved)
    ob.load_state_dict(copy.deepcopy(saved))
    for step in range(3, 5):
        step_both(a, oa, b, ob, step)
        assert_twins(a, oa, b, ob)
