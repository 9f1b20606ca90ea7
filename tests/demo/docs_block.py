"""Runs one ```python block of a docs page as a reader would: in a fresh interpreter, after a
plain ``import ampc`` and nothing else of ampc, so that a public name the page uses must work
without help from whatever another block or test imported first.

    python docs_block.py PAGE LINE [MODULE ...]

LINE is the block's first line; each MODULE cannot be imported (as if it were not installed).
The names a snippet leaves to the reader (model, data, loss_fn, x, y, device ...) are small
stand-ins: a 16-32-16 classifier with a LayerNorm (FP8-friendly sizes), three batches of 8,
cross-entropy (ampc.validate's default loss), the CPU. A block that needs an optional package
that is missing exits with MISSING and prints the package's name on the last line.
"""
import re
import sys
from pathlib import Path

MISSING = 3
NO_RUN = re.compile(r"<!--\s*no-run:\s*(.*?)\s*-->")


def python_blocks(path):
    """(first line number, code, reason to skip or None) of each ```python block."""
    lines = Path(path).read_text().splitlines()
    blocks, i = [], 0
    while i < len(lines):
        if lines[i].strip() == "```python":
            before = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
            skip = NO_RUN.search(before)
            end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "```")
            blocks.append((i + 2, "\n".join(lines[i + 1:end]) + "\n",
                           skip.group(1) if skip else None))
            i = end
        i += 1
    return blocks


def stand_ins(ampc):
    import torch
    import torch.nn.functional as F
    from torch import nn

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.GELU())
            self.head = nn.Linear(32, 16)

        def forward(self, x):
            return self.head(self.body(x))

    def make_batch(step):
        g = torch.Generator().manual_seed(step)
        return torch.randn(8, 16, generator=g), torch.randint(0, 16, (8,), generator=g)

    # docs/autocast.md registers a custom op under a policy: torch.ops.mylib.attn
    @torch.library.custom_op("mylib::attn", mutates_args=())
    def attn(q: torch.Tensor) -> torch.Tensor:
        return q.clone()

    torch.manual_seed(0)
    x, y = make_batch(0)
    data = [make_batch(step) for step in range(3)]
    return {"torch": torch, "nn": nn, "F": F, "ampc": ampc, "device": "cpu",
            "model": Net(), "make_model": Net, "make_batch": make_batch, "data": data,
            "batches": data, "x": x, "y": y, "loss_fn": F.cross_entropy}


def main(page, line, *without):
    for module in without:
        sys.modules[module] = None
    code = next(c for first, c, _ in python_blocks(page) if first == int(line))
    import ampc
    namespace = stand_ins(ampc)
    try:
        exec(compile(code, f"{page}:{line}", "exec"), namespace)
    except ModuleNotFoundError as e:
        # ampc and torch are never optional: a block that cannot import them is broken
        top = (e.name or "").partition(".")[0]
        if top in ("", "ampc", "torch"):
            raise
        print(top)
        sys.exit(MISSING)


if __name__ == "__main__":
    main(*sys.argv[1:])
