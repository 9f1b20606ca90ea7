"""python -m ampc.validate MODULE:FACTORY [options]: ampc.validate.compare (and, with
--layers, ampc.validate.layers) from the command line.

MODULE is imported (the current directory is on the path); FACTORY() must return a fresh
fp32 model. The batches come from MODULE:make_batch unless --batch names another
function; make_batch(step) returns (inputs, target).
"""
import argparse
import importlib
import sys

import torch

from . import ALL_SETUPS, DTYPES, SETUPS, compare, layers
from .._outputs import NO_MATPLOTLIB


def _load(spec, what, parser, default_module=None):
    module_name, sep, attr = spec.partition(":")
    if not sep:
        if default_module is None:
            parser.error(f"{what} must be MODULE:NAME, got {spec!r}")
        module_name, attr = default_module, spec
    if not module_name or not attr:
        parser.error(f"{what} must be MODULE:NAME, got {spec!r}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        parser.error(f"{what}: cannot import {module_name!r}: {e}")
    fn = getattr(module, attr, None)
    if not callable(fn):
        parser.error(f"{what}: {module_name} has no callable {attr!r}")
    return fn


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m ampc.validate",
                                description="Mixed precision checked against its fp32 baseline.")
    p.add_argument("model", help="MODULE:FACTORY returning a fresh fp32 nn.Module")
    p.add_argument("--batch", default="make_batch",
                   help="[MODULE:]FUNCTION, make_batch(step) -> (inputs, target) "
                        "(default: make_batch in the model's module)")
    p.add_argument("--loss", help="[MODULE:]FUNCTION, loss(output, target) (default: "
                                  "cross-entropy over the last dimension)")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--setups", default=",".join(SETUPS),
                   help=f"comma-separated, from {', '.join(ALL_SETUPS)}, each optionally @fp16 "
                        f"or @bf16 (default: {','.join(SETUPS)})")
    p.add_argument("--device", choices=["cpu", "cuda"])
    p.add_argument("--dtype", choices=list(DTYPES), help="default: bf16 on CPU, fp16 on CUDA")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seeds", default="0,1", help="comma-separated ints (default 0,1)")
    p.add_argument("--layers", action="store_true", help="also the per-module one-step report")
    p.add_argument("--out", default="validate-out", help="output folder (default validate-out)")
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error(f"--steps must be at least 1, got {args.steps}")
    try:
        seeds = [int(s) for s in args.seeds.split(",")]
    except ValueError:
        p.error(f"--seeds must be comma-separated ints, got {args.seeds!r}")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: torch sees no GPU")
    module_name = args.model.partition(":")[0]
    make_model = _load(args.model, "model", p)
    make_batch = _load(args.batch, "--batch", p, module_name)
    loss_fn = _load(args.loss, "--loss", p, module_name) if args.loss else None
    dtype = DTYPES[args.dtype] if args.dtype else None
    try:
        report = compare(make_model, make_batch, loss_fn, steps=args.steps,
                         setups=[s for s in args.setups.split(",") if s], dtype=dtype,
                         device=args.device, lr=args.lr, seeds=seeds)
    except (TypeError, ValueError) as e:
        p.error(str(e))
    print(report.table())
    _print_paths(report.save(args.out))
    if args.layers:
        torch.manual_seed(seeds[0])
        lr = layers(make_model().to(report.config["device"]), make_batch(0), loss_fn,
                    dtype=dtype)
        print()
        print(lr.table())
        _print_paths(lr.save(args.out))
    return 0 if report.ok() else 1


def _print_paths(paths):
    print("wrote " + ", ".join(v for v in paths.values() if v))
    if paths["png"] is None:
        print(NO_MATPLOTLIB)


if __name__ == "__main__":
    sys.exit(main())
