"""The one builder of small randomly initialised models (tests, the demo, benchmarks, the tiny
training default) and the one helper that gives a converted model non-zero eviction heads.

Nothing is downloaded: models are built from a transformers config.
"""

from __future__ import annotations

import torch

from nosa.eviction import EvictionHead


def build_causal_lm(model_type: str = "llama", seed: int | None = None, dtype=torch.float32,
                    attn_implementation: str = "sdpa", init_std: float | None = None, **config):
    """A randomly initialised transformers causal LM of ``model_type`` (llama, qwen2, qwen3, ...)
    from config keywords (``hidden_size=...``, ...). ``seed`` seeds torch's global generator first
    (the initialisation uses it); ``init_std`` re-draws every matrix from N(0, init_std) (larger
    logits, so greedy ties are rare). Bad config keywords raise ValueError naming the problem."""
    from transformers import AutoConfig, AutoModelForCausalLM  # optional: after nosa.train sets HF_HUB_OFFLINE

    try:
        hf_config = AutoConfig.for_model(model_type, **config)
    except (TypeError, ValueError, KeyError) as err:
        raise ValueError(f"model config ({model_type}): {err}") from err
    if seed is not None:
        torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config, attn_implementation=attn_implementation, dtype=dtype)
    if init_std is not None:
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() == 2:
                    p.normal_(0.0, init_std)
    return model


def hybrid_layout(model_type: str, layers: int, head_dim: int, window: int = 32) -> dict:
    """Config keywords that make a small model of ``model_type`` look like its real hybrid shape, {}
    for a model type without one. gemma3_text: a sliding-window layer (``window`` tokens, RoPE base
    1e4) then a full-attention one (base 1e6), repeated; the query scale from a
    ``query_pre_attn_scalar`` that is not head_dim, so that a layer using head_dim**-0.5 instead
    would show; Gemma 3's default head_dim (256) replaced by ``head_dim``."""
    if model_type != "gemma3_text":
        return {}
    return dict(
        layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)],
        sliding_window=window, head_dim=head_dim, query_pre_attn_scalar=head_dim * 3 // 2,
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}},
    )


def tiny_llama(layers: int = 2, hidden: int = 128, heads: int = 4, kv_heads: int = 2, vocab: int = 320,
               seed: int = 0, intermediate: int | None = None, max_positions: int = 4096, **config):
    """A small Llama (GQA ``heads``/``kv_heads``, head_dim hidden // heads; intermediate size
    defaults to 2 * hidden). Extra keywords go to LlamaConfig (``bos_token_id=...``,
    ``tie_word_embeddings=...``) or to ``build_causal_lm`` (``init_std``, ``dtype``,
    ``attn_implementation``). Returned in train mode, as transformers builds it."""
    if hidden % heads or heads % kv_heads:
        raise ValueError(f"tiny_llama: hidden={hidden} must be a multiple of heads={heads}, "
                         f"and heads a multiple of kv_heads={kv_heads}")
    return build_causal_lm(
        "llama", seed=seed, vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate or 2 * hidden,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        max_position_embeddings=max_positions, **config,
    )


def set_eviction_heads(model, scale: float, std: float = 0.3, seed: int = 0, bias_std: float = 0.0) -> None:
    """Stand-in for fine-tuned eviction heads on a converted model: W ~ N(0, std), b ~ N(0, bias_std)
    (b = 0 when bias_std is 0), A = ``scale`` for every KV head of every layer, drawn from a
    generator seeded with ``seed`` (the global one is untouched). A freshly converted model has
    A = 0 (training-free selection); A != 0 makes the static part of the selection visible."""
    heads = [m for m in model.modules() if isinstance(m, EvictionHead)]
    if not heads:
        raise ValueError(f"set_eviction_heads: {type(model).__name__} has no eviction heads; call nosa.convert first")
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for head in heads:
            w = head.proj.weight
            w.copy_(torch.randn(w.shape, generator=gen) * std)
            head.proj.bias.copy_(torch.randn(head.proj.bias.shape, generator=gen) * bias_std)
            head.scale.fill_(scale)
