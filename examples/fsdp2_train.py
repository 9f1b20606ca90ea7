"""Sharded training with ampc under FSDP2 (fully_shard), with a checkpoint to resume from.

    torchrun --nproc-per-node 2 examples/fsdp2_train.py                # CPU: gloo, bf16
    torchrun --nproc-per-node 2 examples/fsdp2_train.py --dtype float16
    torchrun --nproc-per-node 8 examples/fsdp2_train.py                # GPUs: nccl, fp16

Each rank holds a shard of every weight (a DTensor). The right mixed-precision setup is
FSDP2's own: MixedPrecisionPolicy(param_dtype=bf16 or fp16, reduce_dtype=fp32) runs the
forward and backward in 16 bits and keeps the sharded params in fp32. Those fp32 shards
are the master weights, so ampc.optim.AdamW works on them as they are (no ampc.prepare,
no ampc.autocast): its moments are sharded like the params and its step runs on the local
shards. ampc.GradScaler (fp16) agrees on inf/nan and on the clip norm across the ranks, so
all of them skip the same steps with the same scale. torch.distributed.checkpoint saves
and loads the shards, the moments and the scaler: `--ckpt DIR` resumes from DIR if it
holds a checkpoint and saves to it at the end.
"""
import argparse
import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import ampc
from _toy_training import batch, finish, print_step, run, start, teacher_and_model


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--dtype", choices=["bfloat16", "float16"], default=None)
    parser.add_argument("--ckpt", default=None)
    args = parser.parse_args()
    rank, device = start()
    dtype = getattr(torch, args.dtype or ("float16" if device.type == "cuda" else "bfloat16"))

    teacher, model = teacher_and_model(device)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    opt = ampc.optim.AdamW(model.parameters(), lr=3e-3)           # after fully_shard
    scaler = ampc.GradScaler(device.type, enabled="auto", dtype=dtype)

    first = 0
    if args.ckpt and os.path.exists(os.path.join(args.ckpt, ".metadata")):
        model_sd, opt_sd = get_state_dict(model, opt)
        state = {"model": model_sd, "optim": opt_sd, "scaler": scaler.state_dict(), "step": 0}
        dcp.load(state, checkpoint_id=args.ckpt)
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        scaler.load_state_dict(state["scaler"])
        first = state["step"]

    for step in range(first, first + args.steps):
        x, y = batch(step, rank, device, teacher)
        opt.zero_grad(set_to_none=True)
        loss = nn.functional.mse_loss(model(x).float(), y)
        scaler.scale(loss).backward()
        norm = scaler.clip_grad_norm_(opt, 1.0)                         # the global norm
        scaler.step(opt)
        scaler.update()
        if step % 20 == 0 or step == first + args.steps - 1:
            norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm   # all ranks
            if rank == 0:
                print_step(step, loss, norm, scaler)

    if args.ckpt:
        model_sd, opt_sd = get_state_dict(model, opt)
        dcp.save({"model": model_sd, "optim": opt_sd, "scaler": scaler.state_dict(),
                  "step": first + args.steps}, checkpoint_id=args.ckpt)
    finish()


if __name__ == "__main__":
    run(main)
