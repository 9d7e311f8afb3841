"""Tiny Llama checkpoints (random weights, byte-level tokenizer) for the serving tests and benchmarks.

Built locally, no downloads: ``make_checkpoint(dir, nosa_config)`` writes config.json, safetensors
and a tokenizer (``make_tokenizer``) that SGLang and transformers both load. With them: random
prompts (``prompt_ids``), the HF model's greedy tokens that a server must reproduce
(``hf_greedy``) and whether SGLang's CPU engine can run here (``cpu_engine_missing``).
tests/serve and scripts/bench_serve.py, scripts/bench_offload.py, scripts/soak.py use this module.
"""

from __future__ import annotations

import json
import os

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

import nosa
from nosa.tiny import build_causal_lm, hybrid_layout, set_eviction_heads, tiny_llama
from nosa.train.tokenizer import CHAT_TEMPLATE, add_bos

VOCAB = 320  # 256 bytes + specials, padded
HIDDEN = 128


def cpu_engine_missing() -> str | None:
    """Why SGLang's CPU engine cannot run here, or None. It imports *_cpu helpers from sgl_kernel
    (scripts/install_sglang_cpu.sh); the serving tests skip with this message."""
    try:
        import sgl_kernel  # optional: sgl_kernel (SGLang's, or the CPU stand-in)
    except Exception as err:  # a CUDA build without libcuda raises OSError/ImportError
        return f"sgl_kernel is not importable ({err}); run scripts/install_sglang_cpu.sh"
    if not hasattr(sgl_kernel, "assign_req_to_token_pool_cpu"):
        return "this sgl_kernel has no CPU helpers; run scripts/install_sglang_cpu.sh on a CPU machine"
    return None


def make_tokenizer(path: str) -> None:
    """Byte-level, ids 0-255 are bytes, <s> = 256 (added in front of encoded text, as Llama's
    tokenizer does), </s> = 257; the trainer's chat template."""
    byte_chars = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(byte_chars))}
    vocab["<s>"] = len(vocab)
    vocab["</s>"] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   chat_template=CHAT_TEMPLATE)
    add_bos(fast.backend_tokenizer, "<s>")
    fast.save_pretrained(path)


def make_checkpoint(path: str, nosa_config=None, seed: int = 0, evict_scale: float = 0.0, kv_heads: int = 2,
                    model_type: str = "llama", window: int = 64) -> str:
    """A 2-layer Llama (hidden 128, 4 query heads over ``kv_heads`` KV heads, head_dim 32), or with
    ``model_type`` "gemma3_text" a 4-layer Gemma 3 of the same widths whose layers alternate a
    sliding window of ``window`` tokens and full attention (nosa.tiny.hybrid_layout). With
    ``nosa_config`` the model is converted by nosa.convert and its eviction heads get random weights
    and A = ``evict_scale``, so the checkpoint carries a ``nosa`` section and non-zero eviction heads."""
    # larger weights (init_std) so greedy ties are unlikely
    if model_type == "llama":
        model = tiny_llama(layers=2, hidden=HIDDEN, heads=4, kv_heads=kv_heads, vocab=VOCAB, seed=seed,
                           intermediate=256, max_positions=4096, rope_theta=10000.0, bos_token_id=256,
                           eos_token_id=257, tie_word_embeddings=False, init_std=0.08)
    else:
        model = build_causal_lm(model_type, seed=seed, init_std=0.08, vocab_size=VOCAB, hidden_size=HIDDEN,
                                intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
                                num_key_value_heads=kv_heads, max_position_embeddings=4096, bos_token_id=256,
                                eos_token_id=257, pad_token_id=0, **hybrid_layout(model_type, 4, 32, window))
    if nosa_config is not None:
        nosa.convert(model, nosa_config)
        set_eviction_heads(model, scale=evict_scale, std=0.3, seed=seed, bias_std=0.3)
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path)
    make_tokenizer(path)
    with open(os.path.join(path, "config.json")) as f:
        saved = json.load(f)
    if nosa_config is not None:
        assert "nosa" in saved, "nosa.convert should store the config under 'nosa'"
    return path


def make_bench_checkpoint(path: str, evict_scale: float = 0.0) -> None:
    """The benchmarks' tiny Llama (scripts/bench_serve.py, scripts/bench_offload.py: 2 layers, hidden
    256, GQA 8/2, 128K positions, random weights) at ``path``, a dense checkpoint; with
    ``evict_scale`` > 0 a NOSA checkpoint (default NosaConfig, random eviction heads of scale
    ``evict_scale``)."""
    model = tiny_llama(layers=2, hidden=256, heads=8, kv_heads=2, vocab=320, seed=0, intermediate=512,
                       max_positions=131072, bos_token_id=256, eos_token_id=257, tie_word_embeddings=False)
    if evict_scale > 0:
        nosa.convert(model, nosa.NosaConfig())
        set_eviction_heads(model, scale=evict_scale, std=0.3, seed=0, bias_std=0.3)
    model.save_pretrained(path)
    make_tokenizer(path)


@torch.no_grad()
def hf_greedy(model, prompt: list[int], max_new_tokens: int, prefill_attention: str | None = None) -> list[int]:
    """Manual greedy loop with the KV cache: prefill the prompt, then one token per step (so the
    HF model runs prefill rows through nosa_prefill and decode through NosaDecodeState).
    ``prefill_attention`` (e.g. "sdpa"): run the prefill with that attention instead, as a server
    with ``--prefill-attention-backend torch_native --decode-attention-backend nosa`` does."""
    if prefill_attention is not None:
        decode_attention = model.config._attn_implementation
        model.set_attn_implementation(prefill_attention)
        try:
            out = model(torch.tensor([prompt]), use_cache=True)
        finally:
            model.set_attn_implementation(decode_attention)
    else:
        out = model(torch.tensor([prompt]), use_cache=True)
    past = out.past_key_values
    token = int(out.logits[0, -1].argmax())
    generated = [token]
    for _ in range(max_new_tokens - 1):
        out = model(torch.tensor([[token]]), past_key_values=past, use_cache=True)
        past = out.past_key_values
        token = int(out.logits[0, -1].argmax())
        generated.append(token)
    return generated


def prompt_ids(length: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (length,), generator=g).tolist()
