"""One plan for the whole step against torch.compile's own memory solver, side by side in one run, on the
GPT-2-shaped model of bench_lean_memory.py (16.9M, width 512, 4 layers, vocab 8,192), bf16 compute:

- torch.amp: torch.autocast(bf16), torch.optim.AdamW(fused=True) (the baseline of every ratio);
- torch.compile: the same model through torch.compile, and with torch._functorch.config's
  activation_memory_budget at 0.5 and 0.2 (its min-cut solver chooses what to recompute under that budget);
- ampc plan: ampc.autoprecision.search(model, batches, loss, objective="memory", peak_bytes=F x torch.amp's
  peak), then model, opt = plan.prepare(fresh model, ampc.optim.AdamW, lr=1e-3), trained in plan.autocast()
  with plan.loss(loss): the state, freed gradients, precisions, saved activations, recompute and the sliced
  head all as the plan chose;
- ampc plan, no budget: the memory objective's default (search(objective="memory"), then plan.prepare).

    python benchmarks/bench_plan_memory.py [--sizes 16x256,4x128] [--fractions 0.30,0.35] [--reps 5]
                                           [--width 512] [--layers 4] [--vocab 8192] [--no-compile]
                                           [--search-only]

--fractions: one per size, the budget as a fraction of torch.amp's peak. --search-only: the budgeted search
alone, its time and plan (what the search costs), nothing else run. --reps 0: the peaks alone. Peak: ampc.memory.report (live tensors
at the step's start plus the profiler's running maximum over a step, after a warm-up step that compiles).
Time: the whole training step, reps interleaved across the arms (each timed rep after an untimed one), the
ratio to torch.amp's step taken within each round, median and quartiles over the rounds; the 1-minute load
average is printed with it.
"""
import argparse
import contextlib
import os
import statistics
import time
import types
import warnings

import torch

import _harness as H

ampc = H.import_ampc()
import ampc.autoprecision  # noqa: E402
import ampc.memory  # noqa: E402
from bench_peak_budget import batches, fresh, lm_loss  # noqa: E402

MiB = float(1 << 20)


class Region(torch.nn.Module):
    """A model run inside a region (the report calls a module)."""

    def __init__(self, model, region):
        super().__init__()
        self.model, self.region = model, region

    def forward(self, *args, **kwargs):
        with self.region():
            return self.model(*args, **kwargs)


def amp_region():
    return torch.autocast("cpu", dtype=torch.bfloat16)


def compiled_alone(model, tag):
    """torch.compile of ``model`` under a code object of its own. Dynamo keeps its compiled
    graphs on the code object it compiled, and modules of one class share theirs: a second
    compiled model of the same class ran the first one's graph, made under the first one's
    activation_memory_budget (every budget measured the same peak)."""
    def forward(*args, **kwargs):
        return model(*args, **kwargs)
    code = forward.__code__.replace(co_name=f"forward_budget_{tag}".replace(".", "_"))
    return Compiled(model, torch.compile(types.FunctionType(code, forward.__globals__,
                                                            closure=forward.__closure__)))


class Compiled(torch.nn.Module):
    """The model (its parameters seen by the optimizer and the memory report) run through a
    compiled function."""

    def __init__(self, model, fn):
        super().__init__()
        self.model, self.fn = model, fn

    def forward(self, *args, **kwargs):
        return self.fn(*args, **kwargs)


def torch_arm(args, compile_budget=None, compiled=False):
    model = fresh(args)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    if compiled:
        model = compiled_alone(model, compile_budget)
    patch = (torch._functorch.config.patch(activation_memory_budget=compile_budget)
             if compile_budget is not None else contextlib.nullcontext())
    return Region(model, amp_region), opt, lm_loss, patch


def plan_arm(args, plan):
    model, opt = plan.prepare(fresh(args), ampc.optim.AdamW, lr=1e-3)
    return Region(model, plan.autocast), opt, plan.loss(lm_loss), contextlib.nullcontext(), plan


def stepper(arm, batch):
    model, opt, loss_fn, patch, *plan = arm
    inputs, y = batch
    scaler = plan[0].scaler() if plan else None     # where a module runs fp16

    def step():
        opt.zero_grad(set_to_none=True)
        if plan:          # the plan's backward: its micro-batches, where it split the batch
            plan[0].backward(model.model, opt, batch, lm_loss, scaler=scaler)
        else:
            with patch:   # the compile budget is read when the graph compiles (the first step)
                loss_fn(model(**inputs), y).backward()
        H.optimizer_step(opt, scaler)
    return step


def peak(arm, batch):
    model, opt, loss_fn, patch, *plan = arm
    with patch:
        return ampc.memory.report(model, opt, batch, loss_fn,
                                  micro_batches=plan[0].step.micro_batches if plan else 1).peak


def search(args, batch_pairs, **kw):
    t0 = time.perf_counter()
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        plan = ampc.autoprecision.search(fresh(args), batch_pairs, lm_loss, objective="memory",
                                         repeats=1, **kw)
    return plan, time.perf_counter() - t0


