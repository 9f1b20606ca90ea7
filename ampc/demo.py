"""python -m ampc.demo: a character-level GPT trained on the source of Python's standard
library five ways, side by side, in about three minutes on any machine.

  fp32              fp32 weights, torch.optim.AdamW(fused=True)
  torch.amp         torch.autocast (+ torch.amp.GradScaler for fp16), torch AdamW
  ampc drop-in      ampc.autocast (+ ampc.GradScaler for fp16), ampc.optim.AdamW
  ampc master       ampc.prepare: 16-bit weights, fp32 master weights in ampc.optim.AdamW
  ampc auto         a precision per module chosen by ampc.autoprecision.search on this
                    machine (its search time is counted in its speed), ampc.optim.AdamW

The text is read at run time from the running interpreter's standard library (every
tenth file held out for validation). All runs start from the same weights and see the
same batches (ampc.validate.compare), fp32 also from a second seed for its run-to-run
spread. The model size and step count are chosen from what this machine measures: the
CPU's capability, bf16 against fp32 matmul speed, and the time of a few real steps. The
runs train in lockstep and all stop at the same step when the time budget (--budget,
150 s) is used up, however busy the machine turns out to be.
Output: a table, the validation summary, OUT/demo.{txt,json,png}, OUT/layers.*, and a
sample of text written by the ampc model.
"""
from __future__ import annotations  # "X | None" hints on Python 3.9 too; none evaluated at import

import argparse
import glob
import os
import platform
import string
import sys
import sysconfig
import time

import torch
import torch.nn.functional as F
from torch import nn

import ampc
from ampc import autoprecision, validate
from ampc.validate._compare import DEFAULT_DTYPE, train_one
from ampc.validate._report import NO_MATPLOTLIB, fmt, format_table, write_outputs

__all__ = ["main"]

# ---- the text ----

VOCAB = [c for c in string.printable if c not in "\x0b\x0c"]   # 98 characters
_INDEX = {c: i for i, c in enumerate(VOCAB)}
_SKIP_DIRS = {"test", "tests", "idlelib", "site-packages", "dist-packages", "lib2to3",
              "turtledemo", "__pycache__", "ensurepip", "venv"}


def stdlib_files():
    """The standard library's .py files (top level and one package level down), sorted."""
    lib = sysconfig.get_paths()["stdlib"]
    files = glob.glob(os.path.join(lib, "*.py")) + glob.glob(os.path.join(lib, "*", "*.py"))
    keep = [f for f in files
            if os.path.basename(os.path.dirname(f)) not in _SKIP_DIRS or os.path.dirname(f) == lib]
    return lib, sorted(keep)


def encode(text):
    unknown = _INDEX["?"]
    return torch.tensor([_INDEX.get(c, unknown) for c in text], dtype=torch.uint8)


def decode(ids):
    return "".join(VOCAB[i] for i in ids)


def load_text(max_chars=1_500_000):
    """(train ids, val ids, description): every tenth file goes to validation."""
    lib, files = stdlib_files()
    train, val, n = [], [], 0
    for i, path in enumerate(files):
        try:
            with open(path, encoding="utf-8", errors="replace") as f:
                text = f.read()
        except OSError:
            continue
        (val if i % 10 == 9 else train).append(text)
        n += len(text)
        if n >= max_chars:
            break
    if not train or not val:
        raise SystemExit(f"ampc.demo: found too little Python source in {lib} "
                         f"({len(files)} files); this demo reads the standard library's .py files")
    tr, va = encode("\n".join(train)), encode("\n".join(val))
    return tr, va, f"{len(train) + len(val)} files of {lib} ({len(tr):,} train / {len(va):,} val chars)"


# ---- the model ----

# width, layers, heads, context, batch
SIZES = {"micro": (32, 2, 2, 32, 8), "tiny": (64, 2, 2, 64, 8), "small": (128, 4, 4, 128, 16),
         "medium": (256, 4, 4, 128, 32), "large": (384, 6, 6, 256, 32)}


class Attention(nn.Module):
    def __init__(self, width, heads):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class Block(nn.Module):
    def __init__(self, width, heads):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attn = Attention(width, heads)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(),
                                 nn.Linear(4 * width, width))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class CharGPT(nn.Module):
    def __init__(self, width, layers, heads, context, vocab=len(VOCAB)):
        super().__init__()
        self.context = context
        self.tok = nn.Embedding(vocab, width)
        self.pos = nn.Embedding(context, width)
        self.blocks = nn.Sequential(*[Block(width, heads) for _ in range(layers)])
        self.ln = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)

    def forward(self, idx):
        pos = torch.arange(idx.shape[1], device=idx.device)
        return self.head(self.ln(self.blocks(self.tok(idx) + self.pos(pos))))


