#!/usr/bin/env bash
# Install SGLang 0.5.23 on a machine without a GPU (the "CPU route").
#
# sglang 0.5.23 lists CUDA-only packages (sglang-kernel, flashinfer, flash-attn, ...) in its base
# requirements and has no cpu extra, so we install the wheel with --no-deps and then its
# pure-Python needs by name. SGLang's CPU engine (SGLANG_USE_CPU_ENGINE=1) imports a few `*_cpu`
# helpers from `sgl_kernel`, whose CPU build is not on PyPI: when no real sgl_kernel is importable
# we put the project's pure-torch stand-in (serve/tools/sgl_kernel_standin/sgl_kernel) on sys.path with a
# .pth file in the venv's site-packages. On GPU machines use `pip install nosa[serve]` instead.
#
# Usage: PY=/path/to/venv/bin/python scripts/install_sglang_cpu.sh   (default: .venv/bin/python)
# Idempotent: re-running skips what is already installed.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PY:-$ROOT/.venv/bin/python}"
PIP=("$PY" -m pip)

if ! "$PY" -c 'import sglang, sys; sys.exit(0 if sglang.__version__ == "0.5.23" else 1)' 2>/dev/null; then
    "${PIP[@]}" install --no-deps "sglang==0.5.23"
fi

# Pure-Python needs of sglang 0.5.23 (torch/transformers/tokenizers pins are the project's own).
"${PIP[@]}" install \
    "torch==2.14.1" "torchvision==0.29.1" "transformers==5.19.0" "tokenizers==0.23.2" \
    numpy aiohttp fastapi uvicorn uvloop orjson pyzmq psutil pydantic requests setproctitle \
    safetensors "sentencepiece==0.2.1" msgspec pybase64 python-multipart prometheus-client \
    partial_json_parser interegular "openai==2.8.0" "openai-harmony==0.0.4" tiktoken einops \
    packaging pillow scipy tqdm regex xxhash zstandard watchfiles distro easydict \
    "blobfile==3.0.0" gguf nvidia-ml-py "python-dateutil<3" IPython "xgrammar==0.2.7" \
    "llguidance>=1.7.6,<2" "compressed-tensors==0.18.0" anthropic "numba==0.65.1" \
    mistral_common "apache-tvm-ffi==0.1.11" dill "soundfile==0.13.1" "triton==3.8.0"

# The sgl_kernel CPU stand-in: only when no real sgl_kernel can be imported.
SITE="$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
PTH="$SITE/nosa_sgl_kernel_cpu.pth"
rm -f "$PTH"
if "$PY" -c 'import sgl_kernel' 2>/dev/null; then
    echo "install_sglang_cpu: a real sgl_kernel is importable; not installing the CPU stand-in"
else
    echo "$ROOT/serve/tools/sgl_kernel_standin" > "$PTH"
    echo "install_sglang_cpu: sgl_kernel CPU stand-in on sys.path via $PTH"
    # A CUDA sglang-kernel that is installed but cannot load (no libcuda) would shadow the stand-in.
    if ! "$PY" -c 'import sgl_kernel, sys; sys.exit(0 if getattr(sgl_kernel, "IS_NOSA_STANDIN", False) else 1)'; then
        echo "install_sglang_cpu: an unusable sgl_kernel shadows the stand-in;" \
             "run '$PY -m pip uninstall -y sglang-kernel' and re-run this script" >&2
        exit 1
    fi
fi

# Refresh entry points (sglang.srt.plugins -> nosa.serve.plugin:register).
"${PIP[@]}" install -e "$ROOT" --no-deps -q

"$PY" -c 'import sglang, sgl_kernel, nosa.serve.plugin; print("sglang", sglang.__version__, "sgl_kernel from", sgl_kernel.__file__)'
