"""Do the lean state's 8-bit moments follow fp32's over a long run when a block's largest value
changes? Each block of 256 values is coded against its absmax. Rounded to nearest, a value whose
own change in a step is under half a code step keeps its code, so it moves with the block's scale
instead of with its own decay or growth (at beta2 = 0.999 a second moment moves 0.05% a step in its
square root; the code's half step is 3%). The second moment's code now rounds stochastically
(lean.h), which moves it by its own change in expectation; the first moment's rounds to nearest.

Two gradient streams on a (64, 256) parameter (each row one block), the same for both optimizers,
weight decay 0, lr 1e-3: ampc.optim.AdamW(state="lean") (bf16 weights, 8-bit moments) against
torch.optim.AdamW (fp32):

  rising   column 0 keeps a gradient of 1 (its v grows toward 1, and the block's scale with it); the
           other 255 take 0.5 for the first 100 steps, then 0 (their v should decay as 0.999^t)
  fading   column 0's gradient fades, 10 exp(-t / 300); the other 255 hold 0.1 (their v should grow
           toward 0.01)

Printed every 200 steps: the mean exp_avg_sq and exp_avg of the other 255 columns, lean over fp32 (1.0:
tracking; the lean values are decoded as the next step reads them; m's ratio only where fp32's m is not
vanishing). Below 1 for v means the lean update m / sqrt(v) is larger than fp32's.

Then a real stream: bench_lean_quality.py's character GPT trained by fp32 AdamW (lr 2e-3, weight decay
0.01), each step's gradients also handed (in bf16) to ampc.optim.AdamW(state="lean") stepping a bf16 copy
of the weights: the same gradients for both states. At each report, the quantiles of lean v / fp32 v over
the elements of the 8-bit params (v above 1e-12 of its tensor's largest).

Last, the v recurrence alone on the same gradients, coded in Python (sqrt(v) against its block's
largest, 4 mantissa bits, code 1 at least where v > 0), rounded to nearest (as lean.h coded it before
its code rounded stochastically: those quantiles were the kernel's, digit for digit) and stochastically
between its two neighbours (as lean.h does now, with other random bits: near the kernel's above).

    python benchmarks/bench_lean_moment_drift.py [--steps 2000] [--model-steps 2000]
"""
import argparse
import math

import torch

import _harness as H

ampc = H.import_ampc()
import ampc.optim  # noqa: E402
from ampc.optim._codes import decode_moments  # noqa: E402

SHAPE = (64, 256)


def gradient(stream, t):
    g = torch.zeros(SHAPE)
    if stream == "rising":
        g[:, 0] = 1.0
        g[:, 1:] = 0.5 if t < 100 else 0.0
    else:
        g[:, 0] = 10.0 * math.exp(-t / 300)
        g[:, 1:] = 0.1
    return g


def run(stream, lean, steps, every):
    p = torch.nn.Parameter(torch.zeros(SHAPE, dtype=torch.bfloat16 if lean else torch.float32))
    opt = (ampc.optim.AdamW([p], lr=1e-3, weight_decay=0.0, state="lean") if lean
           else torch.optim.AdamW([p], lr=1e-3, weight_decay=0.0))
    out = []
    for t in range(steps):
        p.grad = gradient(stream, t).to(p.dtype)
        opt.step()
        if (t + 1) % every == 0:
            m, v = decode_moments(opt.state[p])     # torch's fp32 state as it is
            out.append((t + 1, m[:, 1:].mean().item(), v[:, 1:].mean().item()))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--every", type=int, default=200)
    ap.add_argument("--model-steps", type=int, default=2000, help="0: the synthetic streams only")
    args = ap.parse_args()
    print(H.machine("cpu"))
    for stream in ("rising", "fading"):
        print(f"\n{stream}: the other 255 columns, lean / fp32")
        print(f"{'step':>6} {'v fp32':>10} {'v lean':>10} {'v ratio':>8} {'m fp32':>10} {'m lean':>10} {'m ratio':>8}")
        for (t, m32, v32), (_, ml, vl) in zip(run(stream, False, args.steps, args.every),
                                              run(stream, True, args.steps, args.every)):
            mr = f"{ml / m32:8.3f}" if abs(m32) > 1e-8 else f"{'-':>8}"
            print(f"{t:6d} {v32:10.3e} {vl:10.3e} {vl / v32:8.3f} {m32:10.3e} {ml:10.3e} {mr}")
    if args.model_steps:
        model_stream(args.model_steps, args.every * 2)


def char_gpt():
    """(model, its fp32 AdamW, make_batch, loss) of bench_lean_quality.py's character GPT."""
    from bench_lean_quality import BATCH, CHARS, CONTEXT, GPT, HEADS, LAYERS, LR, WD, WIDTH, ce
    from ampc.demo._model import batch_maker
    from ampc.demo._text import load_text
    train = load_text(vocab_size=len(CHARS))[0]
    torch.manual_seed(0)
    model = GPT(WIDTH, LAYERS, HEADS, CONTEXT, vocab=len(CHARS))
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    return model, opt, batch_maker(train, CONTEXT, BATCH, 0), ce


