"""nosa.convert on tiny transformers models: dense equivalence, padding, generate, save/load, training."""

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

import nosa  # noqa: E402
from nosa import NosaConfig, NosaDecodeState  # noqa: E402
from nosa.hf import SUPPORTED_MODEL_TYPES  # noqa: E402
from nosa.tiny import build_causal_lm, hybrid_layout, set_eviction_heads  # noqa: E402

ARCHS = ("llama", "qwen2", "qwen3", "gemma3_text")


def tiny_model(arch="llama", seed=0, attn="sdpa", layers=2):
    """gemma3_text: a sliding-window layer (32 tokens) then a full-attention one, Gemma's own
    query scale and two RoPE bases (nosa.tiny.hybrid_layout)."""
    return build_causal_lm(arch, seed=seed, attn_implementation=attn, vocab_size=96, hidden_size=64,
                           intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
                           num_key_value_heads=2, max_position_embeddings=2048, pad_token_id=0,
                           eos_token_id=1, bos_token_id=2, **hybrid_layout(arch, layers, head_dim=16)).eval()


def set_eviction(model, a, seed=0):
    set_eviction_heads(model, scale=a, std=0.5, seed=seed)


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


def test_hybrid_model_selects_in_its_full_attention_layers_only():
    """Gemma 3: eviction heads on the full-attention layers only; a sliding-window layer gives exactly
    the base model's output (its window, its own scale and RoPE base) while NOSA selects in the
    full layers (sparse there, so the logits differ from dense)."""
    model = tiny_model("gemma3_text", layers=4)
    x = torch.randint(3, 96, (1, 200))
    with torch.no_grad():
        dense = model(x, output_hidden_states=True).hidden_states
        nosa.convert(model, NosaConfig.tiny())
        set_eviction(model, 0.7)
        sparse = model(x, output_hidden_states=True).hidden_states
    names = [name for name, _ in nosa.hf.nosa_attention_modules(model)]
    assert names == ["model.layers.1.self_attn", "model.layers.3.self_attn"]
    assert not any(hasattr(model.model.layers[i].self_attn, "nosa_evict") for i in (0, 2))
    torch.testing.assert_close(sparse[1], dense[1], atol=0, rtol=0)  # layer 0 (sliding): untouched
    assert (sparse[2] - dense[2]).abs().max() > 1e-3  # layer 1 (full): 200 tokens, budget 128: sparse


def test_hybrid_decode_equals_prefill_row_for_row():
    """Gemma 3 generating past its window and its budget: every greedy token of the cached decode
    path (sliding layers on transformers' sliding cache, full layers on NosaDecodeState) is the
    prefill path's argmax at that row, and the logits agree."""
    model = nosa.convert(tiny_model("gemma3_text", layers=4), NosaConfig.tiny())
    set_eviction(model, 0.7)
    prompt = torch.randint(3, 96, (2, 150))
    out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=40, min_new_tokens=40,
                         do_sample=False, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    with torch.no_grad():
        logits = model(out.sequences).logits
    assert torch.equal(logits[:, 149:-1].argmax(-1), out.sequences[:, 150:])
    torch.testing.assert_close(torch.stack(out.logits, 1), logits[:, 149:-1], atol=1e-4, rtol=1e-4)


def test_soft_capped_attention_is_refused():
    model = tiny_model("gemma3_text")
    model.config.attn_logit_softcapping = 50.0
    for layer in model.model.layers:
        layer.self_attn.attn_logit_softcapping = 50.0
    with pytest.raises(ValueError, match="soft-caps its attention logits"):
        nosa.convert(model, NosaConfig.tiny())


def test_multimodal_gemma3_is_refused_naming_the_text_model():
    model = tiny_model("gemma3_text")
    model.config.model_type = "gemma3"
    with pytest.raises(ValueError, match="Gemma3ForCausalLM, model_type gemma3_text"):
        nosa.convert(model, NosaConfig.tiny())


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
    gpt2 = build_causal_lm("gpt2", n_layer=1, n_embd=32, n_head=2, vocab_size=50)
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


