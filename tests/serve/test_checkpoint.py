"""nosa.serve.checkpoint: NosaConfig and eviction heads read back from a checkpoint (no SGLang)."""

from __future__ import annotations

import json
import os

import pytest
import torch

import nosa
from nosa.bench import tiny_checkpoint as tiny
from nosa.serve.checkpoint import load_eviction_heads, load_nosa_config
from nosa.serve.parallel import KVHeadShard

CFG = nosa.NosaConfig.tiny(dense_len=64)


@pytest.fixture(scope="module")
def nosa_ckpt(tmp_path_factory):
    return tiny.make_checkpoint(str(tmp_path_factory.mktemp("nosa")), CFG, evict_scale=0.7)


@pytest.mark.parametrize("form", ["nosa", "legacy"])
def test_config_and_heads_match_hf(nosa_ckpt, legacy_copy, tmp_path, form):
    """Both checkpoint formats (nosa.checkpoint_format) give the backend the same NosaConfig and heads."""
    ckpt = nosa_ckpt if form == "nosa" else legacy_copy(nosa_ckpt, tmp_path / "legacy")
    with open(os.path.join(ckpt, "config.json")) as f:
        assert json.load(f)["model_type"] == {"nosa": "nosa_llama", "legacy": "llama"}[form]
    cfg, from_ckpt = load_nosa_config(ckpt)
    assert from_ckpt and cfg == CFG
    heads = load_eviction_heads(ckpt, layers=[0, 1], kv_heads=KVHeadShard(2, 2), head_dim=32, device="cpu")
    model = nosa.from_pretrained(nosa_ckpt, torch_dtype=torch.float32)
    v = torch.randn(5, 2, 32)
    for layer, head in zip(model.model.layers, heads):
        expected = layer.self_attn.nosa_evict(v)
        assert torch.equal(head(v), expected)
        assert expected.abs().sum() > 0  # non-zero eviction heads


def test_tensor_parallel_ranks_get_heads_for_their_kv_heads(nosa_ckpt):
    """2 real KV heads padded to 4 over 2 ranks (SGLang's CPU layout): rank 0 holds both real heads
    and computes TP 1's cis alone, rank 1 holds padding heads only (cis 0); no rank needs another."""
    model = nosa.from_pretrained(nosa_ckpt, torch_dtype=torch.float32)
    v = torch.randn(5, 2, 32)
    ranks = [load_eviction_heads(nosa_ckpt, [0, 1], KVHeadShard(4, 2, r, 2), head_dim=32, device="cpu") for r in (0, 1)]
    for layer, head0, head1 in zip(model.model.layers, *ranks):
        assert torch.equal(head0(v), layer.self_attn.nosa_evict(v))
        assert torch.equal(head1(torch.zeros(5, 2, 32)), torch.zeros(5, 2))


def test_malformed_section_is_a_clear_error(nosa_ckpt, tmp_path):
    bad = tmp_path / "bad"
    bad.mkdir()
    with open(os.path.join(nosa_ckpt, "config.json")) as f:
        config = json.load(f)
    config["nosa"]["topk_blocks"] = 2
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"malformed 'nosa' section .*topk_blocks=2"):
        load_nosa_config(str(bad))
    config["nosa"] = {"block_sise": 16}
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="unknown field"):
        load_nosa_config(str(bad))
    del config["nosa"]  # a NOSA model type is never served as a dense checkpoint
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="model_type 'nosa_llama' but no 'nosa' section"):
        load_nosa_config(str(bad))


def test_missing_eviction_head_is_a_clear_error(nosa_ckpt):
    with pytest.raises(ValueError, match=r"layers\.2\.self_attn\.nosa_evict"):
        load_eviction_heads(nosa_ckpt, layers=[0, 1, 2], kv_heads=KVHeadShard(2, 2), head_dim=32, device="cpu")


def test_dense_checkpoint_config_from_env(tmp_path, monkeypatch):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    monkeypatch.delenv("NOSA_CONFIG", raising=False)
    assert load_nosa_config(str(tmp_path)) == (nosa.NosaConfig(), False)
    monkeypatch.setenv("NOSA_CONFIG", CFG.to_json())
    assert load_nosa_config(str(tmp_path)) == (CFG, False)
    path = tmp_path / "nosa.json"
    path.write_text(CFG.to_json())
    monkeypatch.setenv("NOSA_CONFIG", str(path))
    assert load_nosa_config(str(tmp_path)) == (CFG, False)
    monkeypatch.setenv("NOSA_CONFIG", '{"topk_blocks": 0}')
    with pytest.raises(ValueError, match="malformed \\$NOSA_CONFIG"):
        load_nosa_config(str(tmp_path))
