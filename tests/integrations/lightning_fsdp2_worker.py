"""One rank of test_lightning_fsdp2.py (run by torch.distributed.run): Lightning's
ModelParallelStrategy (FSDP2's fully_shard in configure_model) with AmpcPrecision("16-mixed"),
clipping, and an overflow planted in the second step; saves this rank's results."""
import os
import sys

import torch
from torch import nn
from torch.distributed.fsdp import fully_shard

import lightning.pytorch as L
from lightning.pytorch.strategies import ModelParallelStrategy

import ampc
from ampc.integrations.lightning import AmpcPrecision

# at the default 2**16 one rank's fp16 gradients of its 8 samples overflow by themselves in a
# step where the 16 samples together do not: a smaller scale keeps the planted overflow the only one
INF_BATCH, CLIP, BATCH, SCALE = 1, 0.05, 8, 256.0


def net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.LayerNorm(32), nn.Linear(32, 4))


def data():
    g = torch.Generator().manual_seed(0)
    return torch.randn(64, 16, generator=g), torch.randn(64, 4, generator=g)


class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = net()
        self.losses = []

    def configure_model(self):
        mesh = self.device_mesh["data_parallel"]
        fully_shard(self.net[0], mesh=mesh)
        fully_shard(self.net, mesh=mesh)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x).float(), y)
        if batch_idx == INF_BATCH:
            loss = loss * float("inf")
        self.losses.append(loss.detach().clone())
        return loss

    def configure_optimizers(self):
        return ampc.optim.AdamW(self.parameters(), lr=1e-2)


def main(out_dir):
    x, y = data()
    rank = int(os.environ["RANK"])
    # this rank's share, dealt as a DistributedSampler without shuffling deals it
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(x[rank::2], y[rank::2]), batch_size=BATCH)
    strategy = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
    trainer = L.Trainer(accelerator="cpu", devices=2, max_epochs=1, strategy=strategy,
                        plugins=[AmpcPrecision("16-mixed", "cpu", init_scale=SCALE)],
                        gradient_clip_val=CLIP,
                        use_distributed_sampler=False, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    model = Model()
    trainer.fit(model, loader)
    scaler = trainer.precision_plugin.scaler
    params = [p.full_tensor().detach() for p in model.net.parameters()]
    torch.save({"losses": torch.stack(model.losses), "params": params,
                "scale": scaler.get_scale(), "skipped": int(scaler.skipped_steps())},
               os.path.join(out_dir, f"rank{trainer.global_rank}.pt"))
    sys.stdout.flush()
    os._exit(0)     # torch's teardown of a gloo group can abort a rank after its result is saved


if __name__ == "__main__":
    main(sys.argv[1])
