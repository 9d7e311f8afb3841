"""Every ``NOSA_*`` environment variable the project reads, and the typed readers that read them.

``VARIABLES`` is the registry (the docs render their settings table from it); each module reads its
variables through ``flag``, ``integer``, ``choice``, ``text`` or ``path``, which know the registered
default and raise ValueError naming the variable, its value and what is expected. Reading a name
that is not registered raises KeyError. Imports only the standard library.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class EnvVar:
    name: str  # NOSA_...
    default: str | None  # the value when unset, as a user would write it; None: no value
    meaning: str  # one or two sentences for the docs
    used_by: tuple[str, ...]  # repository paths of the files that read it
    choices: tuple[str, ...] = ()  # the accepted values of a choice (empty: any text)


_SERVE_SETTINGS = ("serve/offload/settings.py",)

VARIABLES: tuple[EnvVar, ...] = (
    # ---- kernels ----------------------------------------------------------------------------------
    EnvVar("NOSA_KERNELS", "auto",
           "Which implementation the NOSA ops run: `auto` (Triton kernels on CUDA tensors, the torch "
           "reference elsewhere, and the C++ resolve and selection kernels in a CPU server's eager step), `reference` "
           "(always the torch reference) or `triton` (always the Triton kernels; CPU tensors need "
           "TRITON_INTERPRET=1, tests only).",
           ("nosa/ops.py", "kernels/cpu_build.py"), ("auto", "reference", "triton")),
    EnvVar("NOSA_DECODE_IMPL", "triton",
           "The slot decode kernel where kernels run: `triton` or `flashinfer` (FlashInfer's paged decode with a "
           "NOSA JIT variant; CUDA and bf16/fp16 only). NOSA_KERNELS=reference still forces the reference.",
           ("nosa/ops.py",), ("triton", "flashinfer")),
    EnvVar("NOSA_DEBUG_CHECKS", "0",
           "`1` checks the index bounds of every recall item copy. Off by default: the check reads the indices "
           "on the host, a synchronisation per call on CUDA that a captured step cannot make.",
           ("kernels/recall.py",)),
    EnvVar("NOSA_KERNEL_CACHE", "~/.cache/nosa/kernels",
           "Where the CPU kernels (kernels/resolve_cpu.cpp, kernels/select_cpu.cpp) are compiled to on first "
           "use, one shared library per source hash.",
           ("kernels/cpu_build.py",)),
    # ---- serving ------------------------------------------------------------------------------------
    EnvVar("NOSA_CONFIG", None,
           "The NosaConfig the SGLang backend uses for a dense checkpoint (one without a `nosa` section): JSON "
           "text or the path of a JSON file. Unset: NosaConfig's defaults.",
           ("serve/checkpoint.py",)),
    EnvVar("NOSA_OFFLOAD", "0",
           "`1` keeps the KV in host memory and only each request's selected blocks on the device (the "
           "offloading engine); `0` keeps the KV in SGLang's device pool.",
           _SERVE_SETTINGS),
    EnvVar("NOSA_HOST_KV_TOKENS", None,
           "Host KV capacity in tokens, required with NOSA_OFFLOAD=1. It becomes SGLang's KV pool size, so the "
           "scheduler's admission, chunked prefill and input-length limit count host tokens.",
           _SERVE_SETTINGS),
    EnvVar("NOSA_DEVICE_KV_TOKENS", None,
           "The device KV budget in tokens (K and V of every layer), required with NOSA_OFFLOAD=1 and shared by "
           "all requests; a request holds its block slots for its whole life, so this caps the running requests.",
           _SERVE_SETTINGS),
    EnvVar("NOSA_DEVICE_EXTRA_SLOTS", "0",
           "Block slots per (request, KV head) beyond topk_blocks: a spare slot keeps a dropped block resident, "
           "a hit if it comes back. With NOSA_ADMISSION=1, the most a request may borrow.",
           _SERVE_SETTINGS),
    EnvVar("NOSA_RECALL_SCHEDULER", "0",
           "`1` prefetches the next layer's predicted blocks on a worker while a layer computes (the "
           "interruptible layer-wise recall scheduler); a layer still copies its own misses inline.",
           _SERVE_SETTINGS),
    EnvVar("NOSA_GRAPH_SPAN_BUCKETS", "4",
           "Under SGLang's CPU graph runner (`--enable-torch-compile`), how many context buckets a decode step's "
           "selection chooses from: the server's context length halved down to the budget, the batch's longest "
           "request picking the shortest bucket that holds it. Each bucket is one more compiled copy of the "
           "selection per NOSA layer (longer start-up); `1` reads the longest context's spans every step.",
           ("nosa/state_pool.py",)),
    EnvVar("NOSA_RECALL_CHUNK_ITEMS", "64",
           "Items per chunk of the recall scheduler's prefetch (it can pause between chunks).",
           _SERVE_SETTINGS),
    EnvVar("NOSA_HOST_KV_DTYPE", "auto",
           "How the host pool stores K and V with offloading: `auto` (the model's dtype), `int8` or "
           "`float8_e4m3fn` (one byte per element plus a float32 scale per token and KV head, dequantized into "
           "the device cache on recall; nosa.kvquant; int8 keys divided first by the checkpoint's key factors, "
           "python -m nosa.kv_calibrate). The eviction scores and the selection stay exact.",
           _SERVE_SETTINGS, ("auto", "bfloat16", "float16", "float32", "int8", "float8_e4m3fn")),
    EnvVar("NOSA_ADMISSION", "0",
           "`1` turns on I/O-adaptive admission: a request owns topk_blocks slots, extra slots are lent from idle "
           "requests, and new requests wait while their recall could not be hidden.",
           _SERVE_SETTINGS),
    EnvVar("NOSA_SERVE_STATS_FILE", None,
           "A JSON file the backend rewrites with its decode-state counts (with offloading also the engine's "
           "counters and the last decode steps' timeline); one file per TP rank / DP replica. For debugging.",
           ("serve/registry.py",)),
    EnvVar("NOSA_SERVE_WANDB", "disabled",
           "With offloading, log every decode step's counters to W&B: `offline`, `online` or `disabled` "
           "(`1`/`on` mean offline, `0`/`off` disabled).",
           ("serve/offload/stats.py",), ("disabled", "offline", "online", "0", "1", "off", "on")),
    EnvVar("NOSA_SERVE_WANDB_DIR", "runs/serve",
           "Where the NOSA_SERVE_WANDB run and its metrics.jsonl go (relative to the server's working directory).",
           ("serve/offload/stats.py",)),
    # ---- tests and scripts -----------------------------------------------------------------------------
    EnvVar("NOSA_REAL_MODEL", None,
           "The real pretrained model's checkpoint directory for the tests under tests/real (unset: "
           "models/smollm2-135m in the repository, written by `python -m nosa.models smollm2`).",
           ("tests/real/conftest.py",)),
    EnvVar("NOSA_GEMMA_MODEL", None,
           "Gemma 3 270M's checkpoint directory for the tests under tests/real (unset: models/gemma3-270m in "
           "the repository, written by `python -m nosa.models gemma3-270m`).",
           ("tests/real/conftest.py",)),
    EnvVar("NOSA_WHEELS", ".whl",
           "The folder of wheels (FlashInfer) that scripts/gpu_check.sh installs on a GPU machine with no "
           "registry; without wheels there it tries the registry.",
           ("scripts/gpu_check.sh",)),
)

_BY_NAME = {var.name: var for var in VARIABLES}


def variable(name: str) -> EnvVar:
    """The registered variable ``name``; KeyError for a name not in VARIABLES."""
    try:
        return _BY_NAME[name]
    except KeyError:
        raise KeyError(f"{name} is not a registered NOSA_* variable (add it to nosa.env.VARIABLES)") from None


def _value(name: str) -> str | None:
    """The stripped value of $name, else its registered default (None when it has none)."""
    default = variable(name).default
    value = os.environ.get(name, "").strip()
    return value or default


def flag(name: str) -> bool:
    """$name as on/off: 1, true, on / 0, false, off (any case); unset or empty: the default."""
    value = _value(name) or "0"
    if value.lower() not in ("0", "1", "false", "true", "off", "on"):
        raise ValueError(f"${name}={value!r} must be 1 (on) or 0 (off)")
    return value.lower() in ("1", "true", "on")


def integer(name: str, minimum: int | None = None) -> int | None:
    """$name as an integer >= ``minimum``; unset or empty: the default (None when it has none)."""
    value = _value(name)
    if value is None:
        return None
    try:
        number = int(value)
    except ValueError:
        raise ValueError(f"${name}={value!r} is not an integer") from None
    if minimum is not None and number < minimum:
        raise ValueError(f"${name}={number} must be >= {minimum}")
    return number


def choice(name: str) -> str | None:
    """$name, lower-cased, one of the registered choices; unset or empty: the default."""
    var = variable(name)
    value = _value(name)
    if value is None:
        return None
    if value.lower() not in var.choices:
        raise ValueError(f"{name} must be one of {var.choices}, got {value!r}")
    return value.lower()


def text(name: str) -> str | None:
    """$name as text, stripped; unset or empty: the default (None when it has none)."""
    return _value(name)


def path(name: str) -> Path | None:
    """$name as a path, ``~`` expanded; unset or empty: the default (None when it has none)."""
    value = _value(name)
    return None if value is None else Path(value).expanduser()
