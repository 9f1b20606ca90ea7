"""Data-parallel training with ampc under DistributedDataParallel.

    torchrun --nproc-per-node 2 examples/ddp_train.py          # CPU: gloo, bf16
    torchrun --nproc-per-node 8 examples/ddp_train.py          # GPUs: nccl, fp16, one GPU a rank

Nothing in the script is specific to ampc but the imports: ampc.autocast, ampc.GradScaler
and ampc.optim.AdamW take the places of torch.autocast, torch.amp.GradScaler and
torch.optim.AdamW. DDP all-reduces the gradients in backward, so every rank sees the same
gradients, the same inf/nan (an overflow on one rank skips the step on all of them) and
the same norm; the weights stay bit-identical across ranks.
Master-weight training works too: `model, opt = ampc.prepare(model, ampc.optim.AdamW,
torch.bfloat16)` before wrapping the model in DDP.
"""
import argparse

import torch
import torch.distributed as dist
from torch import nn

import ampc
from _toy_training import batch, finish, print_step, run, start, teacher_and_model


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=100)
    args = parser.parse_args()
    rank, device = start()
    dtype = torch.float16 if device.type == "cuda" else torch.bfloat16

    teacher, model = teacher_and_model(device)
    model = nn.parallel.DistributedDataParallel(
        model, device_ids=[device.index] if device.type == "cuda" else None)
    opt = ampc.optim.AdamW(model.parameters(), lr=3e-3)
    scaler = ampc.GradScaler(device.type, enabled="auto", dtype=dtype)   # on for fp16 only

    for step in range(args.steps):
        x, y = batch(step, rank, device, teacher)
        opt.zero_grad(set_to_none=True)
        with ampc.autocast(device.type, dtype=dtype):
            loss = nn.functional.mse_loss(model(x).float(), y)
        scaler.scale(loss).backward()
        norm = scaler.clip_grad_norm_(opt, 1.0)
        scaler.step(opt)
        scaler.update()
        if rank == 0 and (step % 20 == 0 or step == args.steps - 1):
            print_step(step, loss, norm, scaler)

    # the ranks hold the same weights, bit for bit
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    copies = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(copies, flat)
    if rank == 0:
        print("weights identical on every rank:", all(torch.equal(c, flat) for c in copies))
    finish()


if __name__ == "__main__":
    run(main)
