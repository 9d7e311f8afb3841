"""scripts/bench_train.py: dense vs NOSA training steps side by side, per row length (--seq-lens), and
with random weights of a real checkpoint's shape (--like) whose config is read without its data."""

from __future__ import annotations

import json
import runpy
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TINY = dict(model_type="llama", hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
            num_key_value_heads=1, max_position_embeddings=512, vocab_size=64)


def _bench(monkeypatch, *args: str) -> None:
    script = str(ROOT / "scripts" / "bench_train.py")
    monkeypatch.setattr(sys, "argv", [script, *args])
    runpy.run_path(script, run_name="__main__")


def test_each_row_length_is_timed_for_both_models(tmp_path, monkeypatch):
    out = tmp_path / "train.json"
    _bench(monkeypatch, "--device", "cpu", "--threads", "1", "--warmup", "0", "--steps", "2", "--prefill-context", "0",
           "--seq-lens", "64", "128", "--out", str(out))
    data = json.loads(out.read_text())
    assert [r["seq_len"] for r in data["by_seq_len"]] == [64, 128] and data["device"] == "cpu"
    assert data["seq_len"] == 64
    for row in data["by_seq_len"]:
        for name in ("dense", "nosa"):
            assert len(row["step_s"][name]["all"]) == 2 and row["step_s"][name]["median"] > 0
        assert row["ratio_nosa_over_dense"] == pytest.approx(
            row["step_s"]["nosa"]["median"] / row["step_s"]["dense"]["median"], abs=0.01)
    assert data["step_s"] == data["by_seq_len"][0]["step_s"]  # the first length at the top level, as before


def test_like_builds_the_shape_and_skips_the_configs_model_and_data(tmp_path, monkeypatch):
    from nosa.bench import train_speed

    monkeypatch.setitem(train_speed.SHAPES, "tiny-shape", TINY)
    out = tmp_path / "like.json"
    # the sparse fine-tune's config names a checkpoint that need not exist where the benchmark runs
    _bench(monkeypatch, "--device", "cpu", "--threads", "1", "--warmup", "0", "--steps", "1", "--prefill-context", "0",
           "--config", str(ROOT / "configs" / "train" / "smollm2-sparse.yaml"), "--like", "tiny-shape",
           "--seq-lens", "96", "--out", str(out), "model.path=/nonexistent")
    data = json.loads(out.read_text())
    assert data["model"] == "tiny-shape" and data["nosa_config"]["block_size"] == 32  # the config's NosaConfig
    from nosa.tiny import build_causal_lm

    assert data["parameters"] == sum(p.numel() for p in build_causal_lm(**TINY).parameters())  # the shape's model
    with pytest.raises(ValueError, match="model.path"):  # without --like the config is validated as ever
        _bench(monkeypatch, "--device", "cpu", "--config", str(ROOT / "configs" / "train" / "smollm2-sparse.yaml"),
               "--out", str(out), "model.path=/nonexistent")
