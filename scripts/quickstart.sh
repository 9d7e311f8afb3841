#!/usr/bin/env bash
# Set up .venv (if needed) and run the main job on the embedded default: the NOSA core demo on a
# tiny Llama built from a config (dense vs NOSA outputs, selected blocks and churn per decode step).
# Usage: bash scripts/quickstart.sh [demo args, see: .venv/bin/python -m nosa.demo --help]
set -euo pipefail
cd "$(dirname "$0")/.."
if ! .venv/bin/python -c "import nosa, transformers" 2>/dev/null; then
    bash scripts/setup.sh
fi
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
exec .venv/bin/python -m nosa.demo "$@"
