"""Request validation at SGLang's door: refuse requests the model cannot run, before the scheduler.

SGLang 0.5.23 passes these to the scheduler, where the forward pass raises and SGLang kills every
process (tests/serve/test_validation.py): an empty prompt; token ids outside the embedding table;
``top_logprobs_num`` above the vocabulary size; ``input_embeds`` ragged, not ``hidden_size`` wide,
on a model not served in bfloat16, or empty (an HTTP 500); ``logprob_start_len`` below -1 or past
the prompt. The checks run in the tokenizer manager beside SGLang's own ``_validate_*``, whose
ValueError becomes HTTP 400 for /generate, /v1/completions and /v1/chat/completions; messages
leave without server-side paths. ``install()`` registers the hooks (the plugin, every process);
``check_installed()`` fails start-up when a TokenizerManager is built and they did not take effect
(HookRegistry only logs a target it cannot resolve).
"""

from __future__ import annotations

import os
import pkgutil
import re

import torch

_TM = "sglang.srt.managers.tokenizer_manager.TokenizerManager"
VALIDATE_TARGET = f"{_TM}._validate_one_request"  # (self, obj, input_ids): both single and batch paths
# (self): where a /generate body becomes single or batch; it indexes input_embeds[0][0] unchecked
NORMALIZE_TARGET = "sglang.srt.managers.io_struct.GenerateReqInput.normalize_batch_and_arguments"
INIT_TARGET = f"{_TM}.__init__"  # where the start-up check runs, in the process that serves HTTP
# Malformed JSON and wrong types: FastAPI's exception, whose text SGLang puts in the 400 body.
STR_TARGET = "fastapi.exceptions.RequestValidationError.__str__"

# An absolute path inside a message (e.g. "/work/venv/.../foo.py" or "C:\\x\\y"): a client has no
# use for the server's file layout. Two components at least, so "a/b" in prose is left alone.
_PATH = re.compile(r"(?<![\w.:/])(?:/[\w.@+-]+){2,}/?|[A-Za-z]:\\[\w.\\ -]+")


def validate_prompt(input_ids, vocab_size: int) -> None:
    """Raise ValueError (-> HTTP 400) if the tokenized prompt is empty or holds an id outside
    [0, vocab_size). ``input_ids``: list[int] of one request, [T]. min/max run in C: about 0.3 ms
    for 6000 ids on a loaded 2-core CPU, ~1e-4 of a request's latency (scripts/soak.py reports it)."""
    if len(input_ids) == 0:
        raise ValueError("the prompt has no tokens (empty input_ids, or text that tokenizes to "
                         "nothing): send at least one token")
    try:  # nested lists compare with each other, but not with 0: both raise TypeError
        outside = min(input_ids) < 0 or max(input_ids) >= vocab_size
    except TypeError:
        bad = next(x for x in input_ids if not isinstance(x, int))
        raise ValueError(f"input_ids must be integers, got {type(bad).__name__} {bad!r}") from None
    if outside:
        index, value = next((i, x) for i, x in enumerate(input_ids) if x < 0 or x >= vocab_size)
        raise ValueError(f"input_ids[{index}] = {value} is outside the model's vocabulary "
                         f"[0, {vocab_size}) (prompt of {len(input_ids)} tokens)")


def scrub_paths(message: str) -> str:
    """``message`` with absolute server-side paths replaced by their file name."""
    return _PATH.sub(lambda m: "<path>/" + os.path.basename(m.group(0).rstrip("/\\")), message)


def validate_logprobs(obj, prompt_tokens: int | None, vocab_size: int) -> None:
    """Raise ValueError (-> HTTP 400) naming the field if a logprob request cannot be computed.
    Only requests with ``return_logprob`` are checked: SGLang ignores these fields otherwise.
    ``prompt_tokens``: the prompt's length, or None when unknown (multimodal placeholders)."""
    if not getattr(obj, "return_logprob", False):
        return
    top = getattr(obj, "top_logprobs_num", None)
    if top is not None:
        if isinstance(top, bool) or not isinstance(top, int):
            raise ValueError(f"top_logprobs_num must be an integer, got {type(top).__name__} {top!r}")
        if not 0 <= top <= vocab_size:
            raise ValueError(
                f"top_logprobs_num = {top} must be in [0, {vocab_size}], the model's vocabulary size "
                "(it is `logprobs` in /v1/completions and `top_logprobs` in /v1/chat/completions)")
    start = getattr(obj, "logprob_start_len", None)
    if start is not None:
        if isinstance(start, bool) or not isinstance(start, int):
            raise ValueError(f"logprob_start_len must be an integer, got {type(start).__name__} {start!r}")
        if start < -1 or (prompt_tokens is not None and start > prompt_tokens):
            limit = "the prompt's length" if prompt_tokens is None else f"the prompt's {prompt_tokens} tokens"
            raise ValueError(f"logprob_start_len = {start} must be -1 (no prompt logprobs) or in [0, {limit}]")


def validate_input_embeds(embeds, hidden_size: int, dtype) -> None:
    """Raise ValueError (-> HTTP 400) unless ``embeds`` is a non-empty [T, hidden_size] list of
    numbers that this model can take: SGLang 0.5.23's model runner casts input_embeds to bfloat16,
    so a model served in another dtype cannot use them at all."""
    if dtype != torch.bfloat16:
        raise ValueError(
            f"input_embeds needs a model served in bfloat16 (SGLang casts them to bfloat16); this one "
            f"runs in {str(dtype).replace('torch.', '')}: send input_ids or text, or serve with --dtype bfloat16")
    if not isinstance(embeds, list) or not embeds:
        raise ValueError("input_embeds is empty: send at least one row of hidden_size numbers")
    for i, row in enumerate(embeds):
        if not isinstance(row, list) or len(row) != hidden_size:
            width = len(row) if isinstance(row, list) else type(row).__name__
            raise ValueError(f"input_embeds[{i}] has {width} values; every row needs hidden_size = {hidden_size}")


