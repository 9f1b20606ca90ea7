"""Does an ampc.autoprecision plan train inside fp32's seed-to-seed spread, on runs long enough that
fp32's seeds agree? search() then Plan.verify() on five models.

    python benchmarks/bench_plan_verify.py [--models resnet18,bncnn,bert,gpt2,gpt2text] [--steps N]
        [--seeds 3] [--objectives memory,time] [--candidates fp32,bf16] [--lr LR] [--monitor] [--quick]
        [--peak 0.5] [--setups torch.amp] [--out FILE] [--json]
    python benchmarks/bench_plan_verify.py --models llama,vit,convnext --peak 0.5 --setups ''
        (three models no test uses, at batches where activations dominate, under a byte budget)

Models and their tasks (synthetic and learnable; fresh batches every step, nothing to memorize; 40% of
the classifiers' labels replaced at random, so that the loss falls to a floor well above zero, where
relative loss gaps stay meaningful and a calibrated model, not an overconfident one, is best):
  resnet18  torchvision's ResNet-18 (10 classes), batch 16 of 16x16 images: each class a fixed random
            8x8 pattern drawn at a random place, at 3 to 6 times the standard deviation of the Gaussian
            noise it lies on (floor 1.44); lr 1e-3
  bncnn     the tests' BatchNorm CNN (three conv + BatchNorm + ReLU + pool blocks, a Linear head) on the
            same image task; lr 3e-3
  bert      transformers' BertForSequenceClassification from a fresh small BertConfig (4 classes, 2 layers,
            width 128, vocab 512, dropout 0), batch 16 of 32 tokens: a class draws a third of its tokens
            from its own 16 topic tokens, the rest uniformly (floor 0.94); lr 1e-3
  gpt2      transformers' GPT2LMHeadModel from a fresh small GPT2Config (2 layers, width 128, vocab 256,
            dropout 0), batch 16 of 32 tokens: each sequence steps through the vocabulary by a stride of 1
            to 4 from a random start, 15% of the tokens replaced at random; lr 3e-3
  gpt2text  the same GPT2LMHeadModel on real text: the demo's (ampc.demo) characters of Python's standard
            library and its vocabulary of 98, batch 16 of 64 characters (the demo's batch_maker); lr 2e-3
  llama     transformers' LlamaForCausalLM from a fresh config (2 layers, width 128, 4 heads, 2 KV heads,
            vocab 256) on the gpt2 task at 128 tokens; lr 3e-3
  vit       torchvision's VisionTransformer (32x32 images, patches of 4, 4 layers, width 128) on the
            image task at 32x32; lr 1e-3
  convnext  torchvision's ConvNeXt (three stages of two blocks, widths 32-128) on the image task at
            32x32; lr 1e-3
With --peak F the search has a byte budget of F times the fp32 step's peak (torch's AdamW, measured by
ampc.memory.report) and measures the step with ampc's AdamW; the summary gives the state chosen, the
plan's peak over fp32's and whether the budget was met.
For each model and objective: ``search`` (the objective's own default candidates, the memory objective's
with saved activations in 8 bits, unless --candidates says; repeats 1) on two batches the training does
not see, then ``plan.verify``: fp32 from each of --seeds seeds (its run-to-run spread),
torch.amp bf16 and the plan from the same seeds' weights (paired), on the same batches, AdamW at the model's rate.

Reported per model: modules per precision; the whole plan's gradient error at search time against fp32's
batch-to-batch spread of the gradients (plan.data["measured"]; the plan may use half of it); each setup's
final loss gap to fp32 seed 0; validate's verdict (its gap to fp32 of the same seed over the last quarter
of the run, with a 95% interval over the seeds, against fp32's spread: the largest such gap between fp32
seed 0 and another seed; over 5% the spread is too wide for one); the final loss against the mean of the
fp32 seeds in units of their range (max - min of their final losses); the largest smoothed gap between
fp32's seeds over the second half of the run, had it stopped at a quarter, half and three quarters of its
steps (a wider measure than validate's spread); the times. The raw output (plans, validate's tables) goes to --out.
"""
import contextlib
import copy
import functools
import io
import json
import os
import statistics
import threading
import time
import warnings

import torch
from torch import nn

import _harness as H

ampc = H.import_ampc()
from ampc.autoprecision import search  # noqa: E402  (after the harness finds ampc)
from ampc.validate._report import MAX_SPREAD, verdict_word  # noqa: E402
from ampc.validate._run import rel_gap, smooth  # noqa: E402

CLASSES, BATCH, LABEL_NOISE = 10, 16, 0.4
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def relabel(y, classes, g):
    """``y`` with a fraction LABEL_NOISE of its labels replaced by random ones: a loss floor."""
    swap = torch.rand(y.shape, generator=g) < LABEL_NOISE
    return torch.where(swap, torch.randint(0, classes, y.shape, generator=g), y)


