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
