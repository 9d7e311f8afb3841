#!/usr/bin/env bash
# Serve a NOSA (or dense) checkpoint with SGLang's "nosa" attention backend.
#
#   scripts/serve.sh CKPT [extra sglang.launch_server flags...]
#
# DEVICE=cpu (default when no CUDA device is visible) sets SGLANG_USE_CPU_ENGINE=1, which SGLang
# reads at import time; HOST/PORT default to 127.0.0.1:30000; PY defaults to .venv/bin/python.
# A dense checkpoint takes its NosaConfig from NOSA_CONFIG (JSON text or a JSON file) or defaults.
set -euo pipefail

if [[ $# -lt 1 ]]; then
    echo "usage: $0 CKPT [sglang.launch_server flags...]" >&2
    exit 2
fi
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PY:-$ROOT/.venv/bin/python}"
[[ -x "$PY" ]] || PY=python
CKPT="$1"
shift
if [[ -z "${DEVICE:-}" ]]; then
    if "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
        DEVICE=cuda
    else
        DEVICE=cpu
    fi
fi
ARGS=(--model-path "$CKPT" --attention-backend nosa --device "$DEVICE"
      --host "${HOST:-127.0.0.1}" --port "${PORT:-30000}")
if [[ "$DEVICE" == cpu ]]; then
    export SGLANG_USE_CPU_ENGINE=1
fi
# CUDA: no --disable-cuda-graph needed; the plugin turns CUDA graphs off for the phases nosa serves
# (no capture path yet) and logs it (nosa.serve.cuda_graphs).
exec "$PY" -m sglang.launch_server "${ARGS[@]}" "$@"
