#!/usr/bin/env bash
# gpu_check.sh: every check that needs a GPU, in one run on a machine with a CUDA device.
#
# Sets up (the machine's own CUDA torch if it has one, else .venv by scripts/setup.sh) and
# builds ampc, runs the CUDA tests, runs the CUDA benchmarks, and prints a short table
# last: test counts, then one row per benchmark case (ampc ms, torch ms, ratio
# torch/ampc, ampc GB/s, % of the torch op of the same access pattern (roofline), % of the H200's 4.3 TB/s;
# the goal is >= 85% on large lists). Exits non-zero when setup or the build failed, a test
# failed or errored (or left no report), or a benchmark exited non-zero or gave no rows.
# The whole run stays under 8 minutes: each stage gets a capped slice of the budget.
#
# The benchmarks' --json output: {"header": {"copy_gbs", ...}, "rows": [{"case", "ampc ms",
# "torch ms", "torch/ampc", "ampc GB/s", "% roofline", ...}]}.
#
# Usage: bash scripts/gpu_check.sh
set -u
cd "$(dirname "$0")/.."
budget=470                          # seconds for everything, 8 minutes less a margin
peak_gbs=4300                       # H200: 4.8 TB/s HBM3e on paper, 4.3 TB/s the goal's base
start=$(date +%s)
work=$(mktemp -d)
py=.venv/bin/python
failed=0                            # setup or build failed
export PYTHONUNBUFFERED=1

# stage CAP CMD...: runs CMD for at most CAP seconds and never past the overall budget.
stage() {
    local cap=$1
    local left=$((budget - ($(date +%s) - start)))
    shift
    [ "$left" -lt "$cap" ] && cap=$left
    if [ "$cap" -le 5 ]; then
        echo "out of time, skipped: $*" >&2
        return 124
    fi
    timeout --kill-after=5 "$cap" "$@"
}

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || true
# A GPU machine that already has a CUDA torch (>= 2.10) in its python3 uses it as is,
# which also checks the build against one more torch release; otherwise set up .venv.
if python3 -c "import torch, pytest, numpy; assert torch.cuda.is_available()" 2>/dev/null; then
    py=python3
    python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())"
    stage 240 python3 -m pip install -q --no-build-isolation --no-deps -e . ||
        { echo "build failed or timed out (rc $?)"; failed=1; }
else
    stage 240 bash scripts/setup.sh || { echo "setup failed or timed out (rc $?)"; failed=1; }
fi
stage 240 "$py" -m pytest -q -m cuda --tb=short --junitxml="$work/junit.xml" tests/ 2>&1 |
    tail -n 60
benches="cast unscale"
[ -f benchmarks/bench_adam.py ] && benches="$benches adam"
[ -f benchmarks/bench_fp8.py ] && benches="$benches fp8"
[ -f benchmarks/bench_lean.py ] && benches="$benches lean"
for b in $benches; do
    stage 100 "$py" "benchmarks/bench_$b.py" --device cuda --json \
        >"$work/bench_$b.json" 2>"$work/bench_$b.err"
    echo $? >"$work/bench_$b.rc"
    tail -n 5 "$work/bench_$b.err"
done

[ -x "$py" ] || py=python3          # still print the summary when setup failed
"$py" - "$work" "$peak_gbs" $benches <<'EOF'
import json, sys, xml.etree.ElementTree as ET

work, peak = sys.argv[1], float(sys.argv[2])
bad = False
print("\n---- gpu_check summary ----")
try:
    root = ET.parse(f"{work}/junit.xml").getroot()
    s = root if root.tag == "testsuite" else root.find("testsuite")
    n, f, e, sk = (int(s.get(k, 0)) for k in ("tests", "failures", "errors", "skipped"))
    print(f"tests: {n - f - e - sk} passed, {f} failed, {e} errors, {sk} skipped")
    bad |= f + e > 0 or n == sk
except Exception:
    print("tests: no report (setup failed or the run timed out)")
    bad = True

def num(x, fmt):
    return format(x, fmt) if isinstance(x, (int, float)) else "-"

print(f"{'case':44} {'ampc ms':>9} {'torch ms':>9} {'ratio':>6} {'GB/s':>7} {'% roof':>7} "
      f"{'% 4.3TB/s':>9}")
for b in sys.argv[3:]:
    rc = open(f"{work}/bench_{b}.rc").read().strip()
    try:
        data = json.loads(open(f"{work}/bench_{b}.json").read())
    except ValueError:      # crashed or timed out before printing
        data = {}
    rows = data.get("rows", []) if isinstance(data, dict) else []
    if rc != "0" or not rows:
        print(f"bench_{b}: {len(rows)} rows, exit {rc}")
        bad = True
    torch_ms = {r["case"]: r["ms"] for r in rows if r.get("arm") == "torch"}
    for r in rows:
        if "arm" in r:      # bench_lean: a row an arm, each against torch's fused AdamW
            if r["arm"] == "torch":
                continue
            r = {**r, "case": f"{r['case']} {r['arm']}", "ampc ms": r["ms"],
                 "torch ms": torch_ms.get(r["case"]), "torch/ampc": r["torch/arm"],
                 "ampc GB/s": r["GB/s"]}
        case = f"{b}: {r.get('case')}"
        gbs = r.get("ampc GB/s")
        of_peak = 100 * gbs / peak if isinstance(gbs, (int, float)) else None
        print(f"{case[:44]:44} {num(r.get('ampc ms'), '9.4f')} {num(r.get('torch ms'), '9.4f')} "
              f"{num(r.get('torch/ampc'), '6.2f')} {num(gbs, '7.0f')} "
              f"{num(r.get('% roofline'), '7.1f')} {num(of_peak, '9.1f')}")
        if "ampc TFLOPS" in r:      # an FP8 GEMM: compute-bound, measured against its peak
            print(f"{'':44} {r['ampc TFLOPS']:.0f} TFLOPS, {r['% of 1979 peak']:.1f}% of the "
                  f"H200's dense FP8 peak; _scaled_mm {r['_scaled_mm TFLOPS']:.0f}, "
                  f"bf16 matmul {r['bf16 matmul TFLOPS']:.0f}")
sys.exit(1 if bad else 0)
EOF
summary=$?
if [ "$failed" -ne 0 ] || [ "$summary" -ne 0 ]; then
    echo "gpu_check: FAILED (setup or build: $failed, tests or benchmarks: $summary)"
    exit 1
fi
echo "gpu_check: ok"
