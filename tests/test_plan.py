"""nosa.plan: the formulas on figures that can be checked by hand, the CLI, and (nosa.plan_checks) the
calibration against the H200's measurements (results/gpu_h200.json) and the CPU runs."""

import json
import os

import pytest
import torch

from nosa import NosaConfig, kvquant
from nosa.plan import GPUS, LINKS, MODELS, main, model_from_config, nosa_config_for, plan
from nosa.plan_checks import against_gpu, calibration

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GPU_RESULTS = os.path.join(ROOT, "results", "gpu_h200.json")
LLAMA = MODELS["llama-3.1-8b"]


def test_llama_8b_kv_is_128_kib_per_token_and_16_gib_at_128k():
    p = plan(LLAMA, 131072, 1, GPUS["h100"], LINKS["pcie5"], NosaConfig())
    assert p["device_bytes_per_request"]["dense"] == 131072 * 2 * 32 * 8 * 128 * 2 == 16 * 2**30
    # offloading keeps 64 blocks of 64 tokens of K, V and scores per KV head, plus the selection state
    slots = 64 * 64 * 32 * 8 * (2 * 128 * 2 + 4)
    state = 32 * 8 * (131072 // 16 * 128 * 4 + 131072 // 64 * 8)
    assert p["device_bytes_per_request"]["nosa_offload"] == slots + state
    assert p["host_bytes_per_request"] == 131072 * 32 * 8 * kvquant.bytes_per_token(128, 128, torch.bfloat16)


def test_recall_follows_the_locality_bound_or_the_hit_rate():
    cfg = NosaConfig()
    bound = plan(LLAMA, 65536, 4, GPUS["h100"], LINKS["pcie5"], cfg)
    assert bound["blocks_entering_per_head"] == cfg.query_blocks + 1
    item = cfg.block_size * kvquant.bytes_per_token(128, 128, torch.bfloat16)
    assert bound["recall_bytes_per_step"] == 4 * 32 * 8 * (cfg.query_blocks + 1) * item
    measured = plan(LLAMA, 65536, 4, GPUS["h100"], LINKS["pcie5"], cfg, hit_rate=0.97)
    assert measured["blocks_entering_per_head"] == pytest.approx(0.03 * cfg.topk_blocks)
    int8 = plan(LLAMA, 65536, 4, GPUS["h100"], LINKS["pcie5"], cfg, host_kv_dtype=torch.int8)
    assert int8["recall_bytes_per_step"] / bound["recall_bytes_per_step"] == pytest.approx(268 / 516)
    short = plan(LLAMA, 4000, 4, GPUS["h100"], LINKS["pcie5"], cfg)  # within dense_len: nothing to recall
    assert short["recall_bytes_per_step"] == 0 and short["recall_hides"]


def test_sparse_decode_reads_the_budget_not_the_context():
    a = plan(LLAMA, 32768, 8, GPUS["h200"], LINKS["pcie5"], NosaConfig())
    b = plan(LLAMA, 131072, 8, GPUS["h200"], LINKS["pcie5"], NosaConfig())
    assert b["step_s"]["dense"] > 3 * a["step_s"]["dense"] - 2 * a["weights_bytes"] / GPUS["h200"].hbm_bytes_per_s
    assert b["step_s"]["nosa"] < 1.3 * a["step_s"]["nosa"]  # only the compressed keys grow with the context
    assert b["tokens_per_s"]["nosa"] > b["tokens_per_s"]["dense"]


def test_budget_share_scales_the_released_structure():
    cfg = nosa_config_for(131072, 8, None)
    assert cfg.topk_blocks == 131072 // 64 // 8
    assert cfg.sink_blocks + cfg.window_blocks + cfg.query_blocks <= cfg.topk_blocks
    assert nosa_config_for(131072, None, None) == NosaConfig()


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="hit_rate must be in"):
        plan(LLAMA, 1024, 1, GPUS["h100"], LINKS["pcie5"], NosaConfig(), hit_rate=1.5)
    with pytest.raises(SystemExit):
        main(["--model", "no-such-model", "--context", "1024"])


def test_model_from_a_config_json(tmp_path):
    config = {"hidden_size": 576, "num_hidden_layers": 30, "intermediate_size": 1536, "num_attention_heads": 9,
              "num_key_value_heads": 3, "vocab_size": 49152, "tie_word_embeddings": True}  # SmolLM2-135M
    (tmp_path / "m").mkdir()
    path = tmp_path / "m" / "config.json"
    path.write_text(json.dumps(config))
    m = model_from_config(str(path))
    assert (m.layers, m.kv_heads, m.head_dim) == (30, 3, 64)
    assert 1.2e8 < m.params < 1.5e8  # 135M


def test_cli_prints_the_table_and_json(capsys):
    main(["--model", "llama-3.1-8b", "--context", "131072", "--gpu", "h100", "--link", "pcie5", "--batch", "16"])
    text = capsys.readouterr().out
    assert "device memory per request" in text and "recalled per step" in text and "recall hides at budgets" in text
    main(["--model", "llama-3.1-8b", "--context", "131072", "--batch", "16", "--hit-rate", "0.97", "--json"])
    data = json.loads(capsys.readouterr().out)
    assert data["batch"] == 16 and set(data["tokens_per_s"]) == {"dense", "nosa", "nosa_offload"}


