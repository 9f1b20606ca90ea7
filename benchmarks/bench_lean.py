"""ampc's lean AdamW step (8-bit moments, bf16 weights without masters) vs torch's fused AdamW and ampc's
master-weight step.

    python benchmarks/bench_lean.py [--device cpu|cuda] [--cache cold|warm] [--threads N] [--reps N] [--json]
                                    [--anchors DIR] [--clock wall|cpu]

One optimizer step, timed with the optimizers' own step() (Python included), in one run, interleaved:
  lean     ampc.optim.AdamW(state="lean") on bf16 params: 8-bit moments, stochastic rounding, no master
  kahan    ampc.optim.AdamW(moments="8bit", kahan_summation=True) on bf16 params: a bf16 compensation
  master   ampc.optim.AdamW on bf16 params with fp32 master weights (today's master-weight step)
  torch    torch.optim.AdamW(fused=True) on fp32 params
and, with --anchors DIR (or AMPC_BENCH_ANCHORS=DIR; a folder with the anchors in it, e.g. from
`pip install --no-deps --target DIR torchao torch-optimi bitsandbytes flashoptim`, so that they cannot
replace the torch in use):
  torchao  torchao.optim.AdamW8bit(bf16_stochastic_round=True) on bf16 params: 8-bit moments, the lean preset's
           layout (its step goes through torch.compile: the first step of each case compiles)
  optimi   optimi.AdamW(kahan_sum=True) on bf16 params: moments in the params' dtype, as optimi keeps them, and a bf16
           Kahan compensation
  bnb      bitsandbytes.optim.AdamW8bit on bf16 params: block-wise 8-bit moments, the weights in bf16
  flashoptim  flashoptim.FlashAdamW on bf16 params (its defaults: 8-bit moments and a 24-bit master split
           over the param and a byte of correction; its quantization needs CUDA, so it is left out on the CPU)
An anchor that does not import or does not run here is left out with a line saying why.
Workloads: one tensor of 1M, 10M and 100M params (2-d, 1024 columns), and 1,000 small 2-d tensors of 1k-16k
elements (64 columns; those under 4,096 elements keep fp32 moments, as the lean options do by default).
Per arm: median ms and the spread of the interleaved reps (the 25th and 75th percentiles), torch ms / arm
ms (> 1: faster than torch), bytes moved a parameter (counted from the tensors: the grad read, the param
written, and read too without a master, every state tensor read and written), GB/s from those bytes and
its fraction of the roofline: torch's in-place mul_ over a large fp32 tensor timed alongside, the same
access pattern. --clock cpu times the calling thread's CPU time (time.thread_time) with one thread instead of
the wall clock: on a shared machine other processes move it less (they still share the core's caches and
memory bus), and it is the figure to compare loops by; with one thread the roofline is one core's. Before
timing, the lean arm is checked: a step with lr = 0 and weight decay 0 leaves the
bf16 params unchanged, and its moments decode to within the 8-bit codes' step of torch's.
"""
import os
import statistics
import sys
import time

import torch

import _harness as H

ampc = H.import_ampc()
from ampc.lean_state import decode_moments  # noqa: E402

bf16 = torch.bfloat16


def shapes_of(case):
    if case == "1000 small":
        rows = torch.randint(16, 257, (1000,), generator=torch.Generator().manual_seed(0)).tolist()
        return [(r, 64) for r in rows]
    return [(round(int(case.rstrip("M")) * 1e6 / 1024), 1024)]      # "10M": 10 million, 1024 a row


def params_of(shapes, dtype, dev):
    params = [torch.nn.Parameter(t) for t in H.randn_list(shapes, dtype, dev)]
    for p, g in zip(params, H.randn_list(shapes, dtype, dev)):
        p.grad = g.mul_(0.01)
    return params


ARMS = {
    "lean": (bf16, dict(state="lean")),
    "kahan": (bf16, dict(moments="8bit", kahan_summation=True)),
    "master": (bf16, dict()),
}


