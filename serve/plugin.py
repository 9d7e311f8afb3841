"""SGLang plugin entry point (group ``sglang.srt.plugins``, see pyproject.toml).

SGLang calls ``register`` in the launcher before argparse, in ``sglang.Engine`` and in every
scheduler / detokenizer subprocess. It only adds the "nosa" choice and a factory; torch, nosa's
selection code and the backend are imported when SGLang builds the backend.
"""

from __future__ import annotations

BACKEND_NAME = "nosa"


def register() -> None:
    """Make ``--attention-backend nosa`` (and the prefill/decode variants) available. Idempotent."""
    from sglang.srt.arg_groups.choices import ATTENTION_BACKEND_CHOICES, add_attention_backend_choices
    from sglang.srt.layers.attention.attention_registry import register_attention_backend

    if BACKEND_NAME not in ATTENTION_BACKEND_CHOICES:
        add_attention_backend_choices([BACKEND_NAME])
    register_attention_backend(BACKEND_NAME)(create_nosa_backend)


def create_nosa_backend(model_runner):
    from nosa.serve.backend import NosaAttnBackend

    return NosaAttnBackend(model_runner)
