#!/usr/bin/env bash
# The GPU check: the kernel tests on CUDA, then the kernel and recall benchmarks, as JSON and logs.
# Written for the lent H200 (its python3 holds torch, triton, transformers, pytest, hypothesis):
#   run(command="bash scripts/gpu_check.sh", timeout_s=540)   # results land in $OUT
# Elsewhere: OUT=results/gpu bash scripts/gpu_check.sh
# Budget: under 8 minutes on one GPU; every step has its own timeout and a failing step does not
# stop the others. $OUT/summary.json lists each step's exit status and seconds.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-results/gpu}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
unset TRITON_INTERPRET  # real kernels, never the interpreter
PY=${PY:-python3}
STEPS="$OUT/steps.txt"
: > "$STEPS"

step() {  # step NAME TIMEOUT_S COMMAND...: run, log to $OUT/NAME.log, record rc and seconds
    local name=$1 limit=$2
    shift 2
    local t0=$SECONDS
    echo "[gpu_check] $name (limit ${limit}s)"
    timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    echo "$name $rc $((SECONDS - t0))" >> "$STEPS"
    tail -n 5 "$OUT/$name.log"
    echo "[gpu_check] $name: rc=$rc in $((SECONDS - t0)) s"
}

# 1. what we run on: versions, GPU, PCIe link (the recall ceiling)
step env 60 bash -c "$PY - <<'PY'
import torch, triton
print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.version.cuda,
      'available', torch.cuda.is_available())
if torch.cuda.is_available():
    print('gpu', torch.cuda.get_device_name(), 'capability', torch.cuda.get_device_capability())
PY
nvidia-smi --query-gpu=name,driver_version,pcie.link.gen.current,pcie.link.gen.max,pcie.link.width.current,memory.total --format=csv || true"

# 2. nothing to install for the kernels (torch + triton + pytest); report what the optional parts lack
step deps 60 bash -c "$PY -c 'import pytest, hypothesis; print(\"pytest\", pytest.__version__)' ;
  for m in flashinfer sgl_kernel sglang; do $PY -c \"import \$m; print('\$m', getattr(\$m, '__version__', '?'))\" 2>/dev/null || echo \"\$m: not installed (optional; not needed by the kernel tests or benchmarks)\"; done"

# 3. kernel tests on CUDA: every kernel against its torch reference, GPU-only tests included,
#    plus the ahead-of-time compile for sm_90/sm_80. NOSA_KERNELS stays unset (auto): CUDA tensors
#    take the kernels, and the spec tests that run on CPU tensors keep the reference (forcing
#    triton there would need the interpreter); the dispatch tests set NOSA_KERNELS themselves.
step tests 240 env -u NOSA_KERNELS $PY -m pytest -q -p no:cacheprovider --durations=10 --junitxml "$OUT/gpu_tests.xml" \
    tests/test_kernels.py tests/test_kernels_recall.py tests/test_kernels_slot.py tests/test_kernels_prefill.py \
    tests/test_kernels_dispatch.py tests/test_kernels_scores.py tests/test_kernels_gpu.py tests/test_kernels_aot.py

# 4. benchmarks, each a set of ratios measured side by side in one run
step bench_recall 120 $PY scripts/bench_recall.py --out "$OUT/recall_gpu.json"
step bench_kernels 200 $PY scripts/bench_kernels.py --quick --out "$OUT/kernels_gpu.json"

$PY - "$OUT" <<'PY'
import json, sys, os
out = sys.argv[1]
steps = {}
for line in open(os.path.join(out, "steps.txt")):
    name, rc, seconds = line.split()
    steps[name] = {"rc": int(rc), "seconds": int(seconds)}
json.dump({"steps": steps, "ok": all(s["rc"] == 0 for s in steps.values())}, open(os.path.join(out, "summary.json"), "w"), indent=1)
print(json.dumps(steps))
PY
echo "[gpu_check] done; files in $OUT"
