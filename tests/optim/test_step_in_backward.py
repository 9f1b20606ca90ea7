"""Adam(step_in_backward=True): each param stepped in the backward and its gradient freed.
The steps equal the usual step (bit for bit where no random rounding is drawn), torch's
AdamW agrees, accumulation works, and what needs every gradient first is refused before
a param changes."""
import copy

import pytest
import torch
from torch import nn

import ampc
from ampc.optim import AdamW
from ampc.optim._lean import stream_seed


def _model(dtype=torch.float32):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.LayerNorm(32),
                         nn.Linear(32, 8)).to(dtype)


def _batches(n, dtype=torch.float32):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 16, generator=g).to(dtype), torch.randint(0, 8, (8,), generator=g))
            for _ in range(n)]


def _loss(model, batch):
    x, y = batch
    return nn.functional.cross_entropy(model(x).float(), y)


def _train(model, opt, batches, accumulate=1, call_step=True):
    for k, batch in enumerate(batches):
        last = (k + 1) % accumulate == 0
        if last:
            _loss(model, batch).backward()
        else:
            with opt.accumulating():
                _loss(model, batch).backward()
        if last and call_step:
            opt.step()
            opt.zero_grad()


def _same(a, b):
    for pa, pb in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(pa, pb, rtol=0, atol=0)


@pytest.mark.parametrize("dtype, options", [
    (torch.float32, {}), (torch.bfloat16, {}),
    (torch.float32, {"moments": "8bit", "moments_min_numel": 0}),
    (torch.bfloat16, {"moments": "8bit", "moments_min_numel": 0}),
    (torch.bfloat16, {"kahan_summation": True, "moments": "bf16"})])
def test_equals_the_usual_step(dtype, options):
    """8-bit moments draw random bits (the second moment's codes), each param alone from a
    stream of its own: the usual step takes them in groups of one param with those seeds."""
    a = _model(dtype)
    b = copy.deepcopy(a)
    if options.get("moments") == "8bit":
        groups = [{"params": [p], "seed": stream_seed(7, k + 1)}
                  for k, p in enumerate(a.parameters())]
        oa = AdamW(groups, lr=1e-2, **options)
    else:
        oa = AdamW(a.parameters(), lr=1e-2, seed=7, **options)
    ob = AdamW(b.parameters(), lr=1e-2, step_in_backward=True, seed=7, **options)
    batches = _batches(12, dtype)
    _train(a, oa, batches)
    for batch in batches:
        _loss(b, batch).backward()
        assert all(p.grad is None for p in b.parameters())     # freed in the backward
        ob.step()                                               # nothing left to do
    _same(a, b)
    torch.testing.assert_close(oa.state_dict()["state"][0]["step"],
                               ob.state_dict()["state"][0]["step"])


def test_agrees_with_torch_adamw():
    a = _model()
    b = copy.deepcopy(a)
    ta = torch.optim.AdamW(a.parameters(), lr=1e-2)
    ob = AdamW(b.parameters(), lr=1e-2, step_in_backward=True)
    batches = _batches(10)
    _train(a, ta, batches)
    _train(b, ob, batches, call_step=False)
    for pa, pb in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(pa, pb, rtol=1e-5, atol=1e-6)


def test_stochastic_rounding_trains_like_the_usual_step():
    # each param draws its own random stream in the backward, so the lean preset's bits
    # differ from the usual step's: by no more than another seed's do
    def run(seed, in_backward):
        m = _model(torch.bfloat16)
        opt = AdamW(m.parameters(), lr=3e-3, state="lean", moments_min_numel=0, seed=seed,
                    step_in_backward=in_backward)
        _train(m, opt, _batches(40, torch.bfloat16), call_step=not in_backward)
        return m

    def apart(a, b):
        return max((pa.float() - pb.float()).abs().max().item()
                   for pa, pb in zip(a.parameters(), b.parameters()))

    usual, other_seed, in_backward = run(0, False), run(1, False), run(0, True)
    assert 0 < apart(usual, in_backward) <= 2 * apart(usual, other_seed)
    batch = _batches(1, torch.bfloat16)[0]
    la, lb = _loss(usual, batch).item(), _loss(in_backward, batch).item()
    assert abs(la - lb) < 0.02 * la


