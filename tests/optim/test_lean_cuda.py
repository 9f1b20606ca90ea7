"""CUDA adam_lean against the CPU's, bit for bit, on the same inputs (the reasoning and
the one hazard, pow() in double, are test_adam_cuda.py's). Needs a GPU."""
import pytest
import torch

import ampc
from reference import assert_same

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

bf16 = torch.bfloat16
SIZES = [1, 255, 256, 257, 4097, 65536 * 3 + 11]


def inputs(weights, moments):
    g = torch.Generator().manual_seed(0)
    w = [torch.randn(n, generator=g) for n in SIZES]
    params = [x if weights == "fp32" else x.to(bf16) for x in w]
    q8 = moments == torch.uint8
    return dict(
        params=params, grads=[torch.randn(n, generator=g).to(bf16) for n in SIZES],
        exp_avgs=[torch.zeros(n, dtype=moments) for n in SIZES],
        exp_avg_sqs=[torch.zeros(n, dtype=moments) for n in SIZES],
        steps=[torch.zeros(1) for _ in SIZES],
        masters=[x.clone() for x in w] if weights == "master" else None,
        compensations=[torch.zeros(n, dtype=bf16) for n in SIZES] if weights == "kahan" else None,
        exp_avg_scales=[torch.zeros(-(-n // 256)) for n in SIZES] if q8 else None,
        exp_avg_sq_scales=[torch.zeros(-(-n // 256)) for n in SIZES] if q8 else None)


def run(lists, device, weights):
    lists = {k: None if v is None else [t.to(device) for t in v] for k, v in lists.items()}
    for k in range(3):
        ampc.ops.adam_lean(lists["params"], lists["grads"], lists["exp_avgs"], lists["exp_avg_sqs"],
                           lists["steps"], lr=1e-2, masters=lists["masters"],
                           compensations=lists["compensations"],
                           exp_avg_scales=lists["exp_avg_scales"],
                           exp_avg_sq_scales=lists["exp_avg_sq_scales"], weight_decay=0.1,
                           inv_scale=torch.full((1,), 0.5, device=device),
                           clip_coef=torch.full((1,), 0.9, device=device),
                           stochastic=weights == "sr", seed=7)
    return lists


@pytest.mark.parametrize("moments", [torch.float32, bf16, torch.uint8], ids=str)
@pytest.mark.parametrize("weights", ["fp32", "master", "sr", "kahan", "rne"])
def test_cuda_matches_cpu(weights, moments):
    lists = inputs(weights, moments)
    cpu, gpu = run(lists, "cpu", weights), run(lists, "cuda", weights)
    for k, v in cpu.items():
        for i, (a, b) in enumerate(zip(v or [], gpu[k] or [])):
            assert_same(b.cpu(), a, f"{k}[{i}]")


@pytest.mark.parametrize("stochastic", [False, True])
def test_packed_lean_state_on_cuda_matches_cpu(stochastic):
    """The lean optimizer's packed path (small params: one adam_lean_packed call on pointers
    into the packed buffers) on the GPU gives the CPU's bits."""
    shapes = [(64, 64), (17,), (300, 20), (1,), (5, 1000), (33,)]

    def params(device):
        g = torch.Generator().manual_seed(0)
        return [torch.nn.Parameter(torch.randn(s, generator=g).to(bf16).to(device))
                for s in shapes]

    cpu, gpu = params("cpu"), params("cuda")
    opts = [ampc.optim.AdamW(ps, lr=1e-2, state="lean", stochastic_rounding=stochastic, seed=5)
            for ps in (cpu, gpu)]
    for k in range(3):
        g = torch.Generator().manual_seed(100 + k)
        for p, q in zip(cpu, gpu):
            grad = torch.randn(p.shape, generator=g).to(bf16)
            p.grad, q.grad = grad, grad.to("cuda")
        for opt in opts:
            opt.step()
    for i, (p, q) in enumerate(zip(cpu, gpu)):
        assert opts[1].state[q]["step"]._base is not None        # packed on the GPU too
        assert_same(q.detach().cpu(), p.detach(), f"param {i}")
        for key, t in opts[0].state[p].items():
            assert_same(opts[1].state[q][key].cpu(), t, f"'{key}' of param {i}")
