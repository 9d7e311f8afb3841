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


class _Pool:
    """What install_key_factors reads of a host pool (serve/offload/host_pool.HostKVPool), recording the
    factors it is given."""

    def __init__(self, kv_dtype, head_dim=4):
        self.kv_dtype, self.head_dim, self.installed = kv_dtype, head_dim, None

    def set_key_factors(self, factors):
        self.installed = factors


def test_install_key_factors_takes_this_ranks_heads(tmp_path, caplog):
    """An int8 pool gets the checkpoint's key factors for its rank's heads (SGLang's padding heads:
    ones); no file: a warning naming the command, nothing installed; a file that does not fit the
    model: an error naming the file; other pools: nothing read."""
    pytest.importorskip("sglang")
    from nosa import kv_calibrate, kvquant
    from nosa.serve.offload.host_pool import install_key_factors

    layers = [0, 2]
    shard = KVHeadShard(total=4, real=3, rank=1, size=2)  # rank 1 holds heads 2 and 3 (3 is padding)
    pool = _Pool(torch.int8)
    with caplog.at_level("WARNING"):
        assert "none in the checkpoint" in install_key_factors(pool, str(tmp_path), layers, shard)
    assert pool.installed is None and "python -m nosa.kv_calibrate" in caplog.text
    factors = {layer: kvquant.key_factors(torch.rand(3, 4) + 0.1 * layer) for layer in (0, 1, 2)}
    kv_calibrate.save_key_factors(str(tmp_path), factors, {})
    assert "key factors" in install_key_factors(pool, str(tmp_path), layers, shard)
    assert len(pool.installed) == 2
    for table, layer in zip(pool.installed, layers):
        assert torch.equal(table, torch.stack([factors[layer][2], torch.ones(4)]))
    other = _Pool(torch.float8_e4m3fn)
    assert "not an int8" in install_key_factors(other, str(tmp_path), layers, shard) and other.installed is None
    kv_calibrate.save_key_factors(str(tmp_path), {0: factors[0]}, {})
    with pytest.raises(ValueError, match=r"layer 2 needs key factors \[3, 4\], found none"):
        install_key_factors(pool, str(tmp_path), layers, shard)