ANCHORS = {
    "torchao": lambda params: __import__("torchao.optim", fromlist=["AdamW8bit"]).AdamW8bit(
        params, lr=1e-3, bf16_stochastic_round=True),
    "optimi": lambda params: __import__("optimi").AdamW(params, lr=1e-3, kahan_sum=True),
    "bnb": lambda params: __import__("bitsandbytes").optim.AdamW8bit(params, lr=1e-3),
    "flashoptim": lambda params: __import__("flashoptim").FlashAdamW(params, lr=1e-3),
}


def anchors_from(folder, dev) -> list:
    """The anchors that import and take a step here, from `folder` (searched after everything else, so
    that it cannot shadow torch); a line on stderr for each that does not."""
    if not folder:
        return []
    sys.path.append(folder)
    ok = []
    for name, build in ANCHORS.items():
        try:
            params = params_of([(64, 1024)], bf16, dev)
            build(params).step()
            ok.append(name)
        except Exception as e:      # an anchor's own failure, whatever it is, leaves it out
            print(f"anchor {name}: left out, it does not run here: {type(e).__name__}: "
                  f"{str(e).splitlines()[0] if str(e) else ''}"[:300], file=sys.stderr)
    return ok


def make(arm, shapes, dev):
    if arm == "torch":
        params = params_of(shapes, torch.float32, dev)
        return params, torch.optim.AdamW(params, lr=1e-3, fused=True)
    if arm in ANCHORS:
        params = params_of(shapes, bf16, dev)
        return params, ANCHORS[arm](params)
    dtype, kw = ARMS[arm]
    params = params_of(shapes, dtype, dev)
    return params, ampc.optim.AdamW(params, lr=1e-3, **kw)


def nbytes(t) -> int:
    """A tensor's bytes; a tensor subclass (torchao's 8-bit state) counts the tensors it is made of."""
    if hasattr(t, "__tensor_flatten__"):
        names, _ = t.__tensor_flatten__()
        return sum(nbytes(getattr(t, n)) for n in names)
    return t.nbytes


def bytes_moved(params, opt) -> int:
    """Bytes read plus written by one step, from the tensors there are (state created by a step)."""
    total = 0
    for p in params:
        state = opt.state[p]
        total += p.grad.nbytes + p.nbytes * (1 if "master" in state else 2)
        total += 2 * sum(nbytes(t) for k, t in state.items()
                         if k != "step" and isinstance(t, torch.Tensor))
    return total


def validate(dev) -> str:
    shapes = [(64, 1024), (3, 1000), (100,)]
    params = params_of(shapes, bf16, dev)
    before = [p.detach().clone() for p in params]
    opt = ampc.optim.AdamW(params, lr=0.0, weight_decay=0.0, state="lean")
    ref = params_of(shapes, torch.float32, dev)
    for r, p in zip(ref, params):
        r.grad = p.grad.float()
    topt = torch.optim.AdamW(ref, lr=0.0, weight_decay=0.0)
    opt.step()
    topt.step()
    for i, (p, b) in enumerate(zip(params, before)):
        if not H.same(p.detach(), b):
            return f"param {i} moved with lr = 0"
        m, v = decode_moments(opt.state[p])
        tm, tv = topt.state[ref[i]]["exp_avg"], topt.state[ref[i]]["exp_avg_sq"]
        if not torch.allclose(m, tm, rtol=2 ** -4, atol=float(tm.abs().max()) * 2 ** -8):
            return f"exp_avg {i} is not torch's to within the codes' step"
        # sqrt(v) within a whole code step: its code rounds stochastically
        if not torch.allclose(v.sqrt(), tv.sqrt(), rtol=2 ** -4, atol=float(tv.sqrt().max()) * 2 ** -9):
            return f"exp_avg_sq {i} is not torch's to within the codes' step"
    return ""


def cpu_reps(fns: dict, reps: int) -> dict:
    """Every rep of each fn in {name: fn}, in ms of this thread's CPU time, interleaved, each after an
    untimed read of 512 MiB (cold caches), as H.time_reps does with the wall clock."""
    buf = torch.ones(512 << 20, dtype=torch.uint8)
    for fn in fns.values():     # warm-up round
        fn()
    times = {name: [] for name in fns}
    for _ in range(reps or 11):
        for name, fn in fns.items():
            buf.max()
            t = time.thread_time()
            fn()
            times[name].append((time.thread_time() - t) * 1e3)
    return times


