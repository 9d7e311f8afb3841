"""The long-context suite's prompts (nosa.train.ruler) as OpenAI chat requests to a server.

An example's ``prompt_ids`` are one chat turn through the model's template followed by the start of
the assistant's reply (RULER's answer prefix, "The pass key is"). The chat API carries the same
prompt as two messages: the user's message, and a final assistant message holding the prefix with
``"continue_final_message": true`` (an extension of the OpenAI API that SGLang and vLLM share).
SGLang then renders the template with the generation prompt and appends the prefix's tokens
without closing the turn, so the reply continues the prefix. ``chat_messages`` recovers both texts
from the ids and checks that they give back exactly those ids, so the server sees the prompt that
the suite (scripts/bench_longctx.py) and the HF model see.
"""

from __future__ import annotations

import json
import os
import urllib.request

from nosa.bench.longctx.suites import NosaSuite
from nosa.chat import chat_ids, chat_text
from nosa.config import CONFIG_KEY


def suite_examples(tokenizer, tasks, length: int, per_task: int, seed: int = 0) -> list:
    """``per_task`` examples of each task at ``length`` tokens over the held-out prose: the same
    examples as ``scripts/bench_longctx.py --seed`` (default 0) for that length."""
    return NosaSuite(tasks).examples(tokenizer, "", length, per_task, seed)


def chat_messages(tokenizer, prompt_ids) -> list[dict]:
    """[user message, assistant answer prefix] whose rendering is ``prompt_ids``.

    Raises ValueError when the ids are not one user turn of the tokenizer's template plus a prefix,
    or when the two texts tokenise to other ids than these."""
    marker = "\x00MESSAGE\x00"  # text no prompt holds: splits the rendered template around the message
    head, _, tail = chat_text(tokenizer, marker).partition(marker)
    text = tokenizer.decode(list(prompt_ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)
    cut = text.rfind(tail)
    if not text.startswith(head) or cut < len(head):
        raise ValueError("chat_messages: the prompt is not one user turn of the tokenizer's chat template")
    message, prefix = text[len(head):cut], text[cut + len(tail):]
    again = chat_ids(tokenizer, message) + tokenizer.encode(prefix, add_special_tokens=False)
    if again != list(prompt_ids):
        raise ValueError(f"chat_messages: message and prefix ({prefix!r}) tokenise to other ids than the prompt "
                         f"({len(again)} ids against {len(prompt_ids)})")
    return [{"role": "user", "content": message}, {"role": "assistant", "content": prefix}]


def ask_chat(url: str, model: str, messages: list[dict], max_tokens: int) -> dict:
    """Greedy reply through ``/v1/chat/completions`` continuing the final assistant message:
    ``{"reply", "served_prompt_tokens", "completion_tokens", "finish_reason"}`` (the prompt's length
    as the server tokenised it). Uses the ``openai`` client
    when SGLang brought it, else plain HTTP (the same request)."""
    extra = {"continue_final_message": True}
    try:
        from openai import OpenAI  # optional: openai (SGLang brings it; else plain HTTP)
    except ImportError:
        body = json.dumps({"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
                           **extra}).encode()
        req = urllib.request.Request(url + "/v1/chat/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=3600) as r:
            out = json.loads(r.read())
        choice, usage = out["choices"][0], out["usage"]
        return {"reply": choice["message"]["content"], "served_prompt_tokens": usage["prompt_tokens"],
                "completion_tokens": usage["completion_tokens"], "finish_reason": choice["finish_reason"]}
    client = OpenAI(base_url=url + "/v1", api_key="none", timeout=3600, max_retries=0)
    out = client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens, temperature=0,
                                         extra_body=extra)
    choice = out.choices[0]
    return {"reply": choice.message.content, "served_prompt_tokens": out.usage.prompt_tokens,
            "completion_tokens": out.usage.completion_tokens, "finish_reason": choice.finish_reason}


def suite_view(checkpoint: str, config, out_dir: str) -> str:
    """A checkpoint directory that serves ``checkpoint`` (its weights and eviction heads) at another
    NosaConfig: every file linked, config.json rewritten with ``config`` as its "nosa" section. The
    suite runs each checkpoint at its own budget for the length (``budget_config`` in
    nosa.bench.longctx.config), and the eviction heads do not depend on the budget. Returns ``out_dir``."""
    os.makedirs(out_dir, exist_ok=True)
    source = os.path.abspath(checkpoint)
    for name in os.listdir(source):
        if name != "config.json" and not os.path.isdir(os.path.join(source, name)):
            link = os.path.join(out_dir, name)
            if os.path.lexists(link):
                os.remove(link)
            os.symlink(os.path.join(source, name), link)
    with open(os.path.join(source, "config.json")) as f:
        data = json.load(f)
    if CONFIG_KEY not in data:
        raise ValueError(f"suite_view: {checkpoint} is not a NOSA checkpoint (no '{CONFIG_KEY}' in config.json); "
                         "convert it first (nosa.convert, then save_pretrained)")
    data[CONFIG_KEY] = config.to_dict()
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(data, f, indent=2)
    return out_dir
