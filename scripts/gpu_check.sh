#!/usr/bin/env bash
# The GPU check: the serving decode step captured in a CUDA graph and replayed against eager steps,
# the kernel tests on CUDA, then the kernel and recall benchmarks, as JSON and logs.
# Written for the lent H200 (its python3 holds torch, triton, transformers, pytest, hypothesis and
# nvcc 13.0, but nothing can be fetched there): FlashInfer travels as wheels, made here once and slimmed
# to the decode variant's sources so that they and the tree fit the call's 64 MiB (38 of 62 MB):
#   python scripts/flashinfer_wheels.py          # -> .whl/ (git-ignored)
#   run(command="bash scripts/gpu_check.sh", carry=[".whl"], timeout_s=590)   # results land in $OUT
# Without .whl/ ($NOSA_WHEELS) it tries the registry. Elsewhere: OUT=results/gpu bash scripts/gpu_check.sh
# Budget: under 9 minutes on one GPU ($GPU_CHECK_BUDGET_S, default 540 s): every step has its own
# timeout, cut to what is left of the budget (a step that would get under 15 s is skipped, rc 125),
# and a failing step does not stop the others; $GPU_CHECK_ONLY="env tests ..." runs only the steps it
# names (a rerun after a fix; "tune_prefill", the prefill launch sweep, runs only so). $OUT/summary.json
# lists each step's exit status and seconds, and what happened to FlashInfer (install, JIT build of
# the NOSA variant).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-results/gpu}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
unset TRITON_INTERPRET  # real kernels, never the interpreter
PY=${PY:-python3}
STEPS="$OUT/steps.txt"
: > "$STEPS"
BUDGET=${GPU_CHECK_BUDGET_S:-540}
FI_VERSION=0.7.2.post1  # nosa.kernels.flashinfer_decode.FLASHINFER_VERSION

step() {  # step NAME TIMEOUT_S COMMAND...: run, log to $OUT/NAME.log, record rc and seconds
    local name=$1 limit=$2
    shift 2
    local t0=$SECONDS left=$((BUDGET - SECONDS))
    if [[ -n "${GPU_CHECK_ONLY:-}" && " $GPU_CHECK_ONLY " != *" $name "* ]]; then
        echo "$name 126 0" >> "$STEPS"  # not asked for ($GPU_CHECK_ONLY)
        return
    fi
    if (( left < 15 )); then
        echo "[gpu_check] $name: skipped, ${left}s of the budget left"
        echo "$name 125 0" >> "$STEPS"
        return
    fi
    (( limit > left )) && limit=$left
    echo "[gpu_check] $name (limit ${limit}s)"
    timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    echo "$name $rc $((SECONDS - t0))" >> "$STEPS"
    tail -n 5 "$OUT/$name.log"
    echo "[gpu_check] $name: rc=$rc in $((SECONDS - t0)) s"
}

# 1. what we run on: versions, GPU, PCIe link (the recall ceiling)
step env 30 bash -c "$PY - <<'PY'
import torch, triton
print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.version.cuda,
      'available', torch.cuda.is_available())
if torch.cuda.is_available():
    print('gpu', torch.cuda.get_device_name(), 'capability', torch.cuda.get_device_capability())
PY
nvidia-smi --query-gpu=name,driver_version,pcie.link.gen.current,pcie.link.gen.max,pcie.link.width.current,memory.total --format=csv || true"

# 2. nothing to install for the Triton kernels (torch + triton + pytest); report what the optional parts lack
step deps 30 bash -c "$PY -c 'import pytest, hypothesis; print(\"pytest\", pytest.__version__)' ;
  for m in flashinfer sgl_kernel sglang; do $PY -c \"import \$m; print('\$m', getattr(\$m, '__version__', '?'))\" 2>/dev/null || echo \"\$m: not installed (optional)\"; done"