def pattern_task(hw, contrast=1.0):
    """make_batch(step) of the image task at ``hw`` x ``hw``: the patterns at ``contrast`` to
    twice that, over noise of standard deviation 1."""
    patterns = torch.randn(CLASSES, 3, 8, 8, generator=torch.Generator().manual_seed(1234))

    def make_batch(step):
        g = torch.Generator().manual_seed(1000 + step)
        y = torch.randint(0, CLASSES, (BATCH,), generator=g)
        x = torch.randn(BATCH, 3, hw, hw, generator=g)
        pos = torch.randint(0, hw - 7, (BATCH, 2), generator=g)
        scale = contrast * (1 + torch.rand(BATCH, generator=g))
        for i in range(BATCH):
            r, c = pos[i].tolist()
            x[i, :, r:r + 8, c:c + 8] += scale[i] * patterns[y[i]]
        return x, relabel(y, CLASSES, g)
    return make_batch


def bn_cnn():
    """The tests' BatchNorm CNN as one Sequential: three conv, batch norm, ReLU, pool blocks, then the
    spatial mean and a Linear head."""
    widths = (3, 16, 32, 64)
    blocks = [m for c_in, c_out in zip(widths, widths[1:])
              for m in (nn.Conv2d(c_in, c_out, 3, padding=1), nn.BatchNorm2d(c_out), nn.ReLU(),
                        nn.MaxPool2d(2))]
    return nn.Sequential(*blocks, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, CLASSES))


def resnet18():
    import torchvision
    return torchvision.models.resnet18(num_classes=CLASSES)


TOKENS, SEQ, TOPIC, LABELS = 512, 32, 16, 4


def bert():
    import transformers
    cfg = transformers.BertConfig(vocab_size=TOKENS, hidden_size=128, num_hidden_layers=2,
                                  num_attention_heads=2, intermediate_size=512,
                                  max_position_embeddings=SEQ, num_labels=LABELS,
                                  hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return transformers.BertForSequenceClassification(cfg)


def topic_task():
    """make_batch(step) of the sequence task: a third of a sequence's tokens from its class's topic."""
    topics = torch.randperm(TOKENS, generator=torch.Generator().manual_seed(1234))[:LABELS * TOPIC]
    topics = topics.view(LABELS, TOPIC)

    def make_batch(step):
        g = torch.Generator().manual_seed(1000 + step)
        y = torch.randint(0, LABELS, (BATCH,), generator=g)
        ids = torch.randint(0, TOKENS, (BATCH, SEQ), generator=g)
        on_topic = topics[y.unsqueeze(1), torch.randint(0, TOPIC, (BATCH, SEQ), generator=g)]
        ids = torch.where(torch.rand(BATCH, SEQ, generator=g) < 1 / 3, on_topic, ids)
        return ids, relabel(y, LABELS, g)
    return make_batch


VOCAB = 256


def gpt2(vocab=VOCAB, seq=SEQ):
    import transformers
    cfg = transformers.GPT2Config(vocab_size=vocab, n_positions=seq, n_embd=128, n_layer=2, n_head=2,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                  bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(cfg)


def stride_task(seq=SEQ):
    """make_batch(step) of the LM task: start + k * stride (mod VOCAB), 15% of tokens random."""
    def make_batch(step):
        g = torch.Generator().manual_seed(1000 + step)
        start = torch.randint(0, VOCAB, (BATCH, 1), generator=g)
        stride = torch.randint(1, 5, (BATCH, 1), generator=g)
        ids = (start + stride * torch.arange(seq + 1)) % VOCAB
        ids = torch.where(torch.rand(ids.shape, generator=g) < 0.15,
                          torch.randint(0, VOCAB, ids.shape, generator=g), ids)
        return ids[:, :-1], ids[:, 1:]
    return make_batch


CONTEXT = 64


def gpt2text():
    from ampc.demo._text import CHARS
    return gpt2(len(CHARS), CONTEXT)


@functools.cache
def text_batches():
    """make_batch(step) of the demo's text: random windows of its training characters."""
    from ampc.demo._model import batch_maker
    from ampc.demo._text import CHARS, load_text
    return batch_maker(load_text(vocab_size=len(CHARS))[0], CONTEXT, BATCH, seed=0)


def gpt2_units():
    from transformers.pytorch_utils import Conv1D
    return (Conv1D, nn.Linear, nn.LayerNorm)    # GPT-2's projections are Conv1D (an addmm)


LONG = 128      # the Llama's sequence: activations dominate its step


def llama():
    import transformers
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=LONG, bos_token_id=0, eos_token_id=0,
                                   pad_token_id=0, use_cache=False)
    return transformers.LlamaForCausalLM(cfg)


def vit():
    from torchvision.models.vision_transformer import VisionTransformer
    return VisionTransformer(image_size=32, patch_size=4, num_layers=4, num_heads=4, hidden_dim=128,
                             mlp_dim=256, num_classes=CLASSES)


def convnext():
    from torchvision.models.convnext import CNBlockConfig, ConvNeXt
    return ConvNeXt([CNBlockConfig(32, 64, 2), CNBlockConfig(64, 128, 2), CNBlockConfig(128, None, 2)],
                    num_classes=CLASSES)


# name: (make_model, make_batch, units (None: search's default), lr, steps, quick steps)
IMAGES = pattern_task(16, 3.0)
IMAGES_32 = pattern_task(32, 3.0)
MODELS = {
    "resnet18": (resnet18, IMAGES, lambda: None, 1e-3, 1600, 16),
    "bncnn": (bn_cnn, IMAGES, lambda: None, 3e-3, 2000, 24),
    "bert": (bert, topic_task(), lambda: None, 1e-3, 800, 24),
    "gpt2": (gpt2, stride_task(), gpt2_units, 3e-3, 800, 24),
    "gpt2text": (gpt2text, lambda step: text_batches()(step), gpt2_units, 2e-3, 800, 24),
    # where activations dominate the step (for --peak): models no test uses
    "llama": (llama, stride_task(LONG), lambda: None, 3e-3, 300, 24),
    "vit": (vit, IMAGES_32, lambda: None, 1e-3, 300, 24),
    "convnext": (convnext, IMAGES_32, lambda: None, 1e-3, 300, 24),
}


class LoadWatch:
    """The 1-minute load average, sampled every few seconds while a run goes on."""

    def __init__(self, every=5.0):
        self.samples, self.every = [], every
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._watch, daemon=True)

    def _watch(self):
        while not self.stop.is_set():
            self.samples.append(os.getloadavg()[0])
            self.stop.wait(self.every)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()

    def summary(self):
        return f"{statistics.mean(self.samples):.2f} (max {max(self.samples):.2f})"