def test_calibration_from_the_h200_run():
    if not os.path.exists(GPU_RESULTS):
        pytest.skip("results/gpu_h200.json is not in this checkout")
    with open(GPU_RESULTS) as f:
        rows = against_gpu(json.load(f))
    dense = [r for r in rows if r["what"].startswith("dense")]
    assert dense and all(0.7 < r["predicted_over_measured"] <= 1.05 for r in dense)  # near the HBM roofline
    cal = calibration(GPU_RESULTS)
    assert 0.7 < cal["link_bytes_per_s"] / LINKS["pcie5"].bytes_per_s <= 1.0
    assert 0 < cal["attention_efficiency"]["nosa"] <= 1.0


def test_hit_rate_from_a_serve_stats_file(tmp_path, capsys):
    stats = tmp_path / "stats.json"
    stats.write_text(json.dumps({"requests": 0, "offload": {"selected": [100, 100], "hits": [90, 90],
                                                             "warm_selected": [80, 80], "warm_hits": [78, 78]}}))
    main(["--model", "llama-3.1-8b", "--context", "65536", "--stats", str(stats), "--json"])
    data = json.loads(capsys.readouterr().out)
    assert data["blocks_entering_per_head"] == pytest.approx((1 - 78 / 80) * data["nosa_config"]["topk_blocks"])
    stats.write_text(json.dumps({"requests": 0}))
    with pytest.raises(SystemExit):
        main(["--model", "llama-3.1-8b", "--context", "65536", "--stats", str(stats)])


def test_published_points_are_modelled_with_their_assumptions_named():
    from nosa.plan_checks import published_points

    rows = published_points()
    assert len(rows) >= 3
    for r in rows:
        assert r["assumed"] and r["setup"] and 0 < r["predicted_ratio"] < 100
        assert all(b >= 1 for b in r["batches"].values())


def test_against_cpu_predicts_the_growth_from_the_shortest_context():
    from nosa.plan_checks import against_cpu

    cfg = NosaConfig(block_size=64, compress_kernel=32, compress_stride=16, sink_blocks=1, window_blocks=16,
                     topk_blocks=64, query_blocks=16, dense_len=4096)
    results = [{"backend": b, "context": c, "batch": 4, "ms_per_decode_step": 10.0} for b in ("torch_native", "nosa")
               for c in (4096, 65536)]
    rows = against_cpu({"nosa_config": cfg.to_dict(), "results": results}, 10e9)
    dense = next(r for r in rows if r["backend"] == "torch_native")
    sparse = next(r for r in rows if r["backend"] == "nosa")
    # 60K more tokens x 4 requests x 1 KiB (2 layers, 2 KV heads of 32, fp32 K and V) at 10 GB/s
    assert dense["predicted_s"] - 0.010 == pytest.approx(61440 * 4 * 1024 / 10e9, rel=1e-6)
    assert sparse["predicted_s"] - 0.010 < (dense["predicted_s"] - 0.010) / 10


def test_onoff_against_the_served_smollm2_run():
    from nosa.plan_checks import onoff_against_cpu

    path = os.path.join(ROOT, "results", "serve_smollm2_8k_rank_short.json")
    with open(path) as f:
        row = onoff_against_cpu(json.load(f), 10e9)
    assert 0.9 < row["hit_rate"] <= 1.0 and row["rounds"] >= 3
    assert 0 < row["predicted_on_over_off"] <= 1.0  # offloading never makes the step faster in the model
    assert row["error"] == pytest.approx(row["predicted_on_over_off"] / row["measured_on_over_off"] - 1)


def test_a_request_rate_becomes_the_batch_it_keeps_decoding(capsys):
    from nosa.plan import batch_for_rate

    cfg = NosaConfig()

    def step(b):
        p = plan(LLAMA, 65536, b, GPUS["h100"], LINKS["pcie5"], cfg, hit_rate=0.97, output=256)
        return p["step_s"]["nosa_offload"]

    batch = batch_for_rate(2.0, 256, LLAMA, 65536, GPUS["h100"], LINKS["pcie5"], cfg, hit_rate=0.97)
    assert batch > 1 and batch >= 2.0 * 256 * step(batch) and batch - 1 < 2.0 * 256 * step(batch - 1)  # Little's law
    main(["--model", "llama-3.1-8b", "--context", "65536", "--rate", "2", "--output", "256", "--hit-rate", "0.97",
          "--json"])
    assert json.loads(capsys.readouterr().out)["batch"] == batch
    with pytest.raises(ValueError, match="positive rate"):
        batch_for_rate(0, 256, LLAMA, 65536, GPUS["h100"], LINKS["pcie5"], cfg)
    with pytest.raises(ValueError, match="do not fit: at most"):
        batch_for_rate(1e6, 256, LLAMA, 65536, GPUS["h100"], LINKS["pcie5"], cfg, hit_rate=0.97)


def test_hit_rate_from_a_bench_longctx_report(tmp_path, capsys):
    from nosa.plan import hit_rate_of

    report = {"results": [{"variant": "dense", "share": None}, {"variant": "A = 0, 1/4", "share": 4, "hit_rate": 0.9},
                          {"variant": "fitted, 1/4", "share": 4, "hit_rate": 0.98}]}
    assert hit_rate_of(report) == pytest.approx(0.94)
    path = tmp_path / "longctx.json"
    path.write_text(json.dumps(report))
    main(["--model", "llama-3.1-8b", "--context", "65536", "--stats", str(path), "--json"])
    data = json.loads(capsys.readouterr().out)
    assert data["blocks_entering_per_head"] == pytest.approx(0.06 * data["nosa_config"]["topk_blocks"])
