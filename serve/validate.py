"""Request validation at SGLang's door: refuse prompts the model cannot run, before the scheduler.

SGLang 0.5.23 passes an empty prompt (``"text": ""`` with a tokenizer that adds no BOS, or a batch
row ``input_ids: [[]]``) and token ids outside the embedding table straight to the scheduler, where
the forward pass raises (rotary embedding: "cannot reshape tensor of 0 elements"; embedding:
"index out of range") and SGLang then kills every process. These checks run in the tokenizer
manager, on the same path as SGLang's own ``_validate_*`` methods, whose ValueError becomes HTTP 400
for /generate (single and batch), /v1/completions and /v1/chat/completions, so one bad request
costs its client a 400 and nobody else anything.

``install()`` registers the hooks (from nosa.serve.plugin.register, in every SGLang process);
``check_installed()`` runs when a TokenizerManager is built and fails start-up if they did not take
effect (HookRegistry only logs a target it cannot resolve).
"""

from __future__ import annotations

import os
import pkgutil
import re

_TM = "sglang.srt.managers.tokenizer_manager.TokenizerManager"
VALIDATE_TARGET = f"{_TM}._validate_one_request"  # (self, obj, input_ids): both single and batch paths
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


def _check_request(self, obj, input_ids) -> None:
    """Our checks for one (sub-)request ``obj`` of TokenizerManager ``self``."""
    # Embeddings and multimodal prompts carry placeholder ids (replaced by pad values later) or no
    # ids at all: the model's own path owns them.
    if input_ids is None or getattr(obj, "input_embeds", None) is not None:
        return
    if getattr(obj, "contains_mm_input", None) is not None and obj.contains_mm_input():
        return
    validate_prompt(input_ids, self.model_config.vocab_size)


def _around_validate(original, self, obj, input_ids):
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


def _around_str(original, self) -> str:
    """AROUND hook on RequestValidationError.__str__: FastAPI appends the endpoint's source file
    ('File "/.../http_server.py", line 928'), which SGLang returns in the 400 body."""
    return scrub_paths(original(self))


def _after_init(result, self, *args, **kwargs):
    check_installed()
    return None


def check_installed() -> None:
    """RuntimeError unless SGLang's validation and FastAPI's error text run our hooks."""
    from fastapi.exceptions import RequestValidationError
    from sglang.srt.managers.tokenizer_manager import TokenizerManager

    for target, owner, attr, hook in (
        (VALIDATE_TARGET, TokenizerManager, "_validate_one_request", _around_validate),
        (STR_TARGET, RequestValidationError, "__str__", _around_str),
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
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    if any(hook is _around_validate for _, hook, _ in HookRegistry._hooks.get(VALIDATE_TARGET, ())):
        return  # register() ran before in this process
    for target in (VALIDATE_TARGET, INIT_TARGET, STR_TARGET):
        module_class, attr = target.rsplit(".", 1)
        try:
            owner = pkgutil.resolve_name(module_class)
            getattr(owner, attr)
        except (ImportError, AttributeError) as err:
            raise SystemExit(f"nosa plugin: cannot hook {target} ({err}); this SGLang is not the "
                             "pinned 0.5.23. SGLANG_PLUGINS=none disables the nosa plugin.") from err
    HookRegistry.register(VALIDATE_TARGET, _around_validate, HookType.AROUND)
    HookRegistry.register(INIT_TARGET, _after_init, HookType.AFTER)
    HookRegistry.register(STR_TARGET, _around_str, HookType.AROUND)
