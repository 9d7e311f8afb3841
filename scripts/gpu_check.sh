#!/usr/bin/env bash
# The GPU check: kernel tests and kernel benchmarks on a CUDA machine, results as JSON and logs.
# Written for the lent H200 (its python3 holds torch, triton, transformers, pytest, hypothesis):
#   run(command="bash scripts/gpu_check.sh", timeout_s=540)   # results land in $OUT
# Elsewhere: OUT=results bash scripts/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-results/gpu}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
PY=${PY:-python3}
$PY - <<'PY' | tee "$OUT/gpu_env.txt"
import torch, triton
print("torch", torch.__version__, "triton", triton.__version__, "cuda", torch.cuda.is_available(),
      torch.cuda.get_device_name() if torch.cuda.is_available() else "-")
PY
# kernels against their references on the GPU, and the spec's tests on the GPU's machine
timeout 240 $PY -m pytest -q -p no:cacheprovider tests/test_kernels.py tests/test_attention.py tests/test_select.py \
    --junitxml "$OUT/gpu_tests.xml" 2>&1 | tee "$OUT/gpu_tests.log"
timeout 240 $PY scripts/bench_kernels.py --out "$OUT/kernels_gpu.json" 2>&1 | tee "$OUT/bench_kernels.log"
echo "[gpu_check] done; files in $OUT"