# 3. kernel tests on CUDA: every kernel against its torch reference, GPU-only tests included,
#    plus the ahead-of-time compile for sm_90/sm_80. NOSA_KERNELS stays unset (auto): CUDA tensors
#    take the kernels, and the spec tests that run on CPU tensors keep the reference (forcing
#    triton there would need the interpreter); the dispatch tests set NOSA_KERNELS themselves.
#    First, before anything is installed: the Triton path must not depend on FlashInfer.
step tests 200 env -u NOSA_KERNELS -u NOSA_DECODE_IMPL $PY -m pytest -q -p no:cacheprovider -rs --durations=10 \
    --junitxml "$OUT/gpu_tests.xml" tests/test_kernels.py tests/test_kernels_recall.py tests/test_kernels_slot.py \
    tests/test_kernels_prefill.py tests/test_kernels_dispatch.py \
    tests/test_kernels_flashinfer.py tests/test_kernels_gpu.py tests/test_kernels_aot.py tests/test_kvquant.py

# 4. benchmarks, each a set of ratios measured side by side in one run; kernels_gpu.json's decode
#    rows hold Triton vs FlashInfer vs dense SDPA ("faster": which should be the default)
step bench_recall 90 $PY scripts/bench_recall.py --out "$OUT/recall_gpu.json"
step bench_kernels 150 env -u NOSA_DECODE_IMPL $PY scripts/bench_kernels.py --quick --out "$OUT/kernels_gpu.json"

# 5. the serving backend's decode step (nosa.serve.decode_runner, offloading off and on: state pool,
#    selection, block cache, recall from pinned host memory, attention) captured in a CUDA graph on a
#    batch of padding rows, as SGLang's decode graph runner captures it, then replayed step after step
#    against an eager copy of the same requests (graph_check.json: largest output difference, equal
#    selections, eager vs replay ms). Needs no SGLang. Dry run on CPU: scripts/graph_check.py --device cpu
step graph_check 120 $PY scripts/graph_check.py --device cuda --out "$OUT/graph_check.json"

# 5a. the sparse-aware fine-tune's step on the GPU (configs/train/smollm2-sparse.yaml's NosaConfig,
#    random weights of SmolLM2-135M's shape: the checkpoint does not travel), dense vs NOSA attention in
#    the forward (the Triton prefill kernels, the torch selection), full AdamW steps in bf16 autocast,
#    at the config's 2K rows and at 8K: what a GPU run of the fine-tune would take per step
step train_speed 150 $PY scripts/bench_train.py --config configs/train/smollm2-sparse.yaml --like smollm2-135m \
    --seq-lens 2048 8192 --prefill-context 0 --warmup 2 --steps 5 --out "$OUT/train_gpu.json"

# 5b. optional, only when $GPU_CHECK_ONLY names it (never in the default set: ~4 minutes): the launch
#    sweep of the block-sparse prefill kernels (num_warps x num_stages x query tile at the prefill
#    shape above, each config checked against the default, interleaved with dense SDPA), within
#    $GPU_CHECK_TUNE_BUDGET_S (default 200 s):
#    run(command="GPU_CHECK_ONLY=tune_prefill GPU_CHECK_FLASHINFER=0 bash scripts/gpu_check.sh", timeout_s=330)
if [[ " ${GPU_CHECK_ONLY:-} " == *" tune_prefill "* ]]; then
    step tune_prefill 280 $PY scripts/tune_sparse_prefill.py --budget-s "${GPU_CHECK_TUNE_BUDGET_S:-200}" \
        --out "$OUT/tune_prefill.json"
else
    echo "tune_prefill 126 0" >> "$STEPS"  # not asked for
fi

# FlashInfer last: its install and JIT build are the slowest steps and only decide an option's default.
# GPU_CHECK_FLASHINFER=0 skips it (the wheels are ~60 MiB of the call's 64 MiB carry; without them and
# without a registry pip would only wait on the network).
if [[ "${GPU_CHECK_FLASHINFER:-1}" != 0 ]]; then
# 6. FlashInfer (the NOSA_DECODE_IMPL=flashinfer option): install it, JIT-build the NOSA variant once
#    (nvcc, found through CUDA_HOME or PATH; the benchmark then reuses FlashInfer's JIT cache), and
#    run its GPU test against the reference. Failures land in summary.json ("flashinfer").
if [[ -z "${CUDA_HOME:-}" && -x /usr/local/cuda/bin/nvcc ]]; then
    export CUDA_HOME=/usr/local/cuda  # `which nvcc` may be a symlink outside the toolkit (no lib64 there)
