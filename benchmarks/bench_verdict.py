"""How long ampc.validate.compare takes to a verdict on four small models outside the tests,
and whether a short run's verdict agrees with a long one's.

The models (each under 2M parameters): torchvision's VisionTransformer of
bench_compare_vit.py; an LSTM language model on a fixed random Markov chain; a UNet with
GroupNorm and ConvTranspose2d denoising smooth random images (MSE loss); a transformers T5
(d_model 64, 2 + 2 layers) learning to reverse a sequence. Setups: torch.amp (sound) and
"pure" (16-bit weights, no master copy: the contrast that drifts), both against fp32, each
trained from every seed.

    python benchmarks/bench_verdict.py                           # the short run: the verdict
    python benchmarks/bench_verdict.py --steps-x 4 --seeds 5     # the long run it should agree with
"""
import argparse
import os
import time
import warnings

import torch
import torch.nn.functional as F
from torch import nn

import _harness as H

ampc = H.import_ampc()
from ampc.validate._report import verdict_word  # noqa: E402
from bench_compare_vit import make_model as make_vit, task as vit_task  # noqa: E402


class LSTMLM(nn.Module):
    def __init__(self, vocab=32, width=64, hidden=128):
        super().__init__()
        self.emb = nn.Embedding(vocab, width)
        self.lstm = nn.LSTM(width, hidden, num_layers=2, batch_first=True)
        self.head = nn.Linear(hidden, vocab)

    def forward(self, x):
        return self.head(self.lstm(self.emb(x))[0])


def markov_batches(vocab=32, batch=16, length=32):
    """Sequences of a fixed random Markov chain (each token has 4 likely successors)."""
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(vocab, vocab, generator=g) * 3
    probs = torch.softmax(logits, -1)

    def make_batch(step):
        gs = torch.Generator().manual_seed(5000 + step)
        seq = [torch.randint(0, vocab, (batch,), generator=gs)]
        for _ in range(length):
            seq.append(torch.multinomial(probs[seq[-1]], 1, generator=gs)[:, 0])
        seq = torch.stack(seq, 1)
        return seq[:, :-1], seq[:, 1:]
    return make_batch


def conv_gn(cin, cout, stride=1):
    return nn.Sequential(nn.Conv2d(cin, cout, 3, stride, 1), nn.GroupNorm(8, cout), nn.SiLU())


class UNet(nn.Module):
    def __init__(self, width=32):
        super().__init__()
        self.inc = conv_gn(3, width)
        self.down = conv_gn(width, 2 * width, stride=2)
        self.mid = conv_gn(2 * width, 2 * width)
        self.up = nn.ConvTranspose2d(2 * width, width, 2, stride=2)
        self.dec = conv_gn(2 * width, width)
        self.out = nn.Conv2d(width, 3, 1)

    def forward(self, x):
        a = self.inc(x)
        b = self.up(self.mid(self.down(a)))
        return self.out(self.dec(torch.cat([a, b], 1)))


def denoise_batches(batch=16, size=32, noise=0.5):
    """Smooth random images (upsampled 4x4 noise) seen through Gaussian noise."""
    def make_batch(step):
        g = torch.Generator().manual_seed(9000 + step)
        clean = F.interpolate(torch.randn(batch, 3, 4, 4, generator=g), size=size,
                              mode="bilinear", align_corners=False)
        return clean + noise * torch.randn(clean.shape, generator=g), clean
    return make_batch


def make_t5():
    import transformers
    cfg = transformers.T5Config(vocab_size=64, d_model=64, d_kv=16, d_ff=128, num_layers=2,
                                num_decoder_layers=2, num_heads=4, decoder_start_token_id=0,
                                pad_token_id=0)
    return transformers.T5ForConditionalGeneration(cfg)


def reverse_batches(batch=16, length=12):
    def make_batch(step):
        g = torch.Generator().manual_seed(3000 + step)
        x = torch.randint(1, 64, (batch, length), generator=g)
        return {"input_ids": x, "labels": x.flip(1)}, x.flip(1)
    return make_batch


# name: (make_model, make_batch, loss_fn, steps of the short run, lr)
MODELS = {
    "vit": (make_vit, vit_task(8, 2.0), None, 60, 1e-3),
    "lstm": (LSTMLM, markov_batches(), None, 100, 3e-3),
    "unet": (UNet, denoise_batches(), F.mse_loss, 100, 2e-3),
    "t5": (make_t5, reverse_batches(), lambda out, target: out.loss, 100, 3e-3),
}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--setups", default="torch.amp,pure")
    p.add_argument("--steps-x", type=float, default=1.0,
                   help="multiply each model's short-run steps (4: the long run)")
    p.add_argument("--seeds", type=int, default=3, help="seeds 0..N-1 (fp32 and every setup)")
    a = p.parse_args()
    print(" | ".join(f"{k} {v}" for k, v in H.machine("cpu").items()))
    for name in a.models.split(","):
        make_model, make_batch, loss_fn, steps, lr = MODELS[name]
        steps = int(steps * a.steps_x)
        n = sum(q.numel() for q in make_model().parameters())
        load = os.getloadavg()[0]
        t0 = time.perf_counter()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            report = ampc.validate.compare(make_model, make_batch, loss_fn, steps=steps,
                                           setups=tuple(a.setups.split(",")),
                                           seeds=tuple(range(a.seeds)), lr=lr, device="cpu",
                                           progress=False)
        took = time.perf_counter() - t0
        print(f"\n== {name}: {n / 1e6:.2f}M params, {steps} steps, {a.seeds} seeds, lr {lr:g}: "
              f"compare took {took:.0f} s (load {load:.1f} before, {os.getloadavg()[0]:.1f} "
              f"after); fp32 spread {100 * report.spread:.2f}%")
        for r in report.rows:
            verdict = verdict_word(r, "within", "OUTSIDE")
            half = r["gap_interval"]
            print(f"  {r['setup']:<14} {verdict:<16} gap {100 * r['gap']:+.3f}%"
                  + (f" +- {100 * half:.3f}" if half is not None else "")
                  + f"  final loss {r['final_loss']:.4f}")
        for w in caught:
            if "compare" in str(w.message):
                print("  warning:", str(w.message)[:300])


if __name__ == "__main__":
    main()
