"""Bad input to the Adam step, at the op and at the optimizer: every case raises an
error that names the op (or optimizer) and the argument, and changes no tensor."""
import pytest
import torch

import ampc
import ampc.optim
from reference import assert_refused_unchanged

f32, f16, bf16 = torch.float32, torch.float16, torch.bfloat16


def adam_lists(n=2, size=37, pt=f32, gt=None, master=False, amsgrad=False):
    """A consistent set of lists for ampc.ops.adam_master, as a dict of its arguments."""
    gt = gt or pt
    a = dict(params=[torch.randn(size).to(pt) for _ in range(n)],
             grads=[torch.randn(size).to(gt) for _ in range(n)],
             exp_avgs=[torch.randn(size) for _ in range(n)],
             exp_avg_sqs=[torch.rand(size) for _ in range(n)],
             steps=[torch.full((1,), 2.0) for _ in range(n)])
    if master:
        a["masters"] = [torch.randn(size) for _ in range(n)]
    if amsgrad:
        a["max_exp_avg_sqs"] = [torch.rand(size) for _ in range(n)]
    return a


def tensors_of(args):
    out = []
    for v in args.values():
        if isinstance(v, torch.Tensor):
            out.append(v)
        elif isinstance(v, (list, tuple)):
            out += [t for t in v if isinstance(t, torch.Tensor)]
    return out


def case(args, pattern, exc=RuntimeError, **kwargs):
    call = lambda: ampc.ops.adam_master(**args, **{"lr": 1e-3, **kwargs})  # noqa: E731
    return call, tensors_of(args) + [v for v in kwargs.values() if isinstance(v, torch.Tensor)], \
        exc, pattern


def case_grad_dtype():
    a = adam_lists()
    a["grads"][1] = a["grads"][1].double()
    return case(a, r"^ampc\.adam_master: grads\[1\] must be torch\.float32, torch\.float16 or "
                   r"torch\.bfloat16, got torch\.float64")


def case_mixed_param_dtypes():
    a = adam_lists(pt=bf16, master=True)
    a["params"][1] = a["params"][1].half()
    return case(a, r"^ampc\.adam_master: params\[1\] must be torch\.bfloat16 like params\[0\], "
                   r"got torch\.float16")


def case_moment_dtype():
    a = adam_lists()
    a["exp_avg_sqs"][0] = a["exp_avg_sqs"][0].to(bf16)
    return case(a, r"^ampc\.adam_master: exp_avg_sqs\[0\] must be torch\.float32, got "
                   r"torch\.bfloat16")


def case_master_dtype():
    a = adam_lists(pt=bf16, master=True)
    a["masters"][1] = a["masters"][1].to(bf16)
    return case(a, r"^ampc\.adam_master: masters\[1\] must be torch\.float32, got torch\.bfloat16")


def case_too_few_grads():
    a = adam_lists()
    a["grads"] = a["grads"][:1]
    return case(a, r"^ampc\.adam_master: grads must have as many tensors as params \(2\), got 1")


def case_too_few_masters():
    a = adam_lists(pt=bf16, master=True)
    a["masters"] = a["masters"][:1]
    return case(a, r"^ampc\.adam_master: masters must have as many tensors as params \(2\), "
                   r"got 1")


def case_too_few_steps():
    a = adam_lists()
    a["steps"] = a["steps"][:1]
    return case(a, r"^ampc\.adam_master: steps must have as many tensors as params \(2\), got 1")


def case_moment_shape():
    a = adam_lists()
    a["exp_avgs"][1] = torch.randn(36)
    return case(a, r"^ampc\.adam_master: exp_avgs\[1\] must have the shape of params\[1\]")


def case_step_not_scalar():
    a = adam_lists()
    a["steps"][0] = torch.zeros(2)
    return case(a, r"^ampc\.adam_master: steps\[0\] must be a 1-element torch\.float32 tensor, "
                   r"got torch\.float32 with 2 elements")


def case_step_int():
    a = adam_lists()
    a["steps"][1] = torch.zeros(1, dtype=torch.int64)
    return case(a, r"^ampc\.adam_master: steps\[1\] must be a 1-element torch\.float32 tensor")


def case_shared_step():
    a = adam_lists()
    a["steps"][1] = a["steps"][0]
    return case(a, r"^ampc\.adam_master: steps\[\d\] overlaps steps\[\d\] in memory")


def case_moment_aliases_param():
    a = adam_lists()
    a["exp_avgs"][0] = a["params"][0]
    return case(a, r"^ampc\.adam_master: \w+\[0\] overlaps \w+\[0\] in memory")


def case_noncontiguous_moment():
    a = adam_lists(size=36)
    a["params"] = [p.view(6, 6) for p in a["params"]]
    a["grads"] = [g.view(6, 6) for g in a["grads"]]
    a["exp_avg_sqs"] = [v.view(6, 6) for v in a["exp_avg_sqs"]]
    a["exp_avgs"] = [torch.randn(6, 6), torch.randn(6, 6).t()]
    return case(a, r"^ampc\.adam_master: exp_avgs\[1\] must be contiguous")


