"""What this machine can do, and the model size and step count that fit the time budget."""
from __future__ import annotations  # "X | None" hints on Python 3.9 too; none evaluated at import

import os
import time

import torch

from ampc.__main__ import cpu_model
from ampc import validate
from ampc.validate import LEAN_SETUP

from ._model import SIZES, batch_maker, model_maker
from ._text import VOCAB_SIZE

VAL_BATCHES = 4
MIN_STEPS, FLOOR_STEPS = 150, 20      # a larger size must fit MIN_STEPS; never under FLOOR_STEPS
# the smallest size sized automatically: below it activations are too small for the memory
# moves to show and 16-bit compute loses to fp32's on every CPU, so a machine busy while it
# is measured trains this one for fewer steps rather than a smaller model. Not where 16-bit
# matmuls run over SLOW_16 times fp32's (a CPU without AVX-512 BF16): there the 16-bit arms'
# steps are so slow that only a smaller model trains enough steps in the time
FLOOR_SIZE, SLOW_16 = "small", 4.0
MAX_STEPS = {"cpu": 400, "cuda": 1000}
SAFETY = 1.1          # probes are short: plan for slightly slower steps
AFTER_S = 15.0        # evaluation, the layer report, the picture and the sample
# the search costs about this many fp32 steps and seconds (its per-call overheads), reserved
# when sizing; the search for memory measures whole steps' peaks, its blocks recomputed
SEARCH_STEPS, SEARCH_FIXED_S = 30, 3.0
MEMORY_SEARCH_STEPS, MEMORY_SEARCH_FIXED_S = 100, 3.0
MEMORY_ARM = 1.5      # the memory plan's step against the drop-in's (recomputed forwards, codes)


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
    per_token = layers * (12 * width * width + 2 * context * width) + width * VOCAB_SIZE
    return 6 * per_token * tokens


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


def prober(train, device, dtype, lr):
    """probe(size): (seconds of one step of all eight runs, seconds of the two searches,
    fp32's step over torch.amp's: what 16 bits pay at this size), from real
    steps of each kind: the fastest of five after one to warm up (the first steps of a run
    are slower, and a busy machine adds noise that only lengthens steps; the lockstep
    training stops on time if this was too hopeful)."""
    def probe(size):
        context, batch = SIZES[size][3], SIZES[size][4]
        batches = [tuple(t.to(device) for t in batch_maker(train, context, batch, 99)(k))
                   for k in range(6)]
        t = {}
        for kind in ("fp32", "torch.amp", "ampc", "ampc.master", LEAN_SETUP):
            run = validate.train(kind, dtype, model_maker(size), batches, lr=lr, device=device)
            t[kind] = min(run.step_ms[1:]) / 1e3
        # ampc auto: about the drop-in's step (its modules at fp32 or 16 bits, each the faster)
        runs = (2 * t["fp32"] + t["torch.amp"] + (2 + MEMORY_ARM) * t["ampc"]
                + t["ampc.master"] + t[LEAN_SETUP])
        searches = (SEARCH_FIXED_S + MEMORY_SEARCH_FIXED_S
                    + (SEARCH_STEPS + MEMORY_SEARCH_STEPS) * t["fp32"])
        return runs, searches, t["fp32"] / t["torch.amp"]
    return probe


def choose(args, speeds, probe, seconds_left, log):
    """(size, steps): the largest size from FLOOR_SIZE up (see SLOW_16) of which at least MIN_STEPS steps
    of all runs fit the time left, and how many steps of it fit (at least FLOOR_STEPS, at
    most MAX_STEPS).
    ``probe(size)`` gives (seconds of one step of all runs together, seconds the search
    will take, torch.amp's speed against fp32's)."""
    if args.size != "auto" and args.steps:
        return args.size, args.steps
    floor = FLOOR_SIZE if speeds["low"] * SLOW_16 >= speeds["fp32"] else next(iter(SIZES))
    sizes = [args.size] if args.size != "auto" else list(SIZES)[list(SIZES).index(floor):]
    chosen = None
    for size in sizes:
        # a lower bound from the matmul speeds alone: do not even probe a size that cannot fit
        bound = matmul_flops(size) * (2 / speeds["fp32"] + 3 / speeds["low"]) / 1e9
        if chosen and bound * MIN_STEPS > seconds_left():
            break
        per_step, search_s, amp_speed = probe(size)
        per_step *= SAFETY
        # each run also evaluates VAL_BATCHES forward passes (a third of a step each)
        steps = int((seconds_left() - AFTER_S - search_s) / per_step - VAL_BATCHES / 3)
        log(f"  {size:<6} {SIZES[size][0]:>3} wide x {SIZES[size][1]} layers: torch.amp at "
            f"{amp_speed:.2f}x fp32's speed; {per_step * 1e3:,.0f} ms per step of all eight "
            f"runs, about {search_s:.0f} s of search -> {max(steps, 0)} steps fit")
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


def measure_machine(device, dtype, dname, log):
    """{"fp32": GFLOP/s, "low": GFLOP/s of ``dtype``}, said with what the machine is."""
    speeds = {"fp32": matmul_speed(torch.float32, device), "low": matmul_speed(dtype, device)}
    where = (torch.cuda.get_device_name() if device == "cuda"
             else f"{cpu_model()}, torch CPU capability {torch.backends.cpu.get_cpu_capability()}, "
                  f"{torch.get_num_threads()} threads")
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
    return speeds
