"""ampc.optim as a torch optimizer: checkpoints that resume bit for bit, the fp32 export,
ampc.prepare, torch's GradScaler driving it without a host sync, and training runs."""
import copy
import io

import pytest
import torch
from torch import nn

import ampc
import ampc.optim
from reference import assert_same

f32, f16, bf16 = torch.float32, torch.float16, torch.bfloat16


def mlp(seed=0, width=48):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(20, width), nn.LayerNorm(width), nn.GELU(),
                         nn.Linear(width, width), nn.GELU(), nn.Linear(width, 1))


def batch(k, dtype=f32):
    g = torch.Generator().manual_seed(100 + k)
    x = torch.randn(64, 20, generator=g)
    y = (x[:, :5].sum(1, keepdim=True) * 0.5).sin()
    return x.to(dtype), y


def train(model, opt, steps, start=0, dtype=f32, scaler=None):
    losses = []
    for k in range(start, start + steps):
        x, y = batch(k, dtype)
        opt.zero_grad()
        loss = ((model(x).float() - y) ** 2).mean()
        if scaler is None:
            loss.backward()
            opt.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        losses.append(loss.item())
    return losses


def roundtrip(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


@pytest.mark.smoke
@pytest.mark.parametrize("stochastic", [False, True], ids=["nearest", "stochastic"])
def test_checkpoint_resume_is_bitwise(stochastic):
    """Save after 5 steps, load into fresh objects, 5 more: the same bits as 10 straight."""
    kwargs = dict(lr=3e-3, weight_decay=0.01, stochastic_rounding=stochastic, seed=11)
    a, opt_a = ampc.prepare(mlp(), ampc.optim.AdamW, bf16, **kwargs)
    train(a, opt_a, 10)

    b, opt_b = ampc.prepare(mlp(), ampc.optim.AdamW, bf16, **kwargs)
    train(b, opt_b, 5)
    saved = roundtrip({"model": b.state_dict(), "opt": opt_b.state_dict()})
    c, opt_c = ampc.prepare(mlp(seed=1), ampc.optim.AdamW, bf16, **kwargs)  # other init
    c.load_state_dict(saved["model"])
    opt_c.load_state_dict(saved["opt"])
    for p in c.parameters():
        st = opt_c.state[p]
        assert all(st[k].dtype == f32 for k in st), "load_state_dict must keep the state fp32"
    train(c, opt_c, 5, start=5)
    for pa, pc in zip(a.parameters(), c.parameters()):
        assert_same(pc.detach(), pa.detach(), "weights")
        for key in opt_a.state[pa]:
            assert_same(opt_c.state[pc][key], opt_a.state[pa][key], key)


def test_torch_checkpoint_loads_into_ampc_and_continues_identically():
    torch_model, ampc_model = mlp(), mlp()
    topt = torch.optim.AdamW(torch_model.parameters(), lr=1e-3, fused=True)
    train(torch_model, topt, 3)
    ampc_model.load_state_dict(torch_model.state_dict())
    aopt = ampc.optim.AdamW(ampc_model.parameters(), lr=1e-3)
    aopt.load_state_dict(roundtrip(topt.state_dict()))
    train(torch_model, topt, 3, start=3)
    train(ampc_model, aopt, 3, start=3)
    for pt, pa in zip(torch_model.parameters(), ampc_model.parameters()):
        torch.testing.assert_close(pa, pt, rtol=1e-6, atol=1e-7)   # Note [tails] in test_adam


def test_fp32_export_loads_into_the_original_model():
    model, opt = ampc.prepare(mlp(), ampc.optim.AdamW, bf16, lr=1e-3)
    train(model, opt, 3)
    exported = ampc.fp32_state_dict(model, opt)
    fresh = mlp(seed=5)
    fresh.load_state_dict(exported)
    for (name, p), q in zip(fresh.named_parameters(), model.parameters()):
        assert p.dtype == f32
        want = opt.state[q]["master"] if "master" in opt.state[q] else q.detach()
        assert_same(p.detach(), want, name)
    x, _ = batch(0)
    torch.testing.assert_close(fresh(x), model(x).float(), rtol=0.05, atol=0.05)


def assert_same_state_dict(got, want):
    assert got["param_groups"] == want["param_groups"]
    assert got["state"].keys() == want["state"].keys()
    for pid, st in want["state"].items():
        assert got["state"][pid].keys() == st.keys(), pid
        for key, v in st.items():
            assert_same(got["state"][pid][key], v, f"state[{pid}][{key!r}]")


def test_mismatched_checkpoint_raises_clearly_before_loading_anything():
    model, opt = ampc.prepare(mlp(width=48), ampc.optim.AdamW, bf16, lr=1e-3)
    train(model, opt, 1)
    saved = opt.state_dict()
    saved["param_groups"][0]["lr"] = 0.5              # would show if the groups were loaded
    # an optimizer that has stepped, so a partial load would change state it already has
    other, opt_other = ampc.prepare(mlp(width=32), ampc.optim.AdamW, bf16, lr=1e-3)
    train(other, opt_other, 2)
    before = copy.deepcopy(opt_other.state_dict())
    with pytest.raises(ValueError, match=r"ampc\.optim\.AdamW\.load_state_dict: 'exp_avg' of "
                                         r"param 0 has shape \(48, 20\), but the param has "
                                         r"shape \(32, 20\)"):
        opt_other.load_state_dict(saved)
    assert_same_state_dict(opt_other.state_dict(), before)
    plain = ampc.optim.AdamW(mlp().to(bf16).parameters(), lr=1e-3, master_weights=False)
    before = copy.deepcopy(plain.state_dict())
    with pytest.raises(ValueError, match=r"param 0 has a master weight in the checkpoint, but "
                                         r"this optimizer was made with master_weights=False"):
        plain.load_state_dict(saved)
    assert_same_state_dict(plain.state_dict(), before)


def test_prepare_casts_weights_keeps_norms_and_seeds_masters_exactly():
    fp32 = mlp()
    originals = {n: p.detach().clone() for n, p in fp32.named_parameters()}
    model, opt = ampc.prepare(fp32, ampc.optim.AdamW, f16, lr=1e-3)
    assert model is fp32
    for name, p in model.named_parameters():
        norm = name.startswith("1.")            # the LayerNorm
        assert p.dtype == (f32 if norm else f16), name
        if norm:
            assert "master" not in opt.state[p]
        else:
            assert_same(opt.state[p]["master"], originals[name], name)  # not the rounded copy
            assert_same(p.detach(), originals[name].to(f16), name)
    out = model(batch(0)[0])              # fp32 input cast by the hook
    assert out.dtype == f16


def test_prepare_with_an_optimizer_instance_and_refusals():
    model = mlp()
    opt = ampc.optim.Adam(model.parameters(), lr=1e-3)
    model, same = ampc.prepare(model, opt, bf16)
    assert same is opt and all("master" in opt.state[p] for p in model[0].parameters())
    with pytest.raises(TypeError, match=r"ampc\.prepare: optimizer must be an ampc\.optim "
                                        r"optimizer, got SGD"):
        ampc.prepare(mlp(), torch.optim.SGD, lr=0.1)
    with pytest.raises(ValueError, match=r"ampc\.prepare: dtype must be torch\.float16 or "
                                         r"torch\.bfloat16"):
        ampc.prepare(mlp(), ampc.optim.AdamW, torch.float64)
    with pytest.raises(ValueError, match=r"ampc\.prepare: parameter 0\.weight is torch\.bfloat16"):
        ampc.prepare(mlp().to(bf16), ampc.optim.AdamW)


@pytest.mark.parametrize("dtype", [bf16, f16], ids=["bf16", "fp16"])
def test_master_weight_training_tracks_fp32(dtype):
    steps = 60
    ref_model = mlp()
    ref = train(ref_model, torch.optim.AdamW(ref_model.parameters(), lr=3e-3, fused=True), steps)
    model, opt = ampc.prepare(mlp(), ampc.optim.AdamW, dtype, lr=3e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10) if dtype == f16 else None
    got = train(model, opt, steps, scaler=scaler)
    assert ref[-1] < 0.5 * ref[0]                                 # fp32 learns
    assert got[-1] < 0.5 * got[0]                                 # and so does ampc
    assert abs(sum(got[-10:]) - sum(ref[-10:])) / sum(ref[-10:]) < 0.15, (ref[-10:], got[-10:])


@pytest.mark.smoke
def test_torch_grad_scaler_drives_ampc_without_host_sync(monkeypatch):
    model, opt = ampc.prepare(mlp(), ampc.optim.AdamW, f16, lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 12)
    train(model, opt, 2, scaler=scaler)              # warm up: state exists

    def forbidden(*args, **kwargs):
        raise AssertionError("host sync in scaler.step / update")
    x, y = batch(3)
    opt.zero_grad()
    scaler.scale(((model(x).float() - y) ** 2).mean()).backward()
    for name in ("item", "__bool__", "tolist", "__float__"):
        monkeypatch.setattr(torch.Tensor, name, forbidden)
    scaler.step(opt)
    scaler.update()
    monkeypatch.undo()
    assert all(opt.state[p]["step"].item() == 3 for p in model.parameters())


def test_grad_scaler_skip_leaves_everything_and_counts_no_step():
    model, opt = ampc.prepare(mlp(), ampc.optim.AdamW, f16, lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    train(model, opt, 2, scaler=scaler)
    before = copy.deepcopy((list(model.parameters()), opt.state_dict()))
    x, y = batch(5)
    opt.zero_grad()
    scaler.scale(((model(x).float() - y) ** 2).mean()).backward()
    next(model.parameters()).grad[0, 0] = float("inf")
    scaler.step(opt)
    scaler.update()
    assert scaler.get_scale() == 2.0 ** 9
    for p, q in zip(model.parameters(), before[0]):
        assert torch.equal(p, q)
    for pid, st in opt.state_dict()["state"].items():
        for key, v in st.items():
            assert torch.equal(v, before[1]["state"][pid][key]), key


def test_params_without_grads_and_added_groups():
    a, b, c = (nn.Parameter(torch.randn(n)) for n in (5, 6, 7))
    opt = ampc.optim.AdamW([a, b], lr=0.1)
    a.grad = torch.randn(5)
    opt.step()
    assert len(opt.state[a]) and not opt.state[b]
    opt.add_param_group({"params": [c], "lr": 0.5, "amsgrad": True})
    assert opt.param_groups[1]["betas"] == (0.9, 0.999)
    c.grad = torch.randn(7)
    before = c.detach().clone()
    opt.step()
    assert "max_exp_avg_sq" in opt.state[c] and not torch.equal(c.detach(), before)
    opt.zero_grad()
    assert a.grad is None


def test_master_weights_option():
    p16 = nn.Parameter(torch.randn(10).to(bf16))
    p32 = nn.Parameter(torch.randn(10))
    auto = ampc.optim.AdamW([p16, p32], lr=0.1)
    for p in (p16, p32):
        p.grad = torch.randn(10).to(p.dtype)
    auto.step()
    assert "master" in auto.state[p16] and "master" not in auto.state[p32]
    off = ampc.optim.AdamW([nn.Parameter(torch.randn(10).to(bf16))], lr=0.1,
                           master_weights=False)
    q = off.param_groups[0]["params"][0]
    q.grad = torch.randn(10).to(bf16)
    off.step()
    assert "master" not in off.state[q] and off.state[q]["exp_avg"].dtype == f32
