"""Validation at SGLang's door (nosa.serve.validate, registered by the plugin): requests that used to
kill the whole server get HTTP 400 and the next request is served with the same tokens.

One server, the session's ``native_server`` (tests/serve/conftest.py: SGLang's own torch_native
backend, radix cache off): the hooks are on SGLang's request path, so they protect every backend
(tests/serve/test_sglang_backend.py and scripts/soak.py run the nosa backend). The hook logic itself
is also tested in-process, without a server.
"""

from __future__ import annotations

import json
import sys
import types

import pytest

pytest.importorskip("sglang")
from nosa.bench import tiny_checkpoint as tiny  # noqa: E402
from nosa.serve import validate  # noqa: E402

PROBE = tiny.prompt_ids(40, 3)
SP = {"max_new_tokens": 4}

# (name, path, body, what the message must say): each of these crashed the scheduler of SGLang
# 0.5.23 (and every process with it) or was answered unlike a close variant of the same mistake; each
# must now get HTTP 400 with a message saying what is wrong.
CRASHERS = [
    ("batch with an empty row", "/generate", {"input_ids": [[]], "sampling_params": SP}, "no tokens"),
    ("batch: good row, empty row", "/generate", {"input_ids": [[1, 2], []], "sampling_params": SP}, "no tokens"),
    ("id = vocab_size", "/generate", {"input_ids": [5, tiny.VOCAB], "sampling_params": SP},
     f"input_ids[1] = {tiny.VOCAB} is outside the model's vocabulary [0, {tiny.VOCAB})"),
    ("negative id", "/generate", {"input_ids": [5, 6, -1], "sampling_params": SP}, "input_ids[2] = -1"),
    ("batch row out of vocabulary", "/generate",
     {"input_ids": [[1, 2], [3, tiny.VOCAB + 9]], "sampling_params": SP}, f"= {tiny.VOCAB + 9} is outside"),
    ("completions: id out of vocabulary", "/v1/completions",
     {"model": "m", "prompt": [1, 2, 4000], "max_tokens": 4}, "input_ids[2] = 4000"),
    ("completions: batch row negative", "/v1/completions",
     {"model": "m", "prompt": [[1, 2], [-3]], "max_tokens": 4}, "input_ids[0] = -3"),
    # logprobs: top-k over the vocabulary with k > vocab raised "selected index k out of range" in the
    # sampler, on every route that asks for top logprobs
    ("top_logprobs_num = vocab + 1", "/generate",
     {"input_ids": [5, 6], "return_logprob": True, "top_logprobs_num": tiny.VOCAB + 1, "sampling_params": SP},
     f"top_logprobs_num = {tiny.VOCAB + 1} must be in [0, {tiny.VOCAB}]"),
    ("top_logprobs_num huge, n = 2", "/generate",
     {"input_ids": [5, 6], "return_logprob": True, "top_logprobs_num": 10**9,
      "sampling_params": {"max_new_tokens": 2, "n": 2}}, "top_logprobs_num = 1000000000"),
    ("top_logprobs_num per batch row", "/generate",
     {"input_ids": [[5, 6], [7, 8]], "return_logprob": True, "top_logprobs_num": [1, tiny.VOCAB + 1],
      "sampling_params": SP}, f"top_logprobs_num = {tiny.VOCAB + 1}"),
    ("top_logprobs_num negative", "/generate",
     {"input_ids": [5, 6], "return_logprob": True, "top_logprobs_num": -2, "sampling_params": SP},
     "top_logprobs_num = -2"),
    ("completions: logprobs above the vocabulary", "/v1/completions",
     {"model": "m", "prompt": [1, 2], "max_tokens": 2, "logprobs": tiny.VOCAB + 1},
     f"top_logprobs_num = {tiny.VOCAB + 1}"),
    ("chat: top_logprobs above the vocabulary", "/v1/chat/completions",
     {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "logprobs": True,
      "top_logprobs": tiny.VOCAB + 1}, "`top_logprobs` in /v1/chat/completions"),
    ("logprob_start_len below -1", "/generate",
     {"input_ids": [5, 6], "return_logprob": True, "logprob_start_len": -5, "sampling_params": SP},
     "logprob_start_len = -5 must be -1"),
    ("logprob_start_len past the prompt", "/generate",
     {"input_ids": [[5, 6], [7, 8, 9]], "return_logprob": True, "logprob_start_len": [0, 4], "sampling_params": SP},
     "logprob_start_len = 4 must be -1 (no prompt logprobs) or in [0, the prompt's 3 tokens]"),
    ("token_ids_logprob outside the vocabulary (SGLang's own check)", "/generate",
     {"input_ids": [5, 6], "return_logprob": True, "token_ids_logprob": [tiny.VOCAB], "sampling_params": SP},
     "token_ids_logprob"),
    # input_embeds (this server runs --disable-radix-cache, which SGLang asks for with them): the model
    # runner casts them to bfloat16, so on this float32 model even well-formed rows crashed the scheduler
    ("input_embeds on a float32 model", "/generate",
     {"input_embeds": [[0.1] * tiny.HIDDEN] * 3, "sampling_params": SP},
     "input_embeds needs a model served in bfloat16"),
    ("input_embeds empty (was a 500)", "/generate", {"input_embeds": [], "sampling_params": SP},
     "input_embeds is empty"),
    ("input_embeds with an empty row (was a 500)", "/generate", {"input_embeds": [[]], "sampling_params": SP},
     "input_embeds[0] is empty"),
    ("input_embeds ragged", "/generate", {"input_embeds": [[0.1] * tiny.HIDDEN, [0.1] * 5], "sampling_params": SP},
     "input_embeds"),
]


