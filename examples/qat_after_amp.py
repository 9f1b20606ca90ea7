"""From mixed-precision training to an int8 model: train with ampc master weights, export
the fp32 master weights, fine-tune with quantization-aware training (torch's own eager
flow, torch.ao.quantization), convert to int8 and evaluate.

    python examples/qat_after_amp.py [--steps 300] [--qat-steps 100] [--seed 0]

Why in this order: mixed precision is for the long, expensive part (training from
scratch), QAT for a short fine-tune at the end. The int8 model is made from fp32 weights,
so it should start from the master weights (ampc.fp32_state_dict), not from their bf16
copies, which have already lost 16 bits of each weight.

The task is synthetic and needs no download: 16 features, 4 classes given by a fixed
random linear teacher. torch.ao.quantization's eager flow is deprecated in favour of the
separate torchao package but still ships with torch; its warnings are silenced here.
"""
import argparse
import sys
import warnings

import torch
import torch.ao.quantization as tq
from torch import nn

import ampc

FEATURES, CLASSES = 16, 4
for _message in ("torch.ao.quantization is deprecated", "Please use quant_min and quant_max",
                 "torch.quantize_per_tensor, torch.quantize_per_channel"):
    warnings.filterwarnings("ignore", message=_message)


class Net(nn.Module):
    """An MLP with the quant/dequant stubs eager-mode quantization needs at its edges."""

    def __init__(self, width=64):
        super().__init__()
        self.quant, self.dequant = tq.QuantStub(), tq.DeQuantStub()
        self.fc1, self.relu1 = nn.Linear(FEATURES, width), nn.ReLU()
        self.fc2, self.relu2 = nn.Linear(width, width), nn.ReLU()
        self.out = nn.Linear(width, CLASSES)

    def forward(self, x):
        x = self.relu1(self.fc1(self.quant(x)))
        return self.dequant(self.out(self.relu2(self.fc2(x))))


def make_data(n, seed):
    g = torch.Generator().manual_seed(seed)
    teacher = torch.randn(FEATURES, CLASSES, generator=g)
    x = torch.randn(n, FEATURES, generator=g)
    y = (x @ teacher).argmax(1)
    return x, y


@torch.no_grad()
def accuracy(model, x, y):
    model.eval()
    return (model(x).float().argmax(1) == y).float().mean().item()


def batches(x, y, steps, size, seed):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        idx = torch.randint(0, len(x), (size,), generator=g)
        yield x[idx], y[idx]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    p.add_argument("--steps", type=int, default=300, help="mixed-precision training steps")
    p.add_argument("--qat-steps", type=int, default=100, help="QAT fine-tuning steps")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.steps < 1 or args.qat_steps < 0:
        p.error("--steps must be at least 1 and --qat-steps at least 0")
    torch.manual_seed(args.seed)
    x, y = make_data(6000, args.seed)
    (xt, yt), (xv, yv) = (x[:5000], y[:5000]), (x[5000:], y[5000:])
    loss_fn = nn.CrossEntropyLoss()

    # 1. mixed-precision training: bf16 weights, fp32 master weights in the optimizer
    model, opt = ampc.prepare(Net(), ampc.optim.AdamW, torch.bfloat16, lr=3e-3)
    model.train()
    for xb, yb in batches(xt, yt, args.steps, 128, args.seed):
        opt.zero_grad()
        loss_fn(model(xb).float(), yb).backward()
        opt.step()
    acc_bf16 = accuracy(model, xv, yv)

    # 2. export the master weights into a plain fp32 model
    fp32 = Net()
    fp32.load_state_dict(ampc.fp32_state_dict(model, opt))
    acc_fp32 = accuracy(fp32, xv, yv)

    def observed(qconfig, prepare, training):
        """A copy of the fp32 model with ``qconfig``'s observers inserted by ``prepare``."""
        m = Net()
        m.load_state_dict(fp32.state_dict())
        m.train(training)
        m.qconfig = qconfig
        return prepare(m)

    # 3. post-training quantization as a baseline: calibrate observers, convert
    ptq = observed(tq.get_default_qconfig("x86"), tq.prepare, training=False)
    with torch.no_grad():
        ptq(xt[:1000])
    acc_ptq = accuracy(tq.convert(ptq), xv, yv)

    # 4. quantization-aware fine-tuning from the fp32 weights, then int8
    qat = observed(tq.get_default_qat_qconfig("x86"), tq.prepare_qat, training=True)
    qopt = torch.optim.AdamW(qat.parameters(), lr=3e-4)
    for xb, yb in batches(xt, yt, args.qat_steps, 128, args.seed + 1):
        qopt.zero_grad()
        loss_fn(qat(xb), yb).backward()
        qopt.step()
    qat.eval()
    int8 = tq.convert(qat)
    acc_int8 = accuracy(int8, xv, yv)

    results = {"bf16 (ampc master weights)": acc_bf16, "fp32 export": acc_fp32,
               "int8 post-training": acc_ptq, "int8 after QAT": acc_int8}
    for name, acc in results.items():
        print(f"{name:<28} validation accuracy {100 * acc:.1f}%")
    return results


if __name__ == "__main__":
    main()
    sys.exit(0)