def check_embeds_shape(embeds) -> None:
    """Raise ValueError unless ``embeds`` is [T, H] (one request) or [B, T, H] (a batch) of numbers
    with no empty level: SGLang reads ``embeds[0][0]`` to tell the two apart."""
    level, depth = embeds, 0
    while isinstance(level, list):
        if not level:
            where = "input_embeds" + "[0]" * depth
            raise ValueError(f"{where} is empty: send at least one row of hidden_size numbers")
        level, depth = level[0], depth + 1
    if depth not in (2, 3) or isinstance(level, bool) or not isinstance(level, (int, float)):
        raise ValueError("input_embeds must be rows of numbers: [tokens][hidden_size], or "
                         "[requests][tokens][hidden_size] for a batch")


def _check_request(self, obj, input_ids) -> None:
    """Our checks for one (sub-)request ``obj`` of TokenizerManager ``self``."""
    config = self.model_config
    embeds = getattr(obj, "input_embeds", None)
    if embeds is not None:  # the ids are placeholders: the embeddings are the prompt
        validate_input_embeds(embeds, config.hidden_size, config.dtype)
        prompt_tokens = len(embeds)
    elif getattr(obj, "contains_mm_input", None) is not None and obj.contains_mm_input():
        prompt_tokens = None  # placeholder ids, replaced by pad values later: the model's path owns them
    elif input_ids is None:
        return
    else:
        validate_prompt(input_ids, config.vocab_size)
        prompt_tokens = len(input_ids)
    validate_logprobs(obj, prompt_tokens, config.vocab_size)


def around_validate(original, self, obj, input_ids):
    """AROUND hook on TokenizerManager._validate_one_request(self, obj, input_ids): our checks,
    then SGLang's; messages leave without server-side paths."""
    _check_request(self, obj, input_ids)
    try:
        return original(self, obj, input_ids)
    except ValueError as err:
        clean = scrub_paths(str(err))
        if clean == str(err):
            raise
        raise ValueError(clean) from None


def around_normalize(original, self):
    """AROUND hook on GenerateReqInput.normalize_batch_and_arguments(self): the shape of
    input_embeds before SGLang indexes it (its ValueError is a 400 there too)."""
    if self.input_embeds is not None:
        check_embeds_shape(self.input_embeds)
    return original(self)


def around_str(original, self) -> str:
    """AROUND hook on RequestValidationError.__str__: FastAPI appends the endpoint's source file
    ('File "/.../http_server.py", line 928'), which SGLang returns in the 400 body."""
    return scrub_paths(original(self))


def after_init(result, self, *args, **kwargs):
    check_installed()
    return None


def check_installed() -> None:
    """RuntimeError unless SGLang's validation and FastAPI's error text run our hooks."""
    from fastapi.exceptions import RequestValidationError  # optional: fastapi (SGLang's HTTP server)
    from sglang.srt.managers.io_struct import GenerateReqInput  # optional: sglang
    from sglang.srt.managers.tokenizer_manager import TokenizerManager  # optional: sglang

    for target, owner, attr, hook in (
        (VALIDATE_TARGET, TokenizerManager, "_validate_one_request", around_validate),
        (NORMALIZE_TARGET, GenerateReqInput, "normalize_batch_and_arguments", around_normalize),
        (STR_TARGET, RequestValidationError, "__str__", around_str),
    ):
        if not _wraps(owner.__dict__.get(attr), hook):
            raise RuntimeError(
                f"nosa plugin: the hook on {target} did not take effect (see the 'Failed to apply "
                "hooks' log line above; SGLang version changed?). Refusing to serve without it: "
                "empty or out-of-vocabulary prompts would crash the scheduler. SGLANG_PLUGINS=none "
                "disables the nosa plugin entirely.")


def _wraps(fn, hook) -> bool:
    """Is ``fn`` a HookRegistry wrapper chain that calls ``hook``? (The wrapper keeps the hook in
    its closure and the next function in ``__wrapped__``.)"""
    while fn is not None:
        if any(getattr(c, "cell_contents", None) is hook for c in (fn.__closure__ or ())):
            return True
        fn = getattr(fn, "__wrapped__", None)
    return False


def install() -> None:
    """Register the hooks with SGLang's HookRegistry (applied by load_plugins after register()).
    Exits if a target does not exist in this SGLang: a plugin exception would only be logged."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType  # optional: sglang

    if any(hook is around_validate for _, hook, _ in HookRegistry._hooks.get(VALIDATE_TARGET, ())):
        return  # register() ran before in this process
    for target in (VALIDATE_TARGET, NORMALIZE_TARGET, INIT_TARGET, STR_TARGET):
        module_class, attr = target.rsplit(".", 1)
        try:
            owner = pkgutil.resolve_name(module_class)
            getattr(owner, attr)
        except (ImportError, AttributeError) as err:
            raise SystemExit(f"nosa plugin: cannot hook {target} ({err}); this SGLang is not the "
                             "pinned 0.5.23. SGLANG_PLUGINS=none disables the nosa plugin.") from err
    HookRegistry.register(VALIDATE_TARGET, around_validate, HookType.AROUND)
    HookRegistry.register(NORMALIZE_TARGET, around_normalize, HookType.AROUND)
    HookRegistry.register(INIT_TARGET, after_init, HookType.AFTER)
    HookRegistry.register(STR_TARGET, around_str, HookType.AROUND)