def quartiles(ts):
    q = statistics.quantiles(ts, n=4)
    return q[0], q[2]


def main() -> int:
    p = H.common_args(__doc__)
    p.add_argument("--cases", default="1M,10M,100M,1000 small")
    p.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                   help="wall clock, or the calling thread's CPU time with one thread (see above)")
    p.add_argument("--anchors", default=os.environ.get("AMPC_BENCH_ANCHORS", ""),
                   help="a folder holding torchao and torch-optimi: time them too")
    args = H.parse(p)
    dev = args.device
    cpu_clock = args.clock == "cpu"
    if cpu_clock:
        if dev != "cpu":
            p.error("--clock cpu times the CPU")
        torch.set_num_threads(1)
        args.peak_gbs = args.peak_gbs or 1.0    # the Roofline object only labels; mul_ is timed below
    err = validate(dev)
    if err:
        print(f"FAIL: {err}", file=sys.stderr)
        return 1
    print("the lean step leaves params put at lr = 0 and its moments decode to torch's", file=sys.stderr)
    roof = H.Roofline(args, patterns=("mul_",))
    hdr = H.header(args, roof)
    hdr["op"] = "AdamW step: lean (8-bit moments) vs master weights vs torch fused fp32"
    hdr["clock"] = "this thread's CPU time, 1 thread" if cpu_clock else "wall"
    if cpu_clock:
        hdr["roofline_source"] = "measured alongside each case, CPU time of one thread"
        roof_dst = torch.zeros(H.GiB // 8)
    rows = []
    arms = ["lean", "kahan", "master", "torch"] + anchors_from(args.anchors, dev)
    for case in args.cases.split(","):
        shapes = shapes_of(case)
        made = {a: make(a, shapes, dev) for a in arms}
        for params, opt in made.values():       # state exists from here on
            opt.step()
        steps = {a: o.step for a, (_, o) in made.items()}
        if cpu_clock:
            reps = cpu_reps({**steps, "roofline": lambda: roof_dst.mul_(1.0)}, args.reps)
            ms = {a: statistics.median(t) for a, t in reps.items()}
            roof_gbs = 2 * roof_dst.nbytes / ms.pop("roofline") / 1e6
        else:
            ms, roof_gbs = roof.measure(steps, args.reps)
            reps = roof.reps
        numel = sum(t.numel() for t in made["lean"][0])
        for a in arms:
            params, opt = made[a]
            moved = bytes_moved(params, opt)
            q1, q3 = quartiles(reps[a])
            r1, r3 = quartiles([t / x for t, x in zip(reps["torch"], reps[a])])    # rep by rep
            gbs = moved / ms[a] / 1e6
            rows.append({"case": case, "arm": a, "ms": ms[a], "q1 ms": q1, "q3 ms": q3,
                         "torch/arm": ms["torch"] / ms[a], "ratio q1": r1, "ratio q3": r3,
                         "B/param moved": moved / numel,
                         "GB/s": gbs, "% roofline": 100 * gbs / roof_gbs, "roofline GB/s": roof_gbs,
                         "tensors": len(params), "Mparams": numel / 1e6, "reps": len(reps[a])})
        del made
    H.report(hdr, rows, args.json, [
        "lean: ampc.optim.AdamW(state='lean'); kahan: moments='8bit', kahan_summation=True; master: "
        "ampc.optim.AdamW with fp32 masters; torch: torch.optim.AdamW(fused=True) on fp32 params; torchao: "
        "AdamW8bit(bf16_stochastic_round=True), optimi: AdamW(kahan_sum=True), bnb: AdamW8bit, "
        "flashoptim: FlashAdamW, all on bf16 params",
        "q1/q3: quartiles of the interleaved reps; ratio q1/q3: quartiles of torch's time over the arm's, "
        "rep by rep (each pair taken one after the other); B/param moved counted from the tensors (grad read, param "
        "written and, without a master, read; state read and written); roofline: in-place mul_ over 512 MiB"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
