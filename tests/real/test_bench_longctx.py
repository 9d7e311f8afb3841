"""scripts/bench_longctx.py: the suite's NosaConfigs, the Wilson interval, and a tiny end-to-end run
on the real model in which A = 0 with every block in its budget must reply exactly as dense."""

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                "scripts"))
import bench_longctx  # noqa: E402
from _longctx_report import wilson  # noqa: E402


def test_budget_config_scales_the_released_structure():
    cfg = bench_longctx.budget_config(8192, 4)
    assert (cfg.num_blocks(8192), cfg.topk_blocks, cfg.window_blocks, cfg.query_blocks) == (256, 64, 17, 15)
    assert (cfg.sink_blocks, cfg.block_size, cfg.dense_len) == (1, 32, 0)
    for length in (2048, 4096, 8192):
        for share in (4, 8):
            cfg = bench_longctx.budget_config(length, share)
            assert cfg.topk_blocks * share == length // 32
            assert cfg.window_blocks >= 2 and cfg.topk_blocks >= cfg.sink_blocks + cfg.window_blocks + cfg.query_blocks


def test_wilson_interval():
    lo, hi = wilson(5, 10)
    assert lo == pytest.approx(0.2366, abs=1e-4) and hi == pytest.approx(0.7634, abs=1e-4)
    assert wilson(0, 4)[0] == 0 and wilson(4, 4)[1] == 1


@pytest.mark.real
def test_tiny_run_full_budget_replies_as_dense_and_dense_is_cached(real_checkpoint, tmp_path, capsys):
    args = ["--model", real_checkpoint, "--lengths", "512", "--examples", "1", "--tasks", "niah_single",
            "--shares", "1", "4", "--ppl-windows", "1", "--cache", str(tmp_path / "cache"),
            "--out", str(tmp_path / "r.json")]
    assert bench_longctx.main(args) == 0
    report = json.loads((tmp_path / "r.json").read_text())
    assert "| 512 | **all** |" in capsys.readouterr().out
    assert [r["variant"] for r in report["results"]] == ["dense", "A = 0, 1/1", "A = 0, 1/4"]
    full = report["results"][1]
    assert full["budget_blocks"] == full["context_blocks"] == 16
    assert full["mass"] == pytest.approx(1.0, abs=1e-5)  # every block selected: all the dense mass
    for ex in report["examples"]:
        assert ex["reply"]["A = 0, 1/1"] == ex["reply"]["dense"]
    sparse = report["results"][2]
    assert 0 <= sparse["hit_rate"] <= 1 and sparse["mass"] < 1
    ppl = {p["variant"]: p for p in report["perplexity"]}
    assert ppl["A = 0, 1/1"]["ratio_to_dense"] == pytest.approx(1.0, abs=1e-4)
    # a second run reads dense from the cache: no dense decoding time
    assert bench_longctx.main(args) == 0
    again = json.loads((tmp_path / "r.json").read_text())
    assert again["results"][0]["seconds"] == 0
    assert [e["reply"] for e in again["examples"]] == [e["reply"] for e in report["examples"]]
