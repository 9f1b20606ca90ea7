"""What ddp_train.py and fsdp2_train.py share: the process group (nccl with one GPU a rank,
else gloo on the CPU), the toy regression they train (a student MLP fitting a frozen
teacher on each rank's own random inputs), the step line rank 0 prints, and the teardown."""
import gc
import os

import torch
import torch.distributed as dist
from torch import nn


def start():
    """(rank, device) after joining the process group torchrun set up."""
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    return dist.get_rank(), device


def teacher_and_model(device):
    """The frozen teacher (on the CPU) and the student to train (on ``device``), the same
    weights on every rank."""
    torch.manual_seed(0)
    teacher = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 1)).requires_grad_(False)
    model = nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 128), nn.GELU(),
                          nn.Linear(128, 1)).to(device)
    return teacher, model


def batch(step, rank, device, teacher):
    g = torch.Generator().manual_seed(step * 1000 + rank)     # each rank its own data
    x = torch.randn(64, 32, generator=g)
    return x.to(device), teacher(x).to(device)


def print_step(step, loss, norm, scaler):
    print(f"step {step:4d}  loss {loss.item():.5f}  grad norm {float(norm):.4f}  "
          f"scale {scaler.get_scale():g}", flush=True)


def finish():
    dist.barrier()      # no rank tears its group down while a peer is still in a collective
    dist.destroy_process_group()


def run(main):
    main()
    # DDP's reducer and FSDP2's sharded tensors (through their device mesh) hold the gloo
    # group: free them while the interpreter is whole, not in its teardown at exit
    gc.collect()
