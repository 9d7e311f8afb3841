"""The long-context benchmark's variant runner (nosa.bench.longctx.variant): a reply continued from a
shared dense context prefill equals the model's own greedy reply to the whole prompt, on a Llama and
on a hybrid Gemma 3 whose sliding-window layers keep only their window of the context's cache."""

import pytest
import torch

from nosa.bench.longctx.variant import Variant, context_kv, run_variant
from nosa.bench.tiny_checkpoint import hf_greedy
from nosa.tiny import build_causal_lm, hybrid_layout
from nosa.train.ruler import Example

NEW = 12


def tiny(arch):
    # gemma3_text: sliding window of 16 tokens, so a context of 90 leaves most of it out of the window
    return build_causal_lm(arch, seed=0, attn_implementation="sdpa", vocab_size=96, hidden_size=64,
                           intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, max_position_embeddings=2048, pad_token_id=0,
                           eos_token_id=1, bos_token_id=2, **hybrid_layout(arch, 2, head_dim=16, window=16)).eval()


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test_reply_from_the_shared_context_prefill_equals_greedy_on_the_whole_prompt(arch):
    model = tiny(arch)
    prompt = torch.randint(3, 96, (110,), generator=torch.Generator().manual_seed(1)).tolist()
    ex = Example("t", 128, 0, tuple(prompt), 90, ("x",), NEW, ())
    dense = Variant("dense", model, None, "dense")
    kv = context_kv(model, torch.tensor(prompt[: ex.context_end]))
    seen = kv.get_seq_length()
    first = run_variant(dense, ex.length, ex, kv, eos=-1, settled=lambda tokens: False)["tokens"]
    assert first == hf_greedy(model, prompt, NEW)
    # every variant continues from the same cache: it is copied, never extended
    assert kv.get_seq_length() == seen
    assert run_variant(dense, ex.length, ex, kv, eos=-1, settled=lambda tokens: False)["tokens"] == first