def describe(name, plan, s, amp_peak):
    d, st = plan.peak, plan.step
    met = "" if d.budget is None else f", budget {d.budget / MiB:.1f} MiB {'met' if d.met else 'NOT met'}"
    print(f"{name}: search {s:.0f} s{met}; the search's step {d.bytes / MiB:.1f} MiB "
          f"({d.bytes / amp_peak:.2f}x torch.amp); {plan!r}; state {st.state} "
          f"({st.bytes_per_param():.2f} B a parameter), grads freed {st.grads_freed}, "
          f"recomputed {list(st.recompute) or 'none'}, sliced {list(st.sliced_head) or 'none'}")
    print("  peak by kind (MiB): " + ", ".join(f"{k} {v / MiB:.1f}" for k, v in d.by_kind.items()))
    for k, v in st.why.items():
        print(f"  {k}: {v}")


def run_size(args, batch, context, fraction):
    args.batch, args.context = batch, context
    one = batches(args, 1, seed=1)[0]
    print(f"\n== batch {batch} x {context}: {sum(p.numel() for p in fresh(args).parameters()) / 1e6:.1f}M params")
    amp_peak = peak(torch_arm(args), one)
    print(f"torch.amp step peak {amp_peak / MiB:.1f} MiB")
    arms = {"torch.amp": torch_arm(args)}
    if not args.no_compile:
        arms["torch.compile"] = torch_arm(args, compiled=True)
        arms["torch.compile, budget 0.5"] = torch_arm(args, 0.5, compiled=True)
        arms["torch.compile, budget 0.2"] = torch_arm(args, 0.2, compiled=True)
    search_batches = batches(args, 2)
    plan, s = search(args, search_batches, peak_bytes=int(fraction * amp_peak),
                     optimizer=lambda ps: ampc.optim.AdamW(ps, lr=1e-3))
    describe(f"ampc plan, budget {fraction:g}x torch.amp", plan, s, amp_peak)
    if args.search_only:
        return
    arms[f"ampc plan {fraction:g}x"] = plan_arm(args, plan)
    default, s = search(args, search_batches, optimizer=lambda ps: ampc.optim.AdamW(ps, lr=1e-3))
    describe("ampc plan, no budget", default, s, amp_peak)
    arms["ampc plan, no budget"] = plan_arm(args, default)
    peaks = {name: peak(arm, one) for name, arm in arms.items()}
    if not args.reps:           # peaks only (exact, not noisy): where a step takes long
        print(f"\n{'arm':<30} {'peak MiB':>9} {'vs amp':>7}")
        for name in arms:
            print(f"{name:<30} {peaks[name] / MiB:9.1f} {peaks[name] / peaks['torch.amp']:6.2f}x")
        return
    timed = [n for n in arms if not (args.peak_only_compile and n.startswith("torch.compile"))]
    fns = {name: stepper(arms[name], one) for name in timed}
    times = H.time_reps(fns, "cpu", reps=args.reps, warm=True)
    load = os.getloadavg()[0]
    print(f"\nstep time: {args.reps} interleaved reps; ratio to torch.amp's step within each round, median "
          f"[q1, q3]; 1-min load {load:.2f} on {os.cpu_count()} CPUs")
    print(f"{'arm':<30} {'peak MiB':>9} {'vs amp':>7} {'step ms':>9} {'vs amp [q1, q3]':>22}")
    for name in arms:
        if name not in times:
            print(f"{name:<30} {peaks[name] / MiB:9.1f} {peaks[name] / peaks['torch.amp']:6.2f}x "
                  f"{'(not timed)':>9}")
            continue
        ratios = [t / a for t, a in zip(times[name], times["torch.amp"])]
        q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
        print(f"{name:<30} {peaks[name] / MiB:9.1f} {peaks[name] / peaks['torch.amp']:6.2f}x "
              f"{statistics.median(times[name]):9.0f} {statistics.median(ratios):8.2f}x "
              f"[{q[0]:.2f}, {q[2]:.2f}]")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="16x256,4x128")
    p.add_argument("--fractions", default="0.30,0.35", help="one budget per size, of torch.amp's peak")
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--reps", type=int, default=5, help="0: the peaks only, no step timed")
    p.add_argument("--no-compile", action="store_true", help="leave out the torch.compile arms")
    p.add_argument("--search-only", action="store_true", help="the budgeted search alone, timed")
    p.add_argument("--peak-only-compile", action="store_true",
                   help="the torch.compile arms' peaks only, their steps not timed")
    args = p.parse_args()
    print(H.machine("cpu"))
    sizes = [tuple(int(v) for v in s.split("x")) for s in args.sizes.split(",")]
    fractions = [float(f) for f in args.fractions.split(",")]
    for (b, t), f in zip(sizes, fractions):
        run_size(args, b, t, f)


if __name__ == "__main__":
    main()