def _packed(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    docs = [torch.randint(3, 96, (n,), generator=g) for n in lengths]
    positions = torch.cat([torch.arange(n) for n in lengths])
    return docs, torch.cat(docs)[None], positions[None]


@pytest.mark.parametrize("sparse", [False, True])
def test_packed_documents_get_the_logits_they_get_alone(sparse):
    """A packed row (position_ids restarting per document, no cache, as nosa.train feeds it) gives
    each document exactly its logits alone: dense (transformers' block-diagonal SDPA mask) and NOSA
    (one nosa_prefill per document)."""
    model = tiny_model()
    if sparse:
        nosa.convert(model, NosaConfig.tiny())
        set_eviction(model, 0.7)
    docs, row, positions = _packed([150, 37, 90])
    with torch.no_grad():
        packed = model(row, position_ids=positions, use_cache=False).logits[0]
        without = model(row, use_cache=False).logits[0]  # one document: later ones see earlier ones
        start = 0
        for doc in docs:
            alone = model(doc[None]).logits[0]
            torch.testing.assert_close(packed[start : start + len(doc)], alone, atol=1e-5, rtol=1e-4)
            start += len(doc)
    assert (without[150:] - packed[150:]).abs().max() > 1e-2


def test_capture_attention_inputs_changes_nothing_and_cleans_up():
    from transformers import AttentionInterface

    model = nosa.convert(tiny_model(), NosaConfig.tiny())
    set_eviction(model, 0.7)
    x = torch.randint(3, 96, (2, 140))
    registered = AttentionInterface._global_mapping.get("nosa")
    v_rows = []  # batch row 1's value states of layer 0, seen from outside through a forward hook
    hook = model.model.layers[0].self_attn.v_proj.register_forward_hook(lambda m, i, o: v_rows.append(o[1]))
    with torch.no_grad():
        plain = model(x).logits
        with nosa.hf.capture_attention_inputs(model, batch_row=1) as captured:
            during = model(x).logits
        after = model(x).logits
    hook.remove()
    assert torch.equal(plain, during) and torch.equal(plain, after)
    assert sorted(captured) == [f"model.layers.{i}.self_attn" for i in range(2)]
    q, k, v = captured["model.layers.1.self_attn"]
    assert q.shape == (140, 4, 16) and k.shape == v.shape == (140, 2, 16)
    assert torch.equal(captured["model.layers.0.self_attn"][2], v_rows[1].view(140, 2, 16))
    assert not any("_nosa_capture" in m.__dict__ for m in model.modules())
    assert AttentionInterface._global_mapping.get("nosa") is registered is nosa.hf.nosa_attention_forward
    with pytest.raises(ValueError, match="not a NOSA model"):
        with nosa.hf.capture_attention_inputs(tiny_model()):
            pass


def test_tiny_builder_and_eviction_helper_check_their_input():
    model = nosa.tiny.tiny_llama(layers=1, hidden=32, heads=4, kv_heads=2, vocab=40, seed=3)
    again = nosa.tiny.tiny_llama(layers=1, hidden=32, heads=4, kv_heads=2, vocab=40, seed=3)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), again.parameters()))  # seeded
    assert model.config.head_dim == 8 and model.config.intermediate_size == 64
    with pytest.raises(ValueError, match="hidden=30 must be a multiple of heads=4"):
        nosa.tiny.tiny_llama(hidden=30, heads=4)
    with pytest.raises(ValueError, match="no eviction heads; call nosa.convert first"):
        set_eviction_heads(model, 1.0)
    with pytest.raises(ValueError, match="model config"):
        build_causal_lm("no-such-architecture")
    nosa.convert(model, NosaConfig.tiny())
    set_eviction_heads(model, 0.25, std=0.1, seed=1)
    heads = [m for m in model.modules() if isinstance(m, nosa.EvictionHead)]
    assert all(torch.equal(h.scale.detach(), torch.full((2,), 0.25)) and float(h.proj.bias.detach().abs().sum()) == 0
               for h in heads)


def test_mixed_precision_attention_inputs_share_the_autocast_dtype():
    """Under autocast (mixed-precision training: HF Trainer's bf16, bench_train on CUDA) transformers
    hands the attention q and k in float32 (its rotary embedding) and v in bf16; SDPA, an autocast op,
    casts them to bf16, and the NOSA attention must too (its kernels take one dtype). It then equals
    the call with all three in bf16; outside autocast, mixed inputs are promoted to the widest."""
    from nosa.hf import common_dtype, nosa_attention_forward

    model = tiny_model()
    nosa.convert(model, NosaConfig.tiny(dense_len=0))
    set_eviction(model, 0.5)
    attn = model.model.layers[0].self_attn
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, 96, 16, generator=g) for h in (4, 2, 2))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        mixed, _ = nosa_attention_forward(attn, q, k, v.bfloat16(), None)
        same, _ = nosa_attention_forward(attn, q.bfloat16(), k.bfloat16(), v.bfloat16(), None)
        assert {t.dtype for t in common_dtype(q, k, v.bfloat16())} == {torch.bfloat16}
    assert mixed.dtype == torch.bfloat16 and torch.equal(mixed, same)
    assert {t.dtype for t in common_dtype(q.bfloat16(), k, v.half())} == {torch.float32}
