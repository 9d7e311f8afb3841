"""Talking to a chat model: a user message through the tokenizer's chat template, and a greedy reply.

The prompt is what SGLang's ``/v1/chat/completions`` builds: the template rendered as text (with the
generation prompt), then tokenised without adding special tokens again (the template already
starts with the model's own ``<|im_start|>``-style token).

A base model (Gemma 3 270M) has no chat template: its "turn" is RULER's ``base`` template, the
model's ``<bos>`` then the message as plain text, and a newline where a chat model's reply starts.
"""

from __future__ import annotations

import torch


def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def chat_text(tokenizer, message: str) -> str:
    """A one-turn chat as text: the template's default system turn, ``message`` as the user, then
    the assistant's generation prompt. Without a chat template (a base model): ``<bos>``, the
    message, a newline."""
    if not has_chat_template(tokenizer):
        return (tokenizer.bos_token or "") + message + "\n"
    return tokenizer.apply_chat_template([{"role": "user", "content": message}], tokenize=False,
                                         add_generation_prompt=True)


def chat_ids(tokenizer, message: str) -> list[int]:
    """Token ids of ``chat_text``."""
    return tokenizer(chat_text(tokenizer, message), add_special_tokens=False)["input_ids"]


@torch.no_grad()
def greedy_reply(model, tokenizer, message: str, max_new_tokens: int = 24) -> str:
    """The model's greedy reply to ``message`` (special tokens removed, stripped)."""
    ids = torch.tensor([chat_ids(tokenizer, message)], device=next(model.parameters()).device)
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                         do_sample=False, pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id)
    return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True).strip()
