#!/usr/bin/env bash
# Set up .venv (if needed) and run the main job on the embedded default:
#   1. the NOSA core demo on a tiny Llama built from a config (python -m nosa.demo, ~10 s);
#   2. the tiny fine-tune, dense -> NOSA (python -m nosa.train --config configs/train/tiny.yaml);
#   3. the command that serves the result with SGLang's "nosa" attention backend.
# QUICKSTART_DEMO_ONLY=1 stops after step 1. Extra arguments go to the training command.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! .venv/bin/python -c "import nosa, transformers, deepspeed" 2>/dev/null; then
    bash scripts/setup.sh
fi
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
echo "== 1/3 NOSA core demo"
.venv/bin/python -m nosa.demo
[ "${QUICKSTART_DEMO_ONLY:-0}" = 1 ] && exit 0
echo "== 2/3 fine-tune a tiny Llama into NOSA (configs/train/tiny.yaml)"
.venv/bin/python -m nosa.train --config configs/train/tiny.yaml "$@"
echo "== 3/3 serve it:"
echo "   scripts/serve.sh runs/tiny/nosa --dtype float32 --max-total-tokens 65536"