@pytest.fixture(scope="module")
def server(native_server):
    return native_server.wait_ready()


@pytest.fixture(scope="module")
def probe_tokens(server) -> list[int]:
    """The PROBE prompt's tokens before any malformed request: every later answer must equal them."""
    return server.generate(PROBE, 8)


@pytest.mark.parametrize("name,path,body,says", CRASHERS, ids=[c[0] for c in CRASHERS])
def test_crashing_request_gets_400_and_the_server_keeps_serving(server, probe_tokens, name, path, body, says):
    status, answer = server.post(path, body)
    assert status == 400, (status, answer)
    assert says in json.dumps(answer), answer
    assert server.generate(PROBE, 8) == probe_tokens


def test_empty_text_is_one_bos_token_and_is_served(server, probe_tokens):
    """The issue's first crasher: with a BOS-adding tokenizer "" is a one-token prompt."""
    status, body = server.post("/generate", {"text": "", "sampling_params": {"max_new_tokens": 3, "temperature": 0}})
    assert status == 200, body
    assert body["meta_info"]["prompt_tokens"] == 1
    assert server.generate(PROBE, 8) == probe_tokens


def _tokenizer(server):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(server.model_path)


def test_text_is_encoded_with_bos(server):
    prompt = _tokenizer(server)("hello")["input_ids"]
    assert prompt[0] == 256 and len(prompt) == 6  # <s> and one byte-level token per letter
    params = {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True}
    status, by_text = server.post("/generate", {"text": "hello", "sampling_params": params})
    assert status == 200, by_text
    assert by_text["meta_info"]["prompt_tokens"] == 6
    assert by_text["output_ids"] == server.generate(prompt, 5)


def test_400_bodies_show_no_server_paths(server):
    """FastAPI's validation errors name the endpoint's source file; SGLang returns them in the body."""
    for body in ('{"input_ids": [1, 2', {"input_ids": "abc"}, {"text": 5}):
        status, answer = _raw(server, body) if isinstance(body, str) else server.post("/generate", body)
        assert status == 400, answer
        text = json.dumps(answer)
        assert sys.prefix not in text and "site-packages" not in text, text
        assert "validation error" in text  # the useful part of the message is kept


def test_chat_completions_answer_with_the_shipped_template(server):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    status, body = server.post("/v1/chat/completions", {"model": "m", "max_tokens": 4, "temperature": 0,
                                                        "messages": messages})
    assert status == 200, body
    assert body["choices"][0]["message"]["role"] == "assistant"
    assert body["usage"]["completion_tokens"] >= 1
    ids = _tokenizer(server).apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                 return_dict=False)
    assert ids[0] == 256 and ids.count(256) == 1  # one BOS, from the template
    assert body["usage"]["prompt_tokens"] == len(ids)


