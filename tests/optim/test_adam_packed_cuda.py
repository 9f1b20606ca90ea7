"""ampc.optim's packed state on CUDA against the same optimizer on the CPU, bit for bit:
the packed call points the CUDA kernel into one buffer per group, device and dtype, and
the step counts of all params live in one device tensor. Needs a GPU."""
import pytest
import torch

import ampc
import ampc.optim
from reference import assert_same

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

# around the 8-element vector and the 65536-element chunk, an empty one included
SIZES = [1, 7, 9, 0, 4097, 65537, 3 * 65536 + 5, 33]
DTYPES = [torch.bfloat16, torch.float32, torch.float16]


def params_on(device):
    g = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(n, generator=g).to(DTYPES[i % 3]).to(device))
            for i, n in enumerate(SIZES)]


@pytest.mark.parametrize("amsgrad, stochastic", [(False, False), (True, True)])
def test_packed_step_on_cuda_is_the_cpus(amsgrad, stochastic):
    cpu, gpu = params_on("cpu"), params_on("cuda")
    opts = [ampc.optim.AdamW(ps, lr=1e-2, amsgrad=amsgrad, stochastic_rounding=stochastic,
                             seed=5) for ps in (cpu, gpu)]
    for k in range(4):
        g = torch.Generator().manual_seed(100 + k)
        present = [k % 2 == 0 or i % 3 != 1 for i in range(len(SIZES))]
        for i, (p, q) in enumerate(zip(cpu, gpu)):
            grad = torch.randn(p.shape, generator=g).to(p.dtype)
            p.grad = grad if present[i] else None
            q.grad = grad.cuda() if present[i] else None
        for opt in opts:
            opt.step()
    torch.cuda.synchronize()
    for i, (p, q) in enumerate(zip(cpu, gpu)):
        assert_same(q.detach().cpu(), p.detach(), f"param {i}")
        for key, t in opts[0].state[p].items():
            assert_same(opts[1].state[q][key].cpu(), t, f"'{key}' of param {i}")
        assert opts[1].state[q]["exp_avg"]._base is not None      # packed on the GPU too