QS = (0.01, 0.1, 0.5, 0.9, 0.99)


def quantiles(ratios):
    r = torch.cat(ratios).double()
    return " ".join(f"{v:8.3f}" for v in torch.quantile(r, torch.tensor(QS, dtype=r.dtype)).tolist())


def ratios(pairs):
    """Quantiles of a / b over the elements of each (a, b) where b is above 1e-12 of its largest."""
    out = []
    for a, b in pairs:
        a, b = a.double().reshape(-1), b.double().reshape(-1)
        keep = b > 1e-12 * b.max()
        out.append(a[keep] / b[keep])
    return quantiles(out)


def model_stream(steps, every):
    """The lean state and the v recurrence coded in Python, both fed the fp32 run's gradients."""
    model, opt, make_batch, ce = char_gpt()
    lr, wd, beta2 = opt.defaults["lr"], opt.defaults["weight_decay"], opt.defaults["betas"][1]
    params = list(model.parameters())
    shadow = [torch.nn.Parameter(p.detach().bfloat16()) for p in params]
    lean = ampc.optim.AdamW(shadow, lr=lr, weight_decay=wd, state="lean")
    coded, vs, rows = None, None, []
    gen = torch.Generator().manual_seed(0)
    print(f"\nthe character GPT ({sum(p.numel() for p in params)} params), the same "
          f"gradients to both states: lean v / fp32 v over the 8-bit params' elements")
    print(f"{'step':>6} {'loss':>7} " + " ".join(f"{f'q{q:g}':>8}" for q in QS) + f" {'elements':>9}")
    for t in range(steps):
        x, y = make_batch(t)
        opt.zero_grad(set_to_none=True)
        loss = ce(model(x), y)
        loss.backward()
        for p, s in zip(params, shadow):
            s.grad = p.grad.bfloat16()
        opt.step()
        lean.step()
        if coded is None:      # the params the lean state codes (2-d, 4096 elements or more)
            coded = [i for i, s in enumerate(shadow) if "exp_avg_sq" not in lean.state[s]]
            vs = {sr: [torch.zeros_like(params[i], dtype=torch.float64) for i in coded]
                  for sr in (False, True)}
        for sr, v in vs.items():
            for k, i in enumerate(coded):
                g2 = params[i].grad.bfloat16().double() ** 2
                v[k] = v_code(beta2 * v[k] + (1 - beta2) * g2, sr, gen)
        if (t + 1) % every == 0:
            v32 = [opt.state[params[i]]["exp_avg_sq"] for i in coded]
            lean_v = [decode_moments(lean.state[shadow[i]])[1] for i in coded]
            print(f"{t + 1:6d} {loss.item():7.3f} {ratios(zip(lean_v, v32))} "
                  f"{sum(int((b > 1e-12 * b.max()).sum()) for b in v32):9d}")
            rows.append(f"{t + 1:6d} {ratios(zip(vs[False], v32))} | {ratios(zip(vs[True], v32))}")
    print("\nthe v recurrence alone, the same gradients, coded in Python: v / fp32 v, quantiles "
          + ", ".join(f"{q:g}" for q in QS) + ": to nearest | stochastic")
    print("\n".join(rows))


def v_code(v, stochastic, gen):
    """v after lean.h's code and back (sqrt(v) against its block of 256's largest, 4 mantissa
    bits, code 1 at least where v > 0): rounded to nearest, or stochastically between the two
    code values around it."""
    from ampc.optim._codes import _V_MAX, _tables
    grid = _tables("cpu")[1].double()           # the 256 values of the code, ascending
    flat = v.reshape(-1).sqrt()
    n = flat.numel()
    blocks = torch.cat([flat, flat.new_zeros(-n % 256)]).reshape(-1, 256)
    top = blocks.max(1, keepdim=True).values.expand(-1, 256).reshape(-1)[:n]
    x = (flat * (_V_MAX / top.clamp_min(1e-38))).clamp(0, _V_MAX)
    hi = torch.searchsorted(grid, x).clamp(1, 255)
    lo, ghi = hi - 1, grid[hi]
    glo = grid[lo]
    up = (torch.rand(x.shape, generator=gen, dtype=x.dtype) < (x - glo) / (ghi - glo)
          if stochastic else (ghi - x) < (x - glo))
    c = torch.where(up, hi, lo)
    c = torch.where((x > 0) & (c == 0), torch.ones_like(c), c)
    return ((grid[c] * top / _V_MAX) ** 2).reshape(v.shape)


if __name__ == "__main__":
    main()
