#!/usr/bin/env bash
# Serve a NOSA (or dense) checkpoint with SGLang's "nosa" attention backend.
#
#   scripts/serve.sh CKPT [extra sglang.launch_server flags...]
#
# DEVICE=cpu (default when no CUDA device is visible) sets SGLANG_USE_CPU_ENGINE=1, which SGLang
# reads at import time; HOST/PORT default to 127.0.0.1:30000; PY defaults to .venv/bin/python.
# A dense checkpoint takes its NosaConfig from NOSA_CONFIG (JSON text or a JSON file) or defaults.
# DRY_RUN=1 prints the environment and command it would run, and exits.
#
# CPU: SGLang sizes its KV pool from free RAM when --max-total-tokens is not given (about 21 GB of
# RSS for a tiny model on a 24 GB machine), so this script passes --max-total-tokens
# $MAX_TOTAL_TOKENS (default 65536) unless the flags already have one, and says so. With
# NOSA_OFFLOAD=1 it passes none: the pool is the host pool, sized by NOSA_HOST_KV_TOKENS.
#
# Graphs: on CUDA, SGLang captures decode CUDA graphs, which the nosa backend supports (its decode
# step runs on fixed shapes); the plugin turns off only the prefill (breakable) CUDA graphs where
# nosa serves prefill, and logs it (nosa.serve.cuda_graphs), so no --disable-cuda-graph is needed.
# On CPU no graph is captured unless --enable-torch-compile (SGLang's CPU graph runner, decode only).
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
    given=0
    for arg in "$@"; do
        [[ "$arg" == --max-total-tokens || "$arg" == --max-total-tokens=* ]] && given=1
    done
    # NOSA_OFFLOAD read as nosa.env.flag reads it: spaces stripped, any case
    offload="$(printf '%s' "${NOSA_OFFLOAD:-0}" | tr -d '[:space:]' | tr '[:upper:]' '[:lower:]')"
    if [[ $given == 0 && ! "$offload" =~ ^(1|true|on)$ ]]; then
        TOKENS="${MAX_TOTAL_TOKENS:-65536}"
        ARGS+=(--max-total-tokens "$TOKENS")
        echo "serve.sh: CPU KV pool bounded to --max-total-tokens $TOKENS (SGLang's default sizes it from" \
             "free RAM); pass --max-total-tokens N or set MAX_TOTAL_TOKENS=N to change it" >&2
    fi
fi
if [[ "${DRY_RUN:-0}" == 1 ]]; then
    [[ "$DEVICE" == cpu ]] && echo "SGLANG_USE_CPU_ENGINE=1"
    printf '%q ' "$PY" -m sglang.launch_server "${ARGS[@]}" "$@"
    echo
    exit 0
fi
exec "$PY" -m sglang.launch_server "${ARGS[@]}" "$@"