def _raw(server, text: str):
    import urllib.error
    import urllib.request

    req = urllib.request.Request(server.url + "/generate", data=text.encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


# ---- the hook logic, in-process ----------------------------------------------------------------
@pytest.mark.parametrize("ids,says", [
    ([], "no tokens"), ([0, 319], None), ([0, 320], "input_ids[1] = 320"), ([-1], "input_ids[0] = -1"),
    ([3, 2**63 - 1], "input_ids[1] = 9223372036854775807"), ([1, "a"], "must be integers, got str"),
    ([[1], [2]], "must be integers, got list"),
])
def test_validate_prompt(ids, says):
    if says is None:
        validate.validate_prompt(ids, 320)
    else:
        with pytest.raises(ValueError, match=says.replace("[", r"\[")):
            validate.validate_prompt(ids, 320)


def _request(**fields):
    base = {"return_logprob": True, "top_logprobs_num": 0, "logprob_start_len": -1}
    return types.SimpleNamespace(**dict(base, **fields))


@pytest.mark.parametrize("fields,prompt,says", [
    ({"top_logprobs_num": 320}, 3, None), ({"top_logprobs_num": 321}, 3, "top_logprobs_num = 321"),
    ({"top_logprobs_num": 321, "return_logprob": False}, 3, None),  # SGLang ignores it then
    ({"top_logprobs_num": "5"}, 3, "must be an integer, got str"), ({"top_logprobs_num": True}, 3, "integer"),
    ({"logprob_start_len": 3}, 3, None), ({"logprob_start_len": 0}, 3, None),
    ({"logprob_start_len": 4}, 3, "logprob_start_len = 4"), ({"logprob_start_len": -2}, 3, "= -2"),
    ({"logprob_start_len": 7}, None, None),  # multimodal: the length is not known at the door
])
def test_validate_logprobs(fields, prompt, says):
    if says is None:
        validate.validate_logprobs(_request(**fields), prompt, 320)
    else:
        with pytest.raises(ValueError, match=says):
            validate.validate_logprobs(_request(**fields), prompt, 320)


@pytest.mark.parametrize("embeds,dtype,says", [
    ([[0.0] * 4] * 2, "bfloat16", None), ([[0.0] * 4] * 2, "float32", "needs a model served in bfloat16"),
    ([], "bfloat16", "is empty"), ([[0.0] * 4, [0.0] * 3], "bfloat16", r"input_embeds\[1\] has 3 values"),
    ([[]], "bfloat16", r"input_embeds\[0\] has 0 values"), ([1.0, 2.0], "bfloat16", "has float values"),
])
def test_validate_input_embeds(embeds, dtype, says):
    """The per-request check (after SGLang split a batch): width, emptiness, the model's dtype."""
    import torch

    if says is None:
        validate.validate_input_embeds(embeds, 4, getattr(torch, dtype))
    else:
        with pytest.raises(ValueError, match=says):
            validate.validate_input_embeds(embeds, 4, getattr(torch, dtype))


@pytest.mark.parametrize("embeds,says", [
    ([[0.5, 1]], None), ([[[0.5]], [[1.0]]], None), ([], r"input_embeds is empty"),
    ([[]], r"input_embeds\[0\] is empty"), ([[[]]], r"input_embeds\[0\]\[0\] is empty"),
    ([1.0], "must be rows of numbers"), ([[["a"]]], "must be rows of numbers"), ([[[[1.0]]]], "rows of numbers"),
])
def test_check_embeds_shape(embeds, says):
    """The shape check that runs before SGLang indexes input_embeds[0][0] to find the batch size."""
    if says is None:
        validate.check_embeds_shape(embeds)
    else:
        with pytest.raises(ValueError, match=says):
            validate.check_embeds_shape(embeds)


def test_scrub_paths_keeps_the_message():
    msg = 'bad\n  File "/work/main/.venv/lib/python3.11/site-packages/sglang/srt/x.py", line 9, in f'
    assert validate.scrub_paths(msg) == 'bad\n  File "<path>/x.py", line 9, in f'
    assert validate.scrub_paths("top_p must be in (0, 1], got 2.") == "top_p must be in (0, 1], got 2."
    assert validate.scrub_paths("tokens/s and a/b") == "tokens/s and a/b"


def test_hooks_apply_and_the_start_up_check_sees_them():
    """install() + HookRegistry.apply_hooks() (what load_plugins does): the check passes and
    SGLang's _validate_one_request now refuses out-of-vocabulary ids."""
    from sglang.srt.managers.tokenizer_manager import TokenizerManager
    from sglang.srt.plugins.hook_registry import HookRegistry

    validate.install()
    validate.install()  # idempotent: one hook per target
    assert sum(h is validate.around_validate for _, h, _ in HookRegistry._hooks[validate.VALIDATE_TARGET]) == 1
    HookRegistry.apply_hooks()
    validate.check_installed()
    fake = types.SimpleNamespace(model_config=types.SimpleNamespace(vocab_size=10))
    obj = types.SimpleNamespace(input_embeds=None, contains_mm_input=lambda: False)
    with pytest.raises(ValueError, match=r"input_ids\[1\] = 10 is outside"):
        TokenizerManager._validate_one_request(fake, obj, [1, 10])
    with pytest.raises(ValueError, match="no tokens"):
        TokenizerManager._validate_one_request(fake, obj, [])


def test_start_up_check_fails_loudly_when_a_hook_is_missing(monkeypatch):
    from sglang.srt.managers.tokenizer_manager import TokenizerManager

    monkeypatch.setattr(TokenizerManager, "_validate_one_request", lambda self, obj, ids: None)
    with pytest.raises(RuntimeError, match="did not take effect"):
        validate.check_installed()


def test_install_exits_when_sglang_lacks_the_target(monkeypatch):
    monkeypatch.setattr(validate, "VALIDATE_TARGET", validate.VALIDATE_TARGET + "_gone")
    with pytest.raises(SystemExit, match="cannot hook .*_validate_one_request_gone"):
        validate.install()
