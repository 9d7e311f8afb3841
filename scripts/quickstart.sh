#!/usr/bin/env bash
# Set up .venv (if needed) and run the main job on the embedded default:
#   1. the NOSA core demo on a tiny Llama built from a config (python -m nosa.demo, ~10 s);
#   2. the tiny fine-tune, dense -> NOSA (python -m nosa.train --config configs/train/tiny.yaml);
#   3. serve the result with SGLang's "nosa" attention backend and offloading on, ask it held-out
#      questions through the OpenAI API and print the answers and the server's offloading counters
#      (scripts/serve_ask.py).
#
#   bash scripts/quickstart.sh [--skip-done] [training overrides key=value ...]
#
# --skip-done: skip a step whose output already exists (the fine-tune when runs/tiny/nosa is there).
# QUICKSTART_DEMO_ONLY=1 stops after step 1. Other arguments go to the training command.
set -euo pipefail
cd "$(dirname "$0")/.."
SKIP_DONE=0
if [[ "${1:-}" == "--skip-done" ]]; then
    SKIP_DONE=1
    shift
fi
if ! .venv/bin/python -c "import nosa, transformers, deepspeed" 2>/dev/null; then
    bash scripts/setup.sh
fi
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
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
