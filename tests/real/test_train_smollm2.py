"""The smollm2 training config (configs/train/smollm2.yaml) end to end at a toy size: RULER-style rows
over the training prose written with the model's tokenizer, the eviction-head fit on the rows that
predict answers, a checkpoint of the fitted model, one frozen-base fine-tune step and the final
checkpoint, both loadable as NOSA Llama checkpoints."""

import json
import math
import os

import pytest
import torch

import nosa
from nosa.eviction import MODULE_NAME
from nosa.train.config import load_config
from nosa.train.loop import run

pytestmark = pytest.mark.real

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIG = os.path.join(REPO, "configs", "train", "smollm2.yaml")


def heads(model) -> dict[str, torch.Tensor]:
    return {k: v for k, v in model.state_dict().items() if f".{MODULE_NAME}." in k}


def test_smollm2_config_fits_fine_tunes_and_saves(real_checkpoint, tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    cfg = load_config(CONFIG, [
        f"out_dir={tmp_path}/run", f"model.path={real_checkpoint}", f"data.ruler.dir={tmp_path}/data",
        "seq_len=512", "data.ruler.tasks=[passkey, niah_single]", "data.ruler.train_examples=1",
        "data.ruler.heldout_examples=1", "distill.rows=2", "distill.steps=20", "steps=1", "eval_examples=2",
        "nosa.window_blocks=2", "nosa.query_blocks=2", "nosa.topk_blocks=8", "progress=false", "wandb.mode=disabled",
        "save_optimizer=false",  # nothing resumes from it: the save skips DeepSpeed's state (seconds to write)
    ])
    result = run(cfg)
    rows = {}
    with open(os.path.join(cfg.out_dir, "metrics.jsonl")) as f:
        for row in map(json.loads, f):
            rows.setdefault(row["step"], {}).update(row)
    assert rows[0]["distill/loss"] < rows[0]["distill/loss_first"]
    assert math.isfinite(rows[1]["train/loss"])

    fitted = nosa.from_pretrained(os.path.join(cfg.out_dir, "fitted"))
    with open(os.path.join(cfg.out_dir, "fitted", "config.json")) as f:
        assert json.load(f)["model_type"] == "nosa_llama"
    fitted_heads = heads(fitted)
    assert all(torch.all(v == cfg.distill.scale) for k, v in fitted_heads.items() if k.endswith(".scale"))
    # the fine-tune moved the eviction heads only: every other weight is the dense checkpoint's
    tuned = result["model"]
    moved = {k for k, v in tuned.state_dict().items() if not torch.equal(v, fitted.state_dict()[k])}
    assert moved and all(f".{MODULE_NAME}." in k for k in moved)
    final = nosa.from_pretrained(os.path.join(cfg.out_dir, "nosa"))
    for k, v in heads(final).items():
        torch.testing.assert_close(v, tuned.state_dict()[k])
    assert nosa.hf.nosa_config_of(final.config) == cfg.nosa


def test_sparse_config_trains_every_weight_with_its_heads(sparse_ft_checkpoint, dense_model_once):
    """configs/train/smollm2-sparse.yaml at a toy size (tests/real/conftest.py): the step moves the
    model's own weights (attention, MLP, embeddings) and its eviction heads, with the token loss, the
    KL to the frozen model and the selection loss adding up to the loss."""
    cfg, result = sparse_ft_checkpoint
    assert not cfg.freeze_base and cfg.data.kl_weight > 0 and cfg.data.select_weight > 0
    with open(os.path.join(cfg.out_dir, "metrics.jsonl")) as f:
        row = [r for r in map(json.loads, f) if r.get("step") == 1 and "train/loss" in r][0]
    assert row["train/kl"] >= 0 and row["train/select"] > 0
    total = row["train/ce"] + cfg.data.kl_weight * row["train/kl"] + cfg.data.select_weight * row["train/select"]
    assert math.isclose(total, row["train/loss"], rel_tol=1e-5)

    final = nosa.from_pretrained(os.path.join(cfg.out_dir, "nosa"))
    assert nosa.hf.nosa_config_of(final.config) == cfg.nosa
    fitted = nosa.from_pretrained(os.path.join(cfg.out_dir, "fitted"))
    dense = dense_model_once.state_dict()
    tuned = final.state_dict()
    for part in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.down_proj"):
        key = f"model.layers.3.{part}.weight"
        assert not torch.equal(tuned[key], dense[key]), f"{key} did not move"
    moved = [k for k, v in heads(final).items() if not torch.equal(v, fitted.state_dict()[k])]
    assert moved, "the eviction heads did not move with the model"
    for k, v in tuned.items():
        torch.testing.assert_close(v, result["model"].state_dict()[k])  # the checkpoint is the trained model