def batch_maker(data, context, batch, seed):
    """make_batch(step): ``batch`` random windows of ``data``, the same for a given step."""
    def make_batch(step):
        g = torch.Generator().manual_seed(seed * 1_000_003 + step)
        start = torch.randint(0, len(data) - context - 1, (batch,), generator=g)
        win = torch.stack([data[s:s + context + 1] for s in start.tolist()]).long()
        return win[:, :-1], win[:, 1:]
    return make_batch


@torch.no_grad()
def sample(model, prompt, n, device, temperature=0.8, seed=0, deadline=float("inf")):
    """``n`` characters after ``prompt``, drawn from the model at ``temperature`` (from
    the 80th on, stopping early once ``time.perf_counter()`` passes ``deadline``)."""
    model.eval()
    g = torch.Generator(device=device).manual_seed(seed)
    ids = encode(prompt).long().to(device)[None]
    for i in range(n):
        if i >= 80 and time.perf_counter() > deadline:
            break
        logits = model(ids[:, -model.context:])[0, -1].float()
        nxt = torch.multinomial(F.softmax(logits / temperature, -1), 1, generator=g)
        ids = torch.cat([ids, nxt[None]], 1)
    return decode(ids[0].tolist())


# ---- what this machine can do ----

def cpu_name():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def matmul_speed(dtype, device, seconds=0.4, shape=(1024, 256, 1024)):
    """GFLOP/s of a (m x k) @ (k x n) matmul in ``dtype``, measured for about ``seconds``."""
    m, k, n = shape
    a = torch.randn(m, k, device=device).to(dtype)
    b = torch.randn(k, n, device=device).to(dtype)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    a @ b
    sync()
    reps, t0 = 0, time.perf_counter()
    while True:
        a @ b
        reps += 1
        sync()
        el = time.perf_counter() - t0
        if el > seconds:
            return 2 * m * k * n * reps / el / 1e9


def matmul_flops(size):
    """Multiply-add FLOPs of one training step (forward + backward: 3x forward)."""
    width, layers, heads, context, batch = SIZES[size]
    tokens = context * batch
    per_token = layers * (12 * width * width + 2 * context * width) + width * len(VOCAB)
    return 6 * per_token * tokens


VAL_BATCHES = 4
MIN_STEPS, FLOOR_STEPS = 150, 20      # a larger size must fit MIN_STEPS; never under FLOOR_STEPS
MAX_STEPS = {"cpu": 400, "cuda": 1000}
SAFETY = 1.1          # probes are short: plan for slightly slower steps
AFTER_S = 15.0        # evaluation, the layer report, the picture and the sample
SEARCH_BATCHES = 2
# the search costs about this many fp32 steps and seconds (its per-call overheads), reserved
# when sizing
SEARCH_STEPS, SEARCH_FIXED_S = 30, 3.0


