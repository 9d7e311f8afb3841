"""nosa.models on the real model: the written checkpoint, its chat answer, NOSA conversion at full
budget against dense, and save / nosa.from_pretrained round trip."""

import os

import pytest
import torch

import nosa
from nosa import models
from nosa.chat import chat_ids, greedy_reply
from nosa.tiny import set_eviction_heads

pytestmark = pytest.mark.real


def test_checkpoint_is_complete_and_a_second_fetch_returns_it_untouched(real_checkpoint):
    weights = os.path.join(real_checkpoint, "model.safetensors")
    before = os.stat(weights).st_mtime_ns
    lines = []
    assert models.fetch("smollm2", real_checkpoint, log=lines.append) == real_checkpoint
    assert os.stat(weights).st_mtime_ns == before
    assert "nothing to do" in lines[0]
    for name in ("config.json", "tokenizer.json", "chat_template.jinja", models.SOURCE_FILE):
        assert os.path.isfile(os.path.join(real_checkpoint, name)), name
    assert not os.path.exists(real_checkpoint.rstrip("/") + ".partial")


def test_greedy_chat_answer(dense_model, real_tokenizer):
    assert "Paris" in greedy_reply(dense_model, real_tokenizer, "What is the capital of France?")


def test_full_budget_conversion_equals_dense(dense_model, real_tokenizer):
    ids = torch.tensor([chat_ids(real_tokenizer, "Name three colours of the rainbow and say why the sky is blue.")])
    with torch.no_grad():
        dense = dense_model(ids).logits
        dense_reply = dense_model.generate(ids, max_new_tokens=6, do_sample=False)
    blocks = -(-(ids.shape[1] + 6) // 8)
    # every block selected (sparse path, A = 0), then the dense path below dense_len
    for cfg in (nosa.NosaConfig(block_size=8, compress_kernel=8, compress_stride=4, window_blocks=2,
                                query_blocks=2, topk_blocks=blocks, dense_len=0),
                nosa.NosaConfig(dense_len=4096)):
        nosa.convert(dense_model, cfg)
        with torch.no_grad():
            torch.testing.assert_close(dense_model(ids).logits, dense, atol=2e-4, rtol=1e-4)
            assert torch.equal(dense_model.generate(ids, max_new_tokens=6, do_sample=False), dense_reply)


def test_save_and_from_pretrained_restore_logits_and_config(dense_model, real_tokenizer, tmp_path):
    cfg = nosa.NosaConfig(block_size=16, compress_kernel=16, compress_stride=8, window_blocks=2, query_blocks=1,
                          topk_blocks=6, dense_len=0)
    nosa.convert(dense_model, cfg)
    set_eviction_heads(dense_model, scale=0.5, std=0.3, seed=1)  # heads on: the restored ones must matter
    ids = torch.tensor([chat_ids(real_tokenizer, "Summarise in one sentence: " + "The grass is green. " * 20)])
    with torch.no_grad():
        before = dense_model(ids).logits
    dense_model.save_pretrained(tmp_path)
    loaded = nosa.from_pretrained(str(tmp_path)).eval()
    assert loaded.config.nosa == cfg.to_dict()
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, before)
        set_eviction_heads(loaded, scale=0.0)  # heads off: the equality above needed the restored heads
        assert not torch.allclose(loaded(ids).logits, before, atol=1e-3)
