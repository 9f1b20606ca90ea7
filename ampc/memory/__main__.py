"""python -m ampc.memory: where one training step's memory goes, on a GPT-2-shaped model.

    python -m ampc.memory [--batch 4] [--context 128] [--width 512] [--layers 4] [--vocab 8192]
                          [--optimizer adamw|lean] [--autocast bf16] [--recompute 'transformer.h.*.attn']
                          [--png memory.png] [--top 10] [--json]

The model is transformers' GPT2LMHeadModel from a fresh config (dropout 0, no KV cache, which a
training step does not need), on random tokens, trained by next-token cross-entropy.
"""
from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

from ._recompute import recompute
from ._report import report


def gpt2(width: int, layers: int, vocab: int, context: int) -> torch.nn.Module:
    try:
        from transformers import GPT2Config, GPT2LMHeadModel
    except ImportError as e:
        raise SystemExit("python -m ampc.memory: the demo model needs transformers "
                         "(pip install transformers)") from e
    cfg = GPT2Config(vocab_size=vocab, n_positions=context, n_embd=width, n_layer=layers,
                     n_head=max(1, width // 64), resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                     use_cache=False, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(cfg)


def next_token_loss(out, tokens):
    logits = out.logits[:, :-1]
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m ampc.memory", description=__doc__.splitlines()[0])
    for name, default in (("batch", 4), ("context", 128), ("width", 512), ("layers", 4), ("vocab", 8192),
                          ("top", 10)):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--optimizer", choices=("adamw", "lean"), default="adamw",
                   help="torch's fused AdamW, or ampc's AdamW with state='lean' (8-bit moments)")
    p.add_argument("--autocast", choices=("bf16", "fp16"), help="run the forward in an ampc.autocast region")
    p.add_argument("--recompute", action="append", default=[], metavar="MODULES",
                   help="module name or pattern to recompute in the backward (repeatable)")
    p.add_argument("--png", help="write the bar picture here")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    args = p.parse_args(argv)

    torch.manual_seed(0)
    model = gpt2(args.width, args.layers, args.vocab, args.context)
    if args.optimizer == "lean":
        from ..optim import AdamW
        opt = AdamW(model.parameters(), lr=1e-3, state="lean")
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    if args.recompute:
        recompute(model, args.recompute)
    tokens = torch.randint(0, args.vocab, (args.batch, args.context), generator=torch.Generator().manual_seed(0))
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(args.autocast)
    r = report(model, opt, ({"input_ids": tokens}, tokens), next_token_loss, autocast=dtype, top=args.top)
    n = sum(q.numel() for q in model.parameters())
    what = (f"GPT-2-shaped, {n / 1e6:.1f}M params, width {args.width}, {args.layers} layers, vocab {args.vocab}, "
            f"batch {args.batch} x context {args.context}, {args.optimizer}"
            + (f", autocast {args.autocast}" if args.autocast else ""))
    if args.json:
        print(json.dumps({"model": what, **r.as_dict()}, indent=1))
    else:
        print(what)
        print(r.table(args.top))
    if args.png:
        r.plot(args.png, args.top, title=what)
        if not args.json:
            print(f"picture: {args.png}")


if __name__ == "__main__":
    main()
