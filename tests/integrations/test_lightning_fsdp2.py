"""Lightning with FSDP2, 2 gloo ranks on the CPU: ModelParallelStrategy (fully_shard in
configure_model) takes AmpcPrecision; the ranks agree on the skipped step, and the run trains
as one process on the whole batch. (Lightning's FSDPStrategy, FSDP1, refuses any precision
plugin but its own: test_lightning.py checks that error.)"""
import os
import subprocess
import sys

import torch

from integration_helpers import need

need("lightning.pytorch")

import ampc  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
import lightning_fsdp2_worker as worker  # noqa: E402


def test_fsdp2_two_ranks_with_ampc_precision(tmp_path):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                          "--nproc_per_node", "2", os.path.join(HERE, "lightning_fsdp2_worker.py"),
                          str(tmp_path)], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0 and all((tmp_path / f"rank{r}.pt").exists() for r in (0, 1)), \
        out.stdout[-3000:] + out.stderr[-3000:]
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1)]
    for r in ranks:
        assert torch.isinf(r["losses"][worker.INF_BATCH])
        assert r["skipped"] == 1 and r["scale"] == worker.SCALE / 2
    for a, b in zip(ranks[0]["params"], ranks[1]["params"]):
        assert torch.equal(a, b)
    # one process, the two ranks' batches together (DistributedSampler deals index i to rank
    # i % 2): the mean of the ranks' losses, and the same weights up to the order of the sums
    net = worker.net()
    opt = ampc.optim.AdamW(net.parameters(), lr=1e-2)
    scaler = ampc.GradScaler("cpu", init_scale=worker.SCALE)
    x, y = worker.data()
    losses = []
    for i in range(len(ranks[0]["losses"])):
        xb, yb = x[16 * i:16 * i + 16], y[16 * i:16 * i + 16]
        opt.zero_grad()
        with ampc.autocast("cpu", dtype=torch.float16, cache_enabled=False):
            loss = torch.nn.functional.mse_loss(net(xb).float(), yb)
        if i == worker.INF_BATCH:
            loss = loss * float("inf")
        losses.append(loss.detach())
        scaler.scale(loss).backward()
        scaler.clip_grad_norm_(opt, worker.CLIP)
        scaler.step(opt)
        scaler.update()
    mean = (ranks[0]["losses"] + ranks[1]["losses"]) / 2
    finite = torch.isfinite(mean)
    torch.testing.assert_close(mean[finite], torch.stack(losses)[finite], rtol=1e-3, atol=1e-3)
    for a, b in zip(ranks[0]["params"], net.parameters()):
        torch.testing.assert_close(a, b.detach(), rtol=1e-3, atol=1e-3)
