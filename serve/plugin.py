"""SGLang plugin entry point (group ``sglang.srt.plugins``, see pyproject.toml).

SGLang calls ``register`` in the launcher before argparse, in ``sglang.Engine`` and in every
scheduler / detokenizer subprocess. It adds the "nosa" choice and a factory (torch, nosa's
selection code and the backend are imported when SGLang builds the backend), and the request
validation hooks of nosa.serve.validate, which apply whatever the attention backend.
"""

from __future__ import annotations

from nosa.serve import cuda_graphs, validate

BACKEND_NAME = "nosa"


def register() -> None:
    """Make ``--attention-backend nosa`` (and the prefill/decode variants) available and validate
    requests at the door (nosa.serve.validate). Idempotent."""
    from sglang.srt.arg_groups.choices import ATTENTION_BACKEND_CHOICES, add_attention_backend_choices
    from sglang.srt.layers.attention.attention_registry import register_attention_backend

    if BACKEND_NAME not in ATTENTION_BACKEND_CHOICES:
        add_attention_backend_choices([BACKEND_NAME])
    register_attention_backend(BACKEND_NAME)(create_nosa_backend)
    validate.install()
    cuda_graphs.install()  # CUDA: decode graphs on, prefill graphs off where nosa serves prefill, logged
    _install_offload_hooks()


_OFFLOAD_HOOKS = []


def _install_offload_hooks() -> None:
    """With $NOSA_OFFLOAD=1: the host KV pool hooks (nosa.serve.offload.host_pool), once per process."""
    from nosa.serve.offload.settings import OffloadSettings, offload_enabled

    if offload_enabled() and not _OFFLOAD_HOOKS:
        from nosa.serve.offload.host_pool import register_hooks

        settings = OffloadSettings.from_env()
        register_hooks(settings)
        if settings.admission:  # new requests wait while admission says so (nosa.serve.offload.admission)
            from nosa.serve.offload.admission import register_hooks as register_admission_hooks

            register_admission_hooks()
        _OFFLOAD_HOOKS.append(True)


def create_nosa_backend(model_runner):
    from nosa.serve.backend import NosaAttnBackend

    return NosaAttnBackend(model_runner)