def spread_at(report, steps):
    """fp32's seed spread as validate would have measured it on the first ``steps`` steps."""
    window = max(1, steps // 10)
    ref = smooth(report.base.losses[:steps], window)
    return max(max(rel_gap(smooth(r.losses[:steps], window), ref)[steps // 2:])
               for r in report.spread_runs)


def against_mean(report, row):
    """(gap to the mean of the fp32 seeds' final smoothed losses, in units of their range)."""
    finals = [smooth(r.losses, report.window)[-1] for r in [report.base] + report.spread_runs]
    mean = statistics.mean(finals)
    return (row["final_loss"] - mean) / (max(finals) - min(finals))


def monitored(report):
    """'spikes, raised' of the plan's runs under --monitor (their monitor records), or '-'."""
    runs = [r for r in report.runs + [r for p in report.paired_runs for r in p] if r.monitor]
    if not runs:
        return "-"
    spikes = sum(len(r.monitor["spikes"]) for r in runs)
    raised = sum(len(r.monitor["decisions"]) for r in runs)
    return f"{spikes} spikes, {raised} raised over {len(runs)} runs"


def fp32_peak(model, batch):
    """The peak of one fp32 step with torch's AdamW (ampc.memory.report), bytes."""
    work = copy.deepcopy(model)
    return ampc.memory.report(work, torch.optim.AdamW(work.parameters()), batch).peak


def one(name, objective, steps, seeds, candidates, out, monitor=None, lr=None, peak=None,
        setups=("torch.amp",)):
    """search then verify on one model; the summary rows, the raw tables printed to ``out``.
    ``peak``: a byte budget for the step, that fraction of fp32's (``peak_bytes``)."""
    make_model, make_batch, units, own_lr, _, _ = MODELS[name]
    lr = lr or own_lr
    torch.manual_seed(0)
    model = make_model()
    batches = [make_batch(10_000 + k) for k in range(2)]       # not among the training batches
    fp32 = fp32_peak(model, batches[0]) if peak else None
    with LoadWatch() as load:
        t0 = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")           # a budget not met is in the table
            plan = search(model, batches, candidates=candidates, objective=objective, repeats=1,
                          units=units(), peak_bytes=int(peak * fp32) if peak else None,
                          optimizer=ampc.optim.AdamW if peak else torch.optim.AdamW)
        search_s = time.perf_counter() - t0
        out(f"\n== {name}, objective {objective}, candidates {', '.join(plan.data['candidates'])}: "
            f"{steps} steps, fp32 seeds {list(range(seeds))}, lr {lr:g}, "
            f"{sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters ==")
        out(plan.table())               # before the long part: what is being trained
        t0 = time.perf_counter()
        report = plan.verify(make_model, make_batch, steps, seeds=tuple(range(seeds)), lr=lr,
                             progress=False, monitor=monitor, setups=setups)
        verify_s = time.perf_counter() - t0
    out(report.table())
    m = plan.data["measured"]
    counts = {}
    for c in plan.choices.values():
        counts[c] = counts.get(c, 0) + 1
    base = report.base.losses
    early = {f"spread@{k}/4": spread_at(report, steps * k // 4) for k in (1, 2, 3)}
    rows = []
    for r in report.rows:
        verdict = verdict_word(r, "within", "OUTSIDE")
        rows.append({
            "model": name, "objective": objective, "setup": r["setup"],
            "modules": ", ".join(f"{n} {c}" for c, n in sorted(counts.items())),
            **({"state": plan.step.state, "peak x fp32": plan.peak.bytes / fp32,
                "met": plan.peak.met} if peak else {}),
            "grad err": m["grad_err"], "grad noise": m.get("grad_noise"),
            "fp32 loss first-last": f"{statistics.mean(base[:10]):.3f}-{smooth(base, report.window)[-1]:.3f}",
            "fp32 spread %": 100 * report.spread, **{k: 100 * v for k, v in early.items()},
            "gap %": 100 * r["final_gap"], "verdict": verdict,
            "gap/range": against_mean(report, r),
            "step ms": r["step_ms"], "fp32 ms": report.base.median_ms(),
            "monitor": monitored(report) if r["setup"] in ("ampc auto", "ampc memory") else "-",
            "search s": search_s, "verify s": verify_s, "load": load.summary()})
    return rows


def main():
    p = H.common_args(__doc__)
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--steps", type=int, default=0, help="training steps (0: each model's own)")
    p.add_argument("--seeds", type=int, default=3, help="fp32 seeds (at least 2: the spread)")
    p.add_argument("--objectives", default="memory", help="search objectives: memory, time")
    p.add_argument("--candidates", default=None,
                   help="search candidates, comma-separated (default: the objective's own)")
    p.add_argument("--quick", action="store_true", help="a smoke check: few steps, 2 seeds")
    p.add_argument("--peak", type=float, default=None,
                   help="a byte budget for the step's peak, this fraction of fp32's (peak_bytes; "
                        "the step measured with ampc's AdamW)")
    p.add_argument("--setups", default="torch.amp",
                   help="validate setups beside fp32 and the plan, comma-separated ('' for none)")
    p.add_argument("--lr", type=float, default=None, help="AdamW's rate (default: each model's own)")
    p.add_argument("--monitor", action="store_true",
                   help="train the plan's runs with its Monitor on (default arguments): its spikes "
                        "and raises go under the tables and in the summary's monitor column")
    p.add_argument("--out", default=None, help="file for the raw output (default: benchmarks/results/"
                                                  "plan_verify_*.txt; none with --quick)")
    args = H.parse(p)
    if args.seeds < 2:
        p.error("--seeds must be at least 2: fp32's spread needs two")
    seeds = 2 if args.quick else args.seeds
    lines = []

    def out(text):
        print(text, flush=True)
        lines.append(text)
    hdr = H.machine("cpu")
    out(" | ".join(f"{k} {v}" for k, v in hdr.items()))
    rows = []
    for name in args.models.split(","):
        steps = args.steps or MODELS[name][5 if args.quick else 4]
        for objective in args.objectives.split(","):
            rows += one(name, objective, steps, seeds,
                        args.candidates and args.candidates.split(","), out,
                        {} if args.monitor else None, args.lr, args.peak,
                        tuple(x for x in args.setups.split(",") if x))
    notes = [f"verdict: validate's, from the gap to fp32 of the same seed over the last quarter (95% "
             f"interval over the seeds) against fp32's spread (over {100 * MAX_SPREAD:g}%: too wide to judge); "
             "gap %: the final gap to fp32 seed 0; gap/range: to the fp32 seeds' mean, in units of their "
             "range; spread@k/4: the largest smoothed gap between fp32's seeds over the second half of the "
             "first k quarters", "grad err, grad noise: the whole plan at search time against "
             "fp32 and fp32's batch-to-batch spread (the plan may use half of it)",
             "load: the 1-minute load average over search and verify, mean (max)"]
    if args.json:
        print(json.dumps({"header": hdr, "rows": rows, "notes": notes}, indent=1))
    else:
        table = io.StringIO()
        with contextlib.redirect_stdout(table):
            H.report(hdr, rows, False, notes)
        out("\n== summary ==\n" + table.getvalue().rstrip())
    path = args.out or (None if args.quick else os.path.join(
        RESULTS, f"plan_verify_{'_'.join(args.models.split(','))}_{seeds}seeds.txt"))
    if path:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
