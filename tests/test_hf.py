"""nosa.convert on tiny transformers models: dense equivalence, padding, generate, save/load, training."""

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

import nosa  # noqa: E402
from nosa import NosaConfig, NosaDecodeState  # noqa: E402
from nosa.hf import SUPPORTED_MODEL_TYPES  # noqa: E402

ARCHS = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
}


def tiny_model(arch="llama", seed=0, attn="sdpa"):
    torch.manual_seed(seed)
    config_cls, model_cls = ARCHS[arch]
    config = config_cls(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                        attn_implementation=attn, pad_token_id=0, eos_token_id=1, bos_token_id=2)
    return model_cls(config).eval()


def set_eviction(model, a, seed=0):
    torch.manual_seed(seed)
    for m in model.modules():
        if isinstance(m, nosa.EvictionHead):
            with torch.no_grad():
                m.scale.fill_(a)
                m.proj.weight.normal_(0, 0.5)


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_full_budget_zero_a_equals_dense_model(arch):
    model = tiny_model(arch)
    x = torch.randint(3, 96, (2, 150))
    with torch.no_grad():
        dense = model(x).logits
        nosa.convert(model, NosaConfig.tiny(topk_blocks=10))
        assert model.config._attn_implementation == "nosa"
        out = model(x).logits
    torch.testing.assert_close(out, dense, atol=1e-5, rtol=1e-4)


def test_sparse_model_differs_and_left_padding_matches_unpadded():
    model = nosa.convert(tiny_model(), NosaConfig.tiny())
    set_eviction(model, 0.7)
    a, b = torch.randint(3, 96, (1, 170)), torch.randint(3, 96, (1, 130))
    with torch.no_grad():
        la, lb = model(a).logits, model(b).logits
        x = torch.cat([a, torch.cat([torch.zeros(1, 40, dtype=torch.long), b], 1)])
        mask = torch.ones_like(x)
        mask[1, :40] = 0
        batch = model(x, attention_mask=mask).logits
    torch.testing.assert_close(batch[0], la[0], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(batch[1, 40:], lb[0], atol=1e-5, rtol=1e-4)


def test_generate_uses_the_decode_path_and_agrees_with_prefill(monkeypatch):
    model = nosa.convert(tiny_model(), NosaConfig.tiny())
    set_eviction(model, 0.7)
    calls = []
    original = NosaDecodeState.attend
    monkeypatch.setattr(NosaDecodeState, "attend", lambda self, *a: calls.append(self.length) or original(self, *a))
    prompt = torch.randint(3, 96, (2, 160))
    out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=24, do_sample=False,
                         min_new_tokens=24, pad_token_id=0)
    assert len(calls) == 2 * 2 * 23  # batch 2, 2 layers, every token after the first comes from decode
    with torch.no_grad():  # the prefill path on the whole sequence picks the same greedy tokens
        logits = model(out).logits
    assert torch.equal(logits[:, 159:-1].argmax(-1), out[:, 160:])


def test_save_and_load_round_trip(tmp_path):
    cfg = NosaConfig.tiny(dense_len=32)
    model = nosa.convert(tiny_model("qwen3"), cfg)
    set_eviction(model, 0.5)
    model.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["nosa"] == cfg.to_dict()
    loaded = nosa.from_pretrained(str(tmp_path)).eval()
    x = torch.randint(3, 96, (1, 140))
    with torch.no_grad():
        torch.testing.assert_close(loaded(x).logits, model(x).logits, atol=0, rtol=0)
    assert nosa.hf.nosa_config_of(loaded.config) == cfg


def test_dense_checkpoint_loads_with_zero_eviction(tmp_path):
    dense = tiny_model()
    dense.save_pretrained(tmp_path)
    model = nosa.from_pretrained(str(tmp_path), NosaConfig.tiny(topk_blocks=10))
    assert all(float(m.scale.detach().abs().sum()) == 0 for m in model.modules() if isinstance(m, nosa.EvictionHead))
    x = torch.randint(3, 96, (1, 150))
    with torch.no_grad():
        torch.testing.assert_close(model(x).logits, dense(x).logits, atol=1e-5, rtol=1e-4)


def test_malformed_nosa_section_is_a_clear_error(tmp_path):
    model = nosa.convert(tiny_model(), NosaConfig.tiny())
    model.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["nosa"]["topk_blocks"] = 2
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="malformed 'nosa' section.*topk_blocks=2"):
        nosa.from_pretrained(str(tmp_path))


def test_unsupported_architecture_lists_supported_ones():
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50))
    with pytest.raises(ValueError) as err:
        nosa.convert(gpt2, NosaConfig.tiny())
    assert "'gpt2'" in str(err.value) and all(t in str(err.value) for t in SUPPORTED_MODEL_TYPES)


def test_training_reaches_eviction_head_and_lowers_loss():
    torch.manual_seed(0)
    model = nosa.convert(tiny_model(), NosaConfig.tiny()).train()
    set_eviction(model, 0.1)
    x = torch.randint(3, 20, (2, 128))  # a small alphabet: quickly learnable
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(8):
        loss = model(x, labels=x).loss
        opt.zero_grad()
        loss.backward()
        heads = [m for m in model.modules() if isinstance(m, nosa.EvictionHead)]
        assert all(h.scale.grad.abs().sum() > 0 and h.proj.weight.grad.abs().sum() > 0 for h in heads)
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.8 * losses[0], losses
