"""The demo from the command line to the files it writes: size, search, train, report, write."""
from __future__ import annotations  # "X | None" hints on Python 3.9 too; none evaluated at import

import argparse
import os
import time
import warnings
from dataclasses import dataclass

import torch

import ampc
from ampc import autoprecision, memory, validate
from ampc.__main__ import cpu_model
from ampc.validate import DEFAULT_DTYPE, LEAN_SETUP, torch_adamw

from ._model import SIZES, batch_maker, model_maker, sample
from ._report import (describe_memory_plan, describe_plan, result_rows, results_table,
                      search_payback, write_all)
from ._sizing import AFTER_S, MAX_STEPS, VAL_BATCHES, choose, measure_machine, prober
from ._text import load_text

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
DNAMES = {dtype: name for name, dtype in DTYPES.items()}
LR = 2e-3
SEARCH_BATCHES = 2
MEMORY_BUDGET = 0.5     # the memory arm asks for a step's peak at this fraction of torch.amp's


def parse_args(argv):
    p = argparse.ArgumentParser(
        prog="python -m ampc.demo",
        description="A small GPT trained on Python's standard library with fp32, "
                    "torch.amp, the ampc drop-in, ampc master weights, a precision per "
                    "module chosen by ampc.autoprecision for speed and one for memory, and "
                    "the lean state (state=\"lean\"), side by side.")
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
    args.dtype = DEFAULT_DTYPE[args.device] if args.dtype == "auto" else DTYPES[args.dtype]
    return args


class Log:
    """Prints a line and keeps it for OUT/demo.txt."""

    def __init__(self):
        self.lines = []

    def __call__(self, text=""):
        print(text, flush=True)
        self.lines.append(text)


@dataclass
class Job:
    """What every run shares, decided by the sizing."""
    device: str
    dtype: torch.dtype
    size: str
    steps: int          # the most steps a run takes (without --steps: until the time is up)
    on_time: bool       # True: all runs stop together when the time is up
    budget: float       # seconds for the whole job (--budget)
    deadline: float     # the time.perf_counter() by which the whole job should be done
    seed: int

    @property
    def dname(self):
        return DNAMES[self.dtype]

    @property
    def context(self):
        return SIZES[self.size][3]

    @property
    def batch(self):
        return SIZES[self.size][4]

    def batches(self, data, seed):
        return batch_maker(data, self.context, self.batch, seed)


def size_job(args, speeds, train, deadline, log):
    """The largest model and the steps that fit the time left, from real steps of each run."""
    log(f"sizing for {args.budget:.0f} s in all:")
    size, fit = choose(args, speeds, prober(train, args.device, args.dtype, LR),
                       lambda: deadline - time.perf_counter(), log)
    job = Job(args.device, args.dtype, size, args.steps or MAX_STEPS[args.device],
              not args.steps, args.budget, deadline, args.seed)
    width, layers, heads, context, batch = SIZES[size]
    n_params = sum(p.numel() for p in model_maker(size)().parameters())
    log(f"model: {size}, {n_params / 1e6:.2f}M params ({layers} layers, width {width}, "
        f"context {context}), batch {batch}, AdamW lr {LR:g}, {job.dname} on {job.device}; "
        + (f"as many steps as the time allows (about {fit} by the probe, at most {job.steps})"
           if job.on_time else f"{job.steps} steps"))
    return job, n_params


def search_plan(job, train, ratio, log):
    """ampc.autoprecision's plan for this model on this machine, and its seconds."""
    t0 = time.perf_counter()
    found = job.batches(train, job.seed + 2)
    plan = autoprecision.search(
        model_maker(job.size)().to(job.device),
        [tuple(t.to(job.device) for t in found(k)) for k in range(SEARCH_BATCHES)], repeats=1)
    search_s = time.perf_counter() - t0
    describe_plan(plan, search_s, job.dname, ratio, log)
    return plan, search_s


def search_memory_plan(job, train, log):
    """ampc.autoprecision's plan for memory: a step's peak asked at MEMORY_BUDGET of
    torch.amp's (both measured from the live tensors of a step, with torch's AdamW as the
    torch.amp arm trains); the plan and its seconds."""
    t0 = time.perf_counter()
    found = job.batches(train, job.seed + 2)
    batches = [tuple(t.to(job.device) for t in found(k)) for k in range(SEARCH_BATCHES)]
    model = model_maker(job.size)().to(job.device)
    amp = memory.report(model, torch_adamw(model.parameters(), LR), batches[0],
                        autocast=job.dtype)
    amp_peak = amp.peak
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")     # a budget not met is said from the plan's notes
        plan = autoprecision.search(
            model_maker(job.size)().to(job.device), batches, objective="memory",
            peak_bytes=int(MEMORY_BUDGET * amp_peak), repeats=1,
            optimizer=lambda params: torch_adamw(params, LR))
    search_s = time.perf_counter() - t0
    describe_memory_plan(plan, amp_peak, MEMORY_BUDGET, search_s, log)
    # the two steps' peaks by kind, for the picture
    by_kind = {f"torch.amp {job.dname}": amp.by_kind(),
               f"ampc memory {plan.dtype}": dict(plan.peak.by_kind)}   # as the table names it
    return plan, search_s, by_kind


