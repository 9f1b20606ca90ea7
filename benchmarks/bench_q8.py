"""ampc.ops.encode_q8 / decode_q8 (a saved activation kept in 8 bits, ampc.memory.compress) against torch's
nearest op: a cast to float8_e4m3fn and back.

    python benchmarks/bench_q8.py [--device cpu|cuda] [--cache cold|warm] [--reps N] [--json]

Per case (one tensor of 64M elements, and the activations of a GPT-2-shaped block: 12 tensors of 16 x 256 x
768 and x 3072), in one run, interleaved:
  encode  ampc: codes (1 B an element) and one fp32 scale a block of 256 from fp32 or bf16, one read of the
          input; torch: fp8.copy_(x), a cast to float8_e4m3fn without any scale (it does not find the per-block
          absmax ampc finds: the nearest torch op, less work)
  decode  ampc: the values back to the input's dtype from the codes and scales; torch: out.copy_(fp8)
Both write into outputs allocated once (the ops' own page faults are not the kernels' speed).
torch/ampc > 1: ampc faster. GB/s counts bytes read plus written (encode: the input, the codes and scales;
decode: the codes and scales read, the output written); "% roofline": of torch's copy_ over a large fp32
tensor timed alongside (the same one-read-one-write pattern). Before timing, ampc's round trip is checked:
every value within 1/16 of its own magnitude, or 2^-9 of its block's largest, of the input.
"""
import sys

import torch

import _harness as H

ampc = H.import_ampc()


def cases(device):
    big = [(64 << 20,)]
    block = [(16, 256, 768)] * 8 + [(16, 256, 3072)] * 4
    return [("64M", big), ("GPT-2 block 16x256", block)]


def check(src):
    codes, scales = ampc.ops.encode_q8(src)
    back = ampc.ops.decode_q8(codes, scales, src[0].dtype)
    for x, y, s in zip(src, back, scales):
        err = (x.float() - y.float()).abs().flatten()
        big = s.repeat_interleave(256)[:x.numel()]
        if not bool((err <= torch.maximum(x.float().abs().flatten() / 16, big * 2.0 ** -9)).all()):
            return "a value came back further than the codes' step"
    return ""


def main() -> int:
    p = H.common_args(__doc__)
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    args = H.parse(p)
    dev, dtype = args.device, {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    roof = H.Roofline(args, patterns=("copy",))
    hdr = H.header(args, roof)
    hdr["op"] = f"encode_q8 / decode_q8 of {args.dtype} vs torch's float8_e4m3fn cast and back"
    rows = []
    for case, shapes in cases(dev):
        src = [torch.randn(s, device=dev).to(dtype) for s in shapes]
        err = check(src)
        if err:
            print(f"FAIL: {case}: {err}", file=sys.stderr)
            return 1
        codes, scales = ampc.ops.encode_q8(src)
        out = [torch.empty_like(x) for x in src]
        f8 = [x.to(torch.float8_e4m3fn) for x in src]
        ops = torch.ops.ampc
        fns = {"ampc encode": lambda: ops.encode_q8(codes, scales, src),
               "torch encode": lambda: [f.copy_(x) for f, x in zip(f8, src)],
               "ampc decode": lambda: ops.decode_q8(out, codes, scales),
               "torch decode": lambda: [o.copy_(f) for o, f in zip(out, f8)]}
        ms, roof_gbs = roof.measure(fns, args.reps)
        n = sum(x.numel() for x in src)
        scale_bytes = sum(s.nbytes for s in scales)
        moved = n * dtype.itemsize + n + scale_bytes
        for op in ("encode", "decode"):
            rows.append(H.row(f"{case} {op}", ms[f"ampc {op}"], ms[f"torch {op}"], moved / 1e9, roof_gbs,
                              "copy_", Melems=n / 1e6))
    H.report(hdr, rows, args.json, [
        "torch: the float8_e4m3fn cast by copy_ (no scale, no per-block absmax), the nearest torch op",
        "GB/s: bytes read plus written; % roofline: of torch's copy_ over a large fp32 tensor timed alongside"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