def case_meta_grad():
    a = adam_lists()
    a["grads"][0] = torch.empty(37, device="meta")
    return case(a, r"ampc\.adam_master: .* must be on")


def case_found_inf_dtype():
    return case(adam_lists(), r"^ampc\.adam_master: found_inf must be a 1-element "
                              r"torch\.float32 tensor, got torch\.int32",
                found_inf=torch.zeros(1, dtype=torch.int32))


def case_inv_scale_size():
    return case(adam_lists(), r"^ampc\.adam_master: inv_scale must be a 1-element "
                              r"torch\.float32 tensor, got torch\.float32 with 2 elements",
                inv_scale=torch.ones(2))


def case_clip_not_tensor():
    return case(adam_lists(), r"^ampc\.adam_master: clip_coef must be a Tensor, got float",
                exc=TypeError, clip_coef=0.5)


def case_beta1_one():
    return case(adam_lists(), r"^ampc\.adam_master: beta1 must be in \[0, 1\), got 1", beta1=1.0)


def case_negative_lr():
    return case(adam_lists(), r"^ampc\.adam_master: lr must be a finite number >= 0, got -0.1",
                lr=-0.1)


def case_nan_eps():
    return case(adam_lists(), r"^ampc\.adam_master: eps must be a finite number >= 0, got nan",
                eps=float("nan"))


def case_negative_weight_decay():
    return case(adam_lists(), r"^ampc\.adam_master: weight_decay must be a finite number >= 0",
                weight_decay=-1.0)


def case_params_not_a_list():
    a = adam_lists()
    a["params"] = a["params"][0]
    return case(a, r"^ampc\.adam_master: params must be a list or tuple of tensors, got Tensor",
                exc=TypeError)


CASES = {name[5:]: fn for name, fn in globals().items() if name.startswith("case_")}


@pytest.mark.parametrize("name", sorted(CASES))
def test_bad_input_raises_and_changes_nothing(name):
    assert_refused_unchanged(name, *CASES[name]())


def test_requires_grad_refused_in_grad_mode():
    a = adam_lists()
    a["params"][1].requires_grad_()
    with pytest.raises(RuntimeError, match=r"^ampc\.adam_master: params\[1\] requires grad"):
        ampc.ops.adam_master(**a, lr=1e-3)


def test_written_tensors_get_new_versions():
    a = adam_lists(pt=bf16, master=True)
    ampc.ops.adam_master(**a, lr=1e-3)
    for key in ("params", "masters", "exp_avgs", "exp_avg_sqs", "steps"):
        assert all(t._version == 1 for t in a[key]), key
    assert all(t._version == 0 for t in a["grads"])


# ---- the optimizers: torch's messages for torch's checks ----

@pytest.mark.parametrize("kwargs, message", [
    (dict(lr=-1.0), "Invalid learning rate: -1.0"),
    (dict(eps=-1.0), "Invalid epsilon value: -1.0"),
    (dict(betas=(1.0, 0.999)), "Invalid beta parameter at index 0: 1.0"),
    (dict(betas=(0.9, -0.1)), "Invalid beta parameter at index 1: -0.1"),
    (dict(weight_decay=-0.5), "Invalid weight_decay value: -0.5"),
])
def test_hyperparameters_checked_like_torch(kwargs, message):
    p = [torch.nn.Parameter(torch.randn(3))]
    with pytest.raises(ValueError) as theirs:
        torch.optim.AdamW(p, **kwargs)
    with pytest.raises(ValueError) as ours:
        ampc.optim.AdamW(p, **kwargs)
    assert str(ours.value) == str(theirs.value) == message


def test_sparse_grads_refused_before_any_change():
    dense = torch.nn.Parameter(torch.randn(5))
    sparse = torch.nn.Parameter(torch.randn(4, 3))
    opt = ampc.optim.AdamW([dense, sparse], lr=0.1)
    dense.grad = torch.randn(5)
    sparse.grad = torch.randn(4, 3).to_sparse()
    before = dense.detach().clone()
    with pytest.raises(RuntimeError, match=r"ampc\.optim\.AdamW does not support sparse gradients"):
        opt.step()
    assert torch.equal(dense.detach(), before)


def test_missing_state_named():
    p = torch.nn.Parameter(torch.randn(5))
    opt = ampc.optim.AdamW([p], lr=0.1, amsgrad=True)
    p.grad = torch.randn(5)
    opt.step()
    del opt.state[p]["max_exp_avg_sq"]
    with pytest.raises(RuntimeError, match=r"the state of param 0 has no 'max_exp_avg_sq'"):
        opt.step()


def test_differentiable_refused():
    with pytest.raises(ValueError, match=r"ampc\.optim\.Adam does not support differentiable"):
        ampc.optim.Adam([torch.nn.Parameter(torch.randn(2))], differentiable=True)