fi
WHEELS=${NOSA_WHEELS:-.whl}
SITE=/tmp/nosa_site  # carried wheels go here, not into the machine's environment
if compgen -G "$WHEELS/*.whl" > /dev/null; then
    step flashinfer_install 120 bash -c "$PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
      --upgrade --target $SITE $WHEELS/*.whl && PYTHONPATH=$SITE $PY -c 'import flashinfer; print(flashinfer.__version__)'"
    export PYTHONPATH=$PYTHONPATH:$SITE
else
    step flashinfer_install 120 bash -c "$PY -c 'import flashinfer' 2>/dev/null && exit 0;
      $PY -m pip install --quiet 'flashinfer-python==$FI_VERSION' && $PY -c 'import flashinfer' && exit 0;
      echo 'full install failed; trying the package without its dependencies';
      $PY -m pip install --quiet --no-deps 'flashinfer-python==$FI_VERSION' apache-tvm-ffi ninja einops tabulate \
        click jinja2 nvidia-ml-py && $PY -c 'import flashinfer; print(flashinfer.__version__)'"
fi
step flashinfer_build 120 $PY scripts/build_flashinfer_variant.py --out "$OUT/flashinfer_build.json"
# the decode benchmark again, now with FlashInfer importable and its module built: Triton vs FlashInfer
# vs dense SDPA on the same inputs, per context ("faster": which should be NOSA_DECODE_IMPL's default)
step bench_flashinfer 90 env -u NOSA_DECODE_IMPL $PY scripts/bench_kernels.py --only decode_slots \
    --out "$OUT/kernels_flashinfer.json"
step flashinfer_tests 60 env -u NOSA_KERNELS -u NOSA_DECODE_IMPL $PY -m pytest -q -p no:cacheprovider -rs \
    --junitxml "$OUT/gpu_tests_flashinfer.xml" tests/test_kernels_gpu.py -k flashinfer
else
    echo "flashinfer_install 126 0" >> "$STEPS"  # not asked for
fi

$PY - "$OUT" <<'PY'
import json, sys, os
out = sys.argv[1]
steps = {}
for line in open(os.path.join(out, "steps.txt")):
    name, rc, seconds = line.split()
    steps[name] = {"rc": int(rc), "seconds": int(seconds)}
summary = {"steps": steps, "ok": all(s["rc"] in (0, 126) for s in steps.values())}  # 126: not asked for
build = os.path.join(out, "flashinfer_build.json")
summary["flashinfer"] = json.load(open(build)) if os.path.exists(build) else "not built (see flashinfer_install.log)"
graphs = os.path.join(out, "graph_check.json")
summary["graph_check"] = json.load(open(graphs)) if os.path.exists(graphs) else "not run (see graph_check.log)"
kernels = os.path.join(out, "kernels_flashinfer.json")
kernels = kernels if os.path.exists(kernels) else os.path.join(out, "kernels_gpu.json")
if os.path.exists(kernels):  # Triton vs FlashInfer per decode row: which should be NOSA_DECODE_IMPL's default
    rows = json.load(open(kernels)).get("decode_slots", [])
    summary["decode_faster"] = [{k: r.get(k) for k in ("context", "batch", "faster", "triton_over_flashinfer",
                                                        "flashinfer")} for r in rows]
tune = os.path.join(out, "tune_prefill.json")
if os.path.exists(tune):  # the prefill launch sweep: the best config per pass, the per-kernel pick
    tuned = json.load(open(tune))
    summary["tune_prefill"] = {k: tuned.get(k) for k in ("best", "recommended", "notes")}
json.dump(summary, open(os.path.join(out, "summary.json"), "w"), indent=1)
print(json.dumps(summary)[:3000])
PY
# The device tool returns at most 8 files from $OUT: the logs, test reports and step times go back as
# one archive beside the JSON files (the default run fills the 8: summary, kernels_gpu, recall_gpu,
# graph_check, train_gpu, flashinfer_build, kernels_flashinfer and the archive; a new step's JSON must
# join one of them or go into the archive).
(cd "$OUT" && tar czf logs.tar.gz --remove-files -- *.log *.xml steps.txt 2>/dev/null)
echo "[gpu_check] done; files in $OUT: $(ls "$OUT" | tr '\n' ' ')"
