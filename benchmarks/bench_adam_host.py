"""Host time of a training step's ampc calls on many small params: the per-tensor cost.

    python benchmarks/bench_adam_host.py [--params N] [--reps R] [--json]

What grows with the number of params whatever the size of the work: the Python of
step(), the autograd guard of the ops, the crossing into C and the binding's checks.
Params of 16 elements (CPU), so the kernels' own work is a small part:
- AdamW.step() with found_inf = 1: the kernel returns at once, after the binding has taken
  and checked every tensor (bf16 params with fp32 masters, and fp32 params);
- ops.adam_master with found_inf = 1, the per-tensor (unpacked) call, under no_grad and
  with grad mode on (the guard then checks every tensor for requires_grad);
- ops.unscale_check and ops.cast on the grads (kernels included: 16 elements each);
- GradScaler.unscale_ + update on the optimizer's grads.
Printed per case: the median microseconds of one call and per param.

With --vs-torch: the master-weight step's host cost against torch's, side by side:
ampc.optim.AdamW on one-element bf16 params with fp32 masters against
torch.optim.AdamW(fused=True) on one-element fp32 params (real steps, no found_inf),
interleaved rounds of --steps steps each; printed: the median and quartiles of each
one's microseconds a step and of the ratio torch / ampc, round by round.
"""
import statistics
import time

import torch

import _harness as H

ampc = H.import_ampc()


def median_us(fn, reps):
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e6


def step_case(dtype, n):
    params = [torch.nn.Parameter(torch.randn(16, dtype=dtype)) for _ in range(n)]
    for q in params:
        q.grad = torch.randn_like(q)
    opt = ampc.optim.AdamW(params, lr=1e-3)
    opt.step()                          # the state exists before timing
    opt.grad_scale = torch.ones(1)
    opt.found_inf = torch.ones(1)       # the kernel skips the step after every check
    return opt


def cases(n):
    opt16 = step_case(torch.bfloat16, n)
    opt32 = step_case(torch.float32, n)
    params = [p for g in opt16.param_groups for p in g["params"]]
    grads = [p.grad for p in params]
    lists = dict(params=[p.detach() for p in params], grads=grads, masters=[torch.randn(16) for _ in params],
                 exp_avgs=[torch.zeros(16) for _ in params],
                 exp_avg_sqs=[torch.zeros(16) for _ in params],
                 steps=[torch.zeros(1) for _ in params])
    found_inf = torch.ones(1)

    def adam_master():
        ampc.ops.adam_master(lists["params"], lists["grads"], lists["exp_avgs"],
                             lists["exp_avg_sqs"], lists["steps"], masters=lists["masters"],
                             lr=1e-3, found_inf=found_inf)

    def adam_master_no_grad():
        with torch.no_grad():
            adam_master()

    grads32 = [p.grad for g in opt32.param_groups for p in g["params"]]
    found, inv = torch.zeros(1), torch.ones(1)
    scaler = ampc.GradScaler("cpu", init_scale=1.0)
    scaler.scale(torch.ones(()))        # the scale tensor exists

    def scaler_unscale():
        scaler.unscale_(opt32)
        scaler.update()

    return [
        ("AdamW.step bf16 + fp32 masters", opt16.step),
        ("AdamW.step fp32", opt32.step),
        ("ops.adam_master, no_grad", adam_master_no_grad),
        ("ops.adam_master, grad mode on", adam_master),
        ("ops.unscale_check fp32", lambda: ampc.ops.unscale_check(grads32, found, inv)),
        ("ops.cast fp32 -> bf16", lambda: ampc.ops.cast(grads32, torch.bfloat16)),
        ("GradScaler.unscale_ + update", scaler_unscale),
    ]


def quartiles(xs):
    q = statistics.quantiles(xs, n=4)
    return f"{q[1]:.2f} [{q[0]:.2f}, {q[2]:.2f}]"


def vs_torch(n, rounds, steps):
    def params(dtype):
        ps = [torch.nn.Parameter(torch.randn(1, dtype=dtype)) for _ in range(n)]
        for q in ps:
            q.grad = torch.randn_like(q)
        return ps

    ours = ampc.optim.AdamW(params(torch.bfloat16), lr=1e-3)
    theirs = torch.optim.AdamW(params(torch.float32), lr=1e-3, fused=True)

    def per_step_us(fn):
        t = time.perf_counter()
        for _ in range(steps):
            fn()
        return (time.perf_counter() - t) / steps * 1e6

    for _ in range(3):                  # state made, caches warm
        ours.step()
        theirs.step()
    a, b = [], []
    for r in range(rounds):             # interleaved, the order alternating
        if r % 2:
            b.append(per_step_us(theirs.step))
            a.append(per_step_us(ours.step))
        else:
            a.append(per_step_us(ours.step))
            b.append(per_step_us(theirs.step))
    ratio = [y / x for x, y in zip(a, b)]
    return [{"case": f"AdamW step, {n} one-element params", "ampc us (bf16 + masters)": quartiles(a),
             "torch fused us (fp32)": quartiles(b), "torch / ampc": quartiles(ratio),
             "min ratio": f"{min(ratio):.2f}"}]


def main():
    p = H.common_args(__doc__)
    p.add_argument("--params", type=int, default=1000)
    p.add_argument("--vs-torch", action="store_true",
                   help="only the master-weight step against torch's fused AdamW, side by side")
    p.add_argument("--rounds", type=int, default=15, help="interleaved rounds (--vs-torch)")
    p.add_argument("--steps", type=int, default=50, help="steps a round (--vs-torch)")
    p.set_defaults(reps=200)
    args = H.parse(p)
    hdr = H.machine("cpu")
    if args.vs_torch:
        H.report(hdr, vs_torch(args.params, args.rounds, args.steps), args.json,
                 [f"median [quartiles] of {args.rounds} interleaved rounds of {args.steps} steps"])
        return
    rows = []
    for name, fn in cases(args.params):
        us = median_us(fn, args.reps)
        rows.append({"case": f"{name} x{args.params}", "us/call": us, "us/param": us / args.params})
    H.report(hdr, rows, args.json, ["params of 16 elements; medians of --reps calls"])


if __name__ == "__main__":
    main()