def train_runs(job, plans, train, val, log):
    """The seven runs and fp32's second seed in lockstep (ampc.validate.compare): a busy
    machine slows every run alike, and all stop at the same step when the time is up."""
    t0 = time.perf_counter()
    limit = job.deadline - t0 - AFTER_S if job.on_time else float("inf")
    report = validate.compare(
        model_maker(job.size), job.batches(train, job.seed), steps=job.steps, dtype=job.dtype,
        device=job.device, lr=LR, seeds=(job.seed, job.seed + 1),
        val_batches=[job.batches(val, job.seed + 1)(k) for k in range(VAL_BATCHES)],
        time_limit=limit, setups=validate.SETUPS + tuple(plans) + (LEAN_SETUP,),
        paired=False)       # its seven setups from one seed: the time budget goes to steps
    if report.config["steps"] < job.steps:
        log(f"all runs stopped after {report.config['steps']} steps, to finish in "
            f"{job.budget:.0f} s")
    return report, time.perf_counter() - t0


def report_results(job, report, train, plan, search_s, train_s, log):
    """The table of runs, the validation against fp32, and one step module by module from
    the trained fp32 weights; (rows of the table, the layer report)."""
    steps = report.config["steps"]
    tokens = job.context * job.batch
    rows = result_rows(report, tokens)
    payback_line, payback = search_payback(rows, search_s, steps,
                                           set(plan.choices.values()) == {"fp32"})
    log()
    log(f"{steps} steps x {tokens:,} tokens per run, {train_s:.0f} s of training")
    log(results_table(rows))
    log(payback_line)
    log("step ms: median of forward + backward + optimizer step; peak MiB: memory the run "
        "added at its peak over its first steps (live tensors: " + (
            "torch.cuda.max_memory_allocated" if job.device == "cuda"
            else "the allocations torch's profiler records") + "); state B/param: weights, grads "
        "and optimizer state a parameter after the last step (ampc.lean_state.state_bytes); "
        "ampc memory: the plan searched for memory (above); "
        "ampc lean: state=\"lean\", 8-bit moments and no master; train loss: mean of the last "
        f"{report.window} steps")
    log()
    log("validation against fp32 (ampc.validate.compare):")
    log(report.table())
    layer_report = validate.layers(report.base.model, job.batches(train, job.seed)(steps),
                                   dtype=job.dtype)
    log()
    log(layer_report.table(top=8))
    return rows, payback, layer_report


def sample_text(job, report, vocab, log):
    """Text from the master weights exported to a plain fp32 model (it samples at fp32
    speed), stopping early when the time is nearly up."""
    master = next(r for r in report.runs if r.kind == "ampc.master")
    exported = model_maker(job.size)().to(job.device)
    exported.load_state_dict(ampc.fp32_state_dict(master.model, master.optimizer))
    text = sample(exported, vocab, "def ", 120, job.device, seed=job.seed,
                  deadline=job.deadline - 4)
    log()
    log("sample from the ampc master-weight model, exported with ampc.fp32_state_dict "
        "(prompt 'def '):")
    log(text)
    return text


def job_config(job, steps, n_params, speeds, described):
    """The config section of OUT/demo.json."""
    return {"device": job.device, "dtype": job.dname, "size": job.size, "params": n_params,
            "steps": steps, "batch": job.batch, "context": job.context, "lr": LR,
            "seed": job.seed, "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "cpu": cpu_model(), "matmul_gflops": speeds, "torch": torch.__version__,
            "text": described}


def main(argv: list[str] | None = None, started: float | None = None) -> int:
    """Runs the demo; ``started`` is the ``time.perf_counter()`` the time budget counts
    from (default: now; from the command line, the start of the process)."""
    t_start = time.perf_counter() if started is None else started
    args = parse_args(argv)
    log = Log()
    speeds = measure_machine(args.device, args.dtype, DNAMES[args.dtype], log)
    train, val, vocab, described = load_text()
    log(f"text: {described}")

    job, n_params = size_job(args, speeds, train, t_start + args.budget, log)
    plan, search_s = search_plan(job, train, speeds["low"] / speeds["fp32"], log)
    memory_plan, memory_search_s, by_kind = search_memory_plan(job, train, log)
    report, train_s = train_runs(job, (plan, memory_plan), train, val, log)
    rows, payback, layer_report = report_results(job, report, train, plan, search_s, train_s, log)
    text = sample_text(job, report, vocab, log)

    data = {"config": job_config(job, report.config["steps"], n_params, speeds, described),
            "table": rows, "compare": report.as_dict(), "layers": layer_report.as_dict(),
            "plan": plan.as_dict(), "search_s": search_s,
            "memory_plan": memory_plan.as_dict(), "memory_search_s": memory_search_s,
            "search_payback_steps": payback, "sample": text, "peak_by_kind": by_kind}
    write_all(args.out, log.lines, data, report, layer_report,
              {"plan": plan, "memory_plan": memory_plan}, log)
    log(f"done in {time.perf_counter() - t_start:.0f} s")
    return 0