@pytest.mark.parametrize("call_step", [False, True])
def test_accumulation_steps_on_the_sum(call_step):
    a = _model()
    b = copy.deepcopy(a)
    oa = AdamW(a.parameters(), lr=1e-2)
    ob = AdamW(b.parameters(), lr=1e-2, step_in_backward=True)
    batches = _batches(12)
    _train(a, oa, batches, accumulate=3)
    for k, batch in enumerate(batches):
        with ob.accumulating() if call_step or (k + 1) % 3 else torch.enable_grad():
            _loss(b, batch).backward()
        if call_step and (k + 1) % 3 == 0:
            assert all(p.grad is not None for p in b.parameters())
            ob.step()               # the kept gradients step here instead
            ob.zero_grad()
    _same(a, b)


def test_a_compiled_model_steps_like_the_eager_one():
    a = _model()
    b = copy.deepcopy(a)
    oa = AdamW(a.parameters(), lr=1e-2, step_in_backward=True)
    ob = AdamW(b.parameters(), lr=1e-2, step_in_backward=True)
    compiled = torch.compile(b, backend="aot_eager")
    batches = _batches(5)
    _train(a, oa, batches, call_step=False)
    _train(compiled, ob, batches, call_step=False)
    for pa, pb in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(pa, pb, rtol=1e-5, atol=1e-6)


def test_through_prepare():
    torch.manual_seed(0)
    a = _model()
    b = copy.deepcopy(a)
    a, oa = ampc.prepare(a, AdamW, lr=1e-2)
    b, ob = ampc.prepare(b, AdamW, lr=1e-2, step_in_backward=True)
    assert ob.step_in_backward and not oa.step_in_backward
    batches = _batches(6)
    _train(a, oa, batches)
    _train(b, ob, batches, call_step=False)
    _same(a, b)


def test_a_param_group_added_later_is_hooked():
    a = _model()
    params = list(a.parameters())
    opt = AdamW(params[:2], lr=1e-2, step_in_backward=True)
    opt.add_param_group({"params": params[2:]})
    _loss(a, _batches(1)[0]).backward()
    assert all(p.grad is None for p in params)
    assert len(opt.state) == len(params)


def test_fp16_params_are_refused():
    with pytest.raises(ValueError, match=r"AdamW\(step_in_backward=True\): param 0 is "
                                         r"torch.float16"):
        AdamW(_model(torch.float16).parameters(), step_in_backward=True)


def test_a_loss_scaler_is_refused_before_a_param_changes():
    model = _model()
    before = copy.deepcopy(model)
    opt = AdamW(model.parameters(), lr=1e-2, step_in_backward=True)
    scaler = ampc.GradScaler("cpu")
    with pytest.raises(RuntimeError, match="before a loss scaler can see every gradient"):
        scaler.scale(_loss(model, _batches(1)[0])).backward()
    _same(model, before)
    assert not opt.state


def test_torch_s_scaler_step_is_refused():
    model = _model()
    opt = AdamW(model.parameters(), lr=1e-2, step_in_backward=True)
    scaler = torch.amp.GradScaler("cpu")
    with opt.accumulating():        # the gradients are kept: the scaler reaches the step
        scaler.scale(_loss(model, _batches(1)[0])).backward()
    with pytest.raises(RuntimeError, match="step_in_backward=False"):
        scaler.step(opt)


def test_clipping_is_refused():
    model = _model()
    opt = AdamW(model.parameters(), lr=1e-2, step_in_backward=True)
    _loss(model, _batches(1)[0]).backward()
    for scaler in (ampc.GradScaler("cpu"), ampc.GradScaler("cpu", enabled=False)):
        with pytest.raises(RuntimeError, match="clip_grad_norm_: the optimizer steps in the "
                                               "backward"):
            scaler.clip_grad_norm_(opt, 1.0)


def test_several_ranks_are_refused(monkeypatch):
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 2)
    with pytest.raises(ValueError, match="2 ranks train together"):
        AdamW(_model().parameters(), step_in_backward=True)


def test_sharded_params_are_refused(tmp_path):
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0,
                            world_size=1)
    try:
        model = fully_shard(_model())
        with pytest.raises(ValueError, match="the params are sharded"):
            AdamW(model.parameters(), step_in_backward=True)
    finally:
        dist.destroy_process_group()