def process_seconds():
    """Seconds since this process started (imports included), 0 where unknown."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return 0.0


def choose(args, speeds, probe, seconds_left, log):
    """(size, steps): the largest size of which at least MIN_STEPS steps of all runs fit
    the time left, and how many steps of it fit (at least FLOOR_STEPS, at most MAX_STEPS).
    ``probe(size)`` gives (seconds of one step of all runs together, seconds the search
    will take)."""
    if args.size != "auto" and args.steps:
        return args.size, args.steps
    sizes = [args.size] if args.size != "auto" else list(SIZES)
    chosen = None
    for size in sizes:
        # a lower bound from the matmul speeds alone: do not even probe a size that cannot fit
        bound = matmul_flops(size) * (2 / speeds["fp32"] + 3 / speeds["low"]) / 1e9
        if chosen and bound * MIN_STEPS > seconds_left():
            break
        per_step, search_s = probe(size)
        per_step *= SAFETY
        # each run also evaluates VAL_BATCHES forward passes (a third of a step each)
        steps = int((seconds_left() - AFTER_S - search_s) / per_step - VAL_BATCHES / 3)
        log(f"  {size:<6} {SIZES[size][0]:>3} wide x {SIZES[size][1]} layers: "
            f"{per_step * 1e3:,.0f} ms per step of all six runs, about {search_s:.0f} s of "
            f"search -> {max(steps, 0)} steps fit")
        if chosen and steps < MIN_STEPS:
            break
        chosen = (size, steps)
        if steps < MIN_STEPS:                 # the smallest probed already does not fit
            break
    size, steps = chosen
    if args.steps:
        return size, args.steps
    if steps < FLOOR_STEPS:
        log(f"  this machine is slow for this job: fewer than {FLOOR_STEPS} steps fit")
    return size, max(FLOOR_STEPS, min(MAX_STEPS[args.device], steps))


def describe_plan(plan, search_s, dname, ratio, log):
    """A few lines on what ampc.autoprecision chose here and why."""
    counts = {}
    for c in plan.choices.values():
        counts[c] = counts.get(c, 0) + 1
    m = plan.data.get("measured") or {}
    log(f"ampc.autoprecision: {len(plan.units)} modules in {search_s:.1f} s: "
        + ", ".join(f"{n} {c}" for c, n in sorted(counts.items()))
        + f"; ops outside them {plan.rest}"
        + (f"; whole model forward + backward {m['plan_ms']:.0f} ms against fp32's "
           f"{m['fp32_ms']:.0f} ms" if m else ""))
    for note in plan.data.get("notes", []):
        log(f"  {note}")
    fp32 = [u for u in plan.units if u["choice"] == "fp32"]
    for reason, match in (("for accuracy", lambda w: " err " in w or "not finite" in w),
                          ("for speed", lambda w: w.startswith("too slow"))):
        kept = [u for u in fp32 if any(match(w) for w in u["rejected"].values())]
        if kept:
            u = kept[0]
            why = "; ".join(f"{c}: {w}" for c, w in u["rejected"].items() if match(w))
            log(f"  kept in fp32 {reason}: {len(kept)} modules, e.g. {u['module']} ({why})")
    if set(plan.choices.values()) == {"fp32"}:
        log(f"  {dname} matmuls run {1 / ratio:.0f}x slower than fp32 here" if ratio < 1 else
            f"  no 16-bit choice measured faster here")
        log("  so the plan keeps every module in fp32: the auto arm trains at fp32's speed "
            "with fp32's accuracy, where the uniform 16-bit arms pay for slow matmuls")


# ---- the job ----

def parse_args(argv):
    p = argparse.ArgumentParser(
        prog="python -m ampc.demo",
        description="A character-level GPT trained on Python's standard library with fp32, "
                    "torch.amp, the ampc drop-in, ampc master weights and a precision per "
                    "module chosen by ampc.autoprecision, side by side.")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                   help="default: cuda when torch sees a GPU, else cpu")
    p.add_argument("--dtype", choices=["auto", "bf16", "fp16"], default="auto",
                   help="16-bit type (default: bf16 on the CPU, fp16 on CUDA)")
    p.add_argument("--steps", type=int, default=0,
                   help="training steps per run (default: as many as fit the budget)")
    p.add_argument("--size", choices=["auto"] + list(SIZES), default="auto",
                   help="model size (default: the largest that fits the budget)")
    p.add_argument("--budget", type=float, default=150.0,
                   help="seconds the whole job should take; model size and steps are chosen "
                        "to fit (default 150)")
    p.add_argument("--out", default="demo-out", help="output folder (default demo-out)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.steps < 0 or 0 < args.steps < 10:
        p.error(f"argument --steps: must be at least 10 (or 0 for automatic), got {args.steps}")
    if not (30 <= args.budget <= 3600):
        p.error(f"argument --budget: must be between 30 and 3600 seconds, got {args.budget:g}")
    if os.path.exists(args.out) and not os.path.isdir(args.out):
        p.error(f"argument --out: {args.out} exists and is not a folder")
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    elif args.device == "cuda" and not torch.cuda.is_available():
        p.error("argument --device: cuda asked for, but torch sees no GPU "
                f"(torch {torch.__version__}, CUDA build: {torch.version.cuda is not None})")
    return args


def main(argv: list[str] | None = None, started: float | None = None) -> int:
    """Runs the demo; ``started`` is the ``time.perf_counter()`` the time budget counts
    from (default: now; from the command line, the start of the process)."""
    t_start = time.perf_counter() if started is None else started
    args = parse_args(argv)
    device = args.device
    dtype = {"auto": DEFAULT_DTYPE[device], "bf16": torch.bfloat16,
             "fp16": torch.float16}[args.dtype]
    dname = {torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]
    lines = []

    def log(text=""):
        print(text, flush=True)
        lines.append(text)

    # ---- machine ----
    cap = torch.backends.cpu.get_cpu_capability()
    speeds = {"fp32": matmul_speed(torch.float32, device), "low": matmul_speed(dtype, device)}
    where = (torch.cuda.get_device_name() if device == "cuda"
             else f"{cpu_name()}, torch CPU capability {cap}, {torch.get_num_threads()} threads")
    log(f"ampc demo | {where} | torch {torch.__version__}")
    ratio = speeds["low"] / speeds["fp32"]
    log(f"matmul: fp32 {speeds['fp32']:,.0f} GFLOP/s, {dname} {speeds['low']:,.0f} GFLOP/s "
        f"({ratio:.2f}x fp32)")
    if ratio < 1:
        log(f"note: {dname} matmuls are {1 / ratio:.0f}x slower than fp32 on this "
            f"{'GPU' if device == 'cuda' else 'CPU (no AVX-512 BF16/AMX units)'}, so mixed "
            "precision cannot be faster here; it still halves the memory of weights and "
            "activations, and on GPUs and AMX/AVX-512-BF16 CPUs its matmuls run several "
            "times faster than fp32.")

    # ---- data ----
    train, val, described = load_text()
    log(f"text: {described}")

    def make_model_for(size):
        width, layers, heads, context, _ = SIZES[size]
        return lambda: CharGPT(width, layers, heads, context)

    lr = 2e-3

    def probe(size):
        """(Seconds of one step of all six runs, seconds of the search), from real steps of
        each kind: the fastest of five after one to warm up (the first steps of a run are slower, and a busy
        machine adds noise that only lengthens steps; the lockstep training stops on
        time if this was too hopeful)."""
        context, batch = SIZES[size][3], SIZES[size][4]
        batches = [tuple(t.to(device) for t in batch_maker(train, context, batch, 99)(k))
                   for k in range(6)]
        t = {}
        for kind in ("fp32", "torch.amp", "ampc", "ampc.master"):
            run = train_one(kind, dtype, make_model_for(size), batches, lr=lr, device=device)
            t[kind] = min(run.step_ms[1:]) / 1e3
        # ampc auto: about the drop-in's step (its modules at fp32 or 16 bits, each the faster)
        return (2 * t["fp32"] + t["torch.amp"] + 2 * t["ampc"] + t["ampc.master"],
                SEARCH_FIXED_S + SEARCH_STEPS * t["fp32"])

    log(f"sizing for {args.budget:.0f} s in all:")
    size, fit = choose(args, speeds, probe,
                       lambda: args.budget - (time.perf_counter() - t_start), log)
    # without --steps the runs go on until the time is up (at most MAX_STEPS)
    steps = args.steps or MAX_STEPS[device]
    width, layers, heads, context, batch = SIZES[size]
    make_model = make_model_for(size)
    n_params = sum(p.numel() for p in make_model().parameters())
    log(f"model: {size}, {n_params / 1e6:.2f}M params ({layers} layers, width {width}, "
        f"context {context}), batch {batch}, AdamW lr {lr:g}, {dname} on {device}; "
        + (f"{steps} steps" if args.steps else
           f"as many steps as the time allows (about {fit} by the probe, at most {steps})"))

    # ---- the plan: a precision per module, measured here ----
    t_search = time.perf_counter()
    found = batch_maker(train, context, batch, args.seed + 2)
    plan = autoprecision.search(make_model().to(device),
                                [tuple(t.to(device) for t in found(k)) for k in range(SEARCH_BATCHES)],
                                repeats=1)
    search_s = time.perf_counter() - t_search
    describe_plan(plan, search_s, dname, ratio, log)

    # ---- train ----
    make_batch = batch_maker(train, context, batch, args.seed)
    val_batches = [batch_maker(val, context, batch, args.seed + 1)(k)
                   for k in range(VAL_BATCHES)]
    # lockstep: a busy machine slows every run alike, and all stop at the same step when
    # the time is up (with --steps given, they run to the end)
    t_train = time.perf_counter()
    limit = (float("inf") if args.steps
             else args.budget - (time.perf_counter() - t_start) - AFTER_S)
    report = validate.compare(make_model, make_batch, steps=steps, dtype=dtype, device=device,
                              lr=lr, seeds=(args.seed, args.seed + 1), val_batches=val_batches,
                              time_limit=limit, setups=validate.SETUPS + (plan,))
    train_s = time.perf_counter() - t_train
    if report.config["steps"] < steps:
        log(f"all runs stopped after {report.config['steps']} steps, to finish in "
            f"{args.budget:.0f} s")
        steps = report.config["steps"]

    # ---- results ----
    label = {"fp32": "fp32", "torch.amp": "torch.amp", "ampc": "ampc drop-in",
             "ampc.master": "ampc master weights", "ampc.auto": "ampc auto"}
    runs = [report.base] + report.runs
    amp = next(r for r in report.runs if r.kind == "torch.amp")
    tokens = context * batch
    rows, table = [], []
    for r in runs:
        # the auto arm pays for its search: spread over the steps it trained
        ms = r.median_ms() + (1e3 * search_s / steps if r.kind == "ampc.auto" else 0.0)
        tps = tokens / (ms / 1e3)
        row = {"setup": label[r.kind] + ("" if r.kind == "fp32" else f" {r.dtype}"),
               "tokens_per_s": tps, "step_ms": ms, "peak_mib": r.peak_mib,
               "train_loss": sum(r.losses[-report.window:]) / report.window,
               "val_loss": r.val_loss,
               "speed_vs_torch_amp": tps / (tokens / (amp.median_ms() / 1e3)),
               "memory_vs_torch_amp": (r.peak_mib / amp.peak_mib
                                       if r.peak_mib and amp.peak_mib else None)}
        rows.append(row)
        table.append([row["setup"], f"{tps:,.0f}", f"{row['step_ms']:.1f}",
                      fmt(r.peak_mib, ".1f"), f"{row['train_loss']:.4f}", fmt(r.val_loss),
                      f"{row['speed_vs_torch_amp']:.2f}x", fmt(row["memory_vs_torch_amp"], ".2f")])
    log()
    log(f"{steps} steps x {tokens:,} tokens per run, {train_s:.0f} s of training")
    log(format_table(["setup", "tokens/s", "step ms", "peak MiB", "train loss", "val loss",
                      "speed vs torch.amp", "memory vs torch.amp"], table))
    log("step ms: median of forward + backward + optimizer step (ampc auto: plus its "
        f"{search_s:.1f} s of search over the {steps} steps); peak MiB: memory the run "
        "added at its peak (" + ("torch.cuda.max_memory_allocated" if device == "cuda"
                                 else "resident set") + "); train loss: mean of the last "
        f"{report.window} steps")

    log()
    log("validation against fp32 (ampc.validate.compare):")
    log(report.table())
    # one step from the trained fp32 weights, module by module
    layer_report = validate.layers(report.base.model, make_batch(steps), dtype=dtype)
    log()
    log(layer_report.table(top=8))

    # the master weights, exported to a plain fp32 model: sampling runs at fp32 speed
    master = next(r for r in report.runs if r.kind == "ampc.master")
    exported = make_model().to(device)
    exported.load_state_dict(ampc.fp32_state_dict(master.model, master.optimizer))
    text = sample(exported, "def ", 300, device, seed=args.seed,
                  deadline=t_start + args.budget - 4)
    log()
    log("sample from the ampc master-weight model, exported with ampc.fp32_state_dict "
        "(prompt 'def '):")
    log(text)

    data = {"config": {"device": device, "dtype": dname, "size": size, "params": n_params,
                       "steps": steps, "batch": batch, "context": context, "lr": lr,
                       "seed": args.seed, "cpu_capability": cap, "cpu": cpu_name(),
                       "matmul_gflops": speeds, "torch": torch.__version__,
                       "text": described},
            "table": rows, "compare": report.as_dict(), "layers": layer_report.as_dict(),
            "plan": plan.as_dict(), "search_s": search_s, "sample": text}
    throughput = {row["setup"]: row["tokens_per_s"] for row in rows}
    paths = write_outputs(args.out, "demo", "\n".join(lines), data,
                          lambda plt, path: report.plot(plt, path, throughput))
    layer_paths = layer_report.save(args.out)
    plan.save(os.path.join(args.out, "plan.json"))
    with open(os.path.join(args.out, "plan.txt"), "w") as f:
        f.write(plan.table() + "\n\n" + plan.python() + "\n")
    log()
    if paths["png"]:
        log(f"picture: {os.path.abspath(paths['png'])} (loss curves, gap to fp32, "
            "grad-norm ratio, throughput)")
    else:
        log(NO_MATPLOTLIB)
    log(f"wrote {paths['txt']}, {paths['json']}, {layer_paths['txt']}, {layer_paths['json']}, "
        f"{os.path.join(args.out, 'plan.txt')}, {os.path.join(args.out, 'plan.json')}"
        + (f", {layer_paths['png']}" if layer_paths["png"] else ""))
    log(f"done in {time.perf_counter() - t_start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main(started=time.perf_counter() - process_seconds()))   # imports count too
