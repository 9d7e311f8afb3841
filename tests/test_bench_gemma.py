"""scripts/bench_gemma.py's arithmetic, on a tiny Gemma 3 checkpoint: the bytes a decode step reads
(what bounds nosa's speed-up over torch_native on a bandwidth-bound device), counted by hand here."""

import json
import os
import runpy

import pytest

from nosa.tiny import build_causal_lm, hybrid_layout

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
bench = runpy.run_path(os.path.join(ROOT, "scripts", "bench_gemma.py"))  # not as __main__: nothing runs


def test_decode_bytes_of_a_tiny_gemma(tmp_path):
    model = build_causal_lm("gemma3_text", seed=0, vocab_size=96, hidden_size=64, intermediate_size=128,
                            num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                            max_position_embeddings=4096, **hybrid_layout("gemma3_text", 4, head_dim=16, window=32))
    model.save_pretrained(tmp_path)
    hf = json.loads((tmp_path / "config.json").read_text())
    cfg = bench["nosa_config"](2048, 0.25)  # blocks of 64: 8 blocks = 512 tokens
    got = bench["decode_bytes"](str(tmp_path), hf, 2048, cfg)

    weights = sum(p.numel() * 4 for p in model.parameters())  # tied embedding counted once
    assert got["weights"] == weights and got["lm_head"] == 96 * 64 * 4
    per_token = 2 * 2 * 16 * 4  # 2 KV heads, K and V, head_dim 16, float32
    assert got["torch_native_kv"] == 4 * per_token * 2048  # every layer, the whole context
    # 2 full layers: 512 budget tokens and (2048 - 32) // 16 + 1 compressed keys; 2 sliding: 32 tokens
    parts = {"budget": 2 * per_token * 512, "compressed_keys": 2 * 127 * 2 * 16 * 4,
             "sliding_windows": 2 * per_token * 32}
    assert got["nosa_kv_parts"] == parts and got["nosa_kv"] == sum(parts.values())
    assert got["bound"] == pytest.approx((weights + 4 * per_token * 2048) / (weights + sum(parts.values())), abs=1e-3)
