"""Selection statistics and eval accuracy on a tiny random model."""

import pytest
import torch

import nosa
from nosa.config import NosaConfig
from nosa.tiny import tiny_llama
from nosa.train.metrics import evaluate, selection_stats


def _model(cfg):
    model = tiny_llama(layers=2, hidden=32, heads=4, kv_heads=2, vocab=64, intermediate=64, max_positions=512)
    return nosa.convert(model, cfg).eval()


def test_mass_is_one_when_the_budget_covers_everything():
    cfg = NosaConfig.tiny(topk_blocks=16)  # 16 blocks of 16 tokens: all of a 256-token sequence
    stats = selection_stats(_model(cfg), torch.randint(0, 64, (256,)), cfg)
    assert stats["select/mass"] == pytest.approx(1.0, abs=1e-5)
    assert stats["select/mass/layer0"] == pytest.approx(1.0, abs=1e-5)


def test_small_budget_bounds_churn_and_loses_mass():
    cfg = NosaConfig.tiny(topk_blocks=4, query_blocks=1)
    model = _model(cfg)
    with torch.no_grad():  # A != 0 so the locality bound (query_blocks + 1) applies
        for name, p in model.named_parameters():
            if name.endswith("nosa_evict.scale"):
                p.fill_(1.0)
    stats = selection_stats(model, torch.randint(0, 64, (256,)), cfg)
    assert 0 < stats["select/mass"] < 1
    assert 0 <= stats["select/churn_mean"] <= stats["select/churn_max"] <= cfg.max_blocks_entering_per_step
    assert not model.training and not any(hasattr(m, "_nosa_capture") for m in model.modules())


def test_accuracy_counts_rows_with_every_answer_token_right():
    cfg = NosaConfig.tiny()
    model = _model(cfg)
    ids = torch.randint(0, 64, (32,))
    with torch.no_grad():
        pred = model(input_ids=ids[None]).logits[0].argmax(-1)
    right = torch.full((32,), -100)
    right[10:12] = pred[9:11]  # labels equal to the model's own greedy prediction
    wrong = right.clone()
    wrong[11] = (pred[10] + 1) % 64
    rows = [{"input_ids": ids, "labels": right, "task": "a"}, {"input_ids": ids, "labels": wrong, "task": "b"}]
    scores = evaluate(model, rows, 2)
    assert scores["eval/acc"] == 0.5 and scores["eval/acc/a"] == 1.0 and scores["eval/acc/b"] == 0.0
