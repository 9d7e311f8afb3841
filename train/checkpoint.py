"""Checkpoints: a Hugging Face directory (model with NosaConfig in config.json, tokenizer, run
config) plus the DeepSpeed engine state for resuming, written atomically.

Layout of ``<out_dir>/checkpoints/step-000100/``::

    config.json, model.safetensors, tokenizer files   # loadable by nosa.from_pretrained / SGLang
    nosa_train.json                                   # the TrainConfig of the run
    trainer_state.json                                # step, phase, tokens seen
    deepspeed/                                        # optimizer + lr scheduler state (per rank)

Every rank writes into ``.tmp-step-000100`` and rank 0 renames it into place only after all ranks
finished, so an interrupted save leaves no directory that looks like a checkpoint.
"""

from __future__ import annotations

import json
import os
import re
import shutil

import torch.distributed as dist

STEP_DIR = re.compile(r"^step-(\d{6,})$")
DS_TAG = "state"
RUN_CONFIG_FILE = "nosa_train.json"
STATE_FILE = "trainer_state.json"


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def save(
    engine, tokenizer, run_config: dict, out_dir: str, step: int, state: dict, keep: int = 2, zero_stage: int = 0,
    optimizer: bool = True,
) -> str:
    """Write the checkpoint of optimizer step ``step`` (steps done) and return its path; without
    ``optimizer`` (the run's save_optimizer: false) DeepSpeed's optimizer state is left out."""
    root = os.path.join(out_dir, "checkpoints")
    final = os.path.join(root, f"step-{step:06d}")
    tmp = os.path.join(root, f".tmp-step-{step:06d}")
    if _rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    _barrier()
    model = engine.module
    if zero_stage == 3:
        import deepspeed  # optional: deepspeed reads DS_ACCELERATOR at import (nosa.train.engine sets it)

        with deepspeed.zero.GatheredParameters(list(model.parameters()), modifier_rank=None):
            if _rank() == 0:
                model.save_pretrained(tmp)
    elif _rank() == 0:
        model.save_pretrained(tmp)
    if _rank() == 0:
        tokenizer.save_pretrained(tmp)
        _write_json(os.path.join(tmp, RUN_CONFIG_FILE), run_config)
        _write_json(os.path.join(tmp, STATE_FILE), dict(state, step=step))
    if optimizer:
        engine.save_checkpoint(os.path.join(tmp, "deepspeed"), tag=DS_TAG, save_latest=False)
    _barrier()
    if _rank() == 0:
        if os.path.exists(final):
            shutil.rmtree(final)
        os.rename(tmp, final)
        _prune(root, keep)
    _barrier()
    return final


def save_model(model, tokenizer, run_config: dict, path: str) -> str:
    """Write ``model`` (an HF directory, no optimizer state: not a resume point) with its tokenizer
    and run config to ``path`` on rank 0, atomically; used for the model right after the
    eviction-head fit. Returns ``path``."""
    if _rank() == 0:
        tmp = path.rstrip("/") + ".tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        _write_json(os.path.join(tmp, RUN_CONFIG_FILE), run_config)
        shutil.rmtree(path, ignore_errors=True)
        os.rename(tmp, path)
    _barrier()
    return path


def load_engine_state(engine, path: str) -> None:
    """Restore optimizer and scheduler state into ``engine``; raises naming the fix when the
    checkpoint was written without them (save_optimizer: false)."""
    if not os.path.isdir(os.path.join(path, "deepspeed")):
        raise ValueError(
            f"{path} holds no optimizer state (it was written with save_optimizer: false), so the run cannot "
            "resume inside its phase from it: start afresh (resume=null, or another out_dir), or train with "
            "save_optimizer: true to keep resumable checkpoints")
    engine.load_checkpoint(
        os.path.join(path, "deepspeed"), tag=DS_TAG, load_optimizer_states=True, load_lr_scheduler_states=True
    )


def read_state(path: str) -> dict:
    """The trainer state of the checkpoint at ``path``: step, phase, tokens seen."""
    return _read_json(path, STATE_FILE)


def read_run_config(path: str) -> dict:
    """The TrainConfig (as a dict) of the run that wrote the checkpoint at ``path``."""
    return _read_json(path, RUN_CONFIG_FILE)


def latest(out_dir: str) -> str | None:
    """The newest complete checkpoint under ``out_dir`` (None if there is none)."""
    steps = _steps(os.path.join(out_dir, "checkpoints"))
    return steps[-1][1] if steps else None


def _steps(root: str) -> list[tuple[int, str]]:
    if not os.path.isdir(root):
        return []
    found = []
    for name in os.listdir(root):
        m = STEP_DIR.match(name)
        if m:
            found.append((int(m.group(1)), os.path.join(root, name)))
    return sorted(found)


def _prune(root: str, keep: int) -> None:
    """Keep the newest ``keep`` checkpoints, plus any marked with a ``KEEP`` file (phase ends)."""
    steps = _steps(root)
    for _, path in steps[: max(0, len(steps) - keep)]:
        if not os.path.exists(os.path.join(path, "KEEP")):
            shutil.rmtree(path)


def mark_keep(path: str, label: str) -> None:
    """Protect a checkpoint from pruning and give it a stable alias (e.g. ``dense``, ``final``)."""
    if _rank() != 0:
        return
    with open(os.path.join(path, "KEEP"), "w") as f:
        f.write(label + "\n")
    _alias(path, os.path.join(os.path.dirname(os.path.dirname(path)), label))


def link(path: str, label: str) -> str:
    """``label`` beside ``path`` (a model directory of the run, e.g. ``fitted``) as a relative link to it,
    replaced atomically (rank 0). Returns the link's path."""
    alias = os.path.join(os.path.dirname(path.rstrip("/")), label)
    if _rank() == 0:
        _alias(path, alias)
    return alias


def _alias(path: str, alias: str) -> None:
    tmp = alias + ".tmp-link"
    if os.path.lexists(tmp):
        os.remove(tmp)
    os.symlink(os.path.relpath(path, os.path.dirname(alias)), tmp)
    os.replace(tmp, alias)


def _read_json(path: str, name: str) -> dict:
    file = os.path.join(path, name)
    if not os.path.isfile(file):
        raise ValueError(f"{path} is not a nosa.train checkpoint (no {name})")
    with open(file) as f:
        return json.load(f)


def _write_json(path: str, data: dict) -> None:
    with open(path, "w") as f:
        json.dump(data, f, indent=1, sort_keys=True, default=str)
