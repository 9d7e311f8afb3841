"""SGLang plugin entry point (group ``sglang.srt.plugins``, see pyproject.toml).

SGLang calls ``register`` in the launcher before argparse, in ``sglang.Engine`` and in every
scheduler / detokenizer subprocess. It adds the "nosa" choice and a factory (torch, nosa's
selection code and the backend are imported when SGLang builds the backend), the request
validation hooks of nosa.serve.validate, which apply whatever the attention backend, SGLang's
tensor-parallel start-up on CPU (nosa.serve.parallel), and the NOSA
checkpoint format (nosa.checkpoint_format): its model types for transformers' AutoConfig, through
which SGLang reads config.json, and its architectures for SGLang's model registry.
"""

from __future__ import annotations

from nosa.after_import import when_imported
from nosa.checkpoint_format import MODEL_TYPES
from nosa.serve import cuda_graphs, parallel, startup, validate
from nosa.serve.offload import admission
from nosa.serve.offload.settings import OffloadSettings, offload_enabled

BACKEND_NAME = "nosa"
_MODEL_REGISTRY = "sglang.srt.models.registry"


def register() -> None:
    """Make ``--attention-backend nosa`` (and the prefill/decode variants) available and validate
    requests at the door (nosa.serve.validate). Idempotent."""
    from sglang.srt.arg_groups.choices import (  # optional: sglang (SGLang calls this; nosa never imports it)
        ATTENTION_BACKEND_CHOICES,
        add_attention_backend_choices,
    )
    from sglang.srt.layers.attention.attention_registry import register_attention_backend  # optional: sglang

    if BACKEND_NAME not in ATTENTION_BACKEND_CHOICES:
        add_attention_backend_choices([BACKEND_NAME])
    register_attention_backend(BACKEND_NAME)(create_nosa_backend)
    validate.install()
    cuda_graphs.install()  # CUDA: decode graphs on, prefill graphs off where nosa serves prefill, logged
    parallel.install()  # CPU only: --tp-size N starts without PyNccl (SGLang asks for it regardless)
    startup.install()  # offloading settings that cannot work stop the launcher, before any scheduler starts
    _install_offload_hooks()
    _register_checkpoint_format()


def _register_checkpoint_format() -> None:
    """NOSA checkpoints have model_type nosa_llama (nosa_qwen2, nosa_qwen3, nosa_gemma3_text) and
    architecture NosaLlamaForCausalLM (...). AutoConfig learns the model types now; SGLang's model
    registry learns the architectures once it is imported (importing it loads every SGLang model,
    which only the scheduler needs), served by SGLang's own Llama / Qwen2 / Qwen3 / Gemma 3 classes:
    the eviction heads are the backend's (nosa.serve.checkpoint)."""
    from nosa.hf_configs import register as register_configs  # optional: transformers (nosa.hf_configs')

    register_configs()
    when_imported(_MODEL_REGISTRY, _add_architectures, quiet=_MODEL_REGISTRY)


def _add_architectures() -> None:
    from sglang.srt.models.gemma3_causal import Gemma3ForCausalLM  # optional: sglang (once its registry loads)
    from sglang.srt.models.llama import LlamaForCausalLM  # optional: sglang
    from sglang.srt.models.qwen2 import Qwen2ForCausalLM  # optional: sglang
    from sglang.srt.models.qwen3 import Qwen3ForCausalLM  # optional: sglang
    from sglang.srt.models.registry import ModelRegistry  # optional: sglang

    served_by = {"llama": LlamaForCausalLM, "qwen2": Qwen2ForCausalLM, "qwen3": Qwen3ForCausalLM,
                 "gemma3_text": _without_eviction_heads(Gemma3ForCausalLM)}
    for base, model_class in served_by.items():
        ModelRegistry.models[MODEL_TYPES[base].architecture] = model_class


def _without_eviction_heads(model_class):
    """``model_class`` whose weight loader never sees the checkpoint's eviction-head tensors (SGLang's
    Llama and Qwen loaders skip unknown names; its Gemma 3 loader raises KeyError on them)."""
    from nosa.eviction import MODULE_NAME  # optional: torch (nosa.eviction's; the plugin itself imports none)

    def load_weights(self, weights):
        return model_class.load_weights(self, ((n, w) for n, w in weights if f".{MODULE_NAME}." not in n))

    return type(model_class.__name__, (model_class,), {"load_weights": load_weights, "__module__": __name__})


_OFFLOAD_HOOKS = []


def _install_offload_hooks() -> None:
    """With $NOSA_OFFLOAD=1: the host KV pool hooks (nosa.serve.offload.host_pool), once per process."""
    if offload_enabled() and not _OFFLOAD_HOOKS:
        from nosa.serve.offload import host_pool  # optional: sglang (HostKVPool subclasses its KV pool)

        settings = OffloadSettings.from_env()
        host_pool.register_hooks(settings)
        if settings.admission:  # new requests wait while admission says so (nosa.serve.offload.admission)
            admission.register_hooks()
        _OFFLOAD_HOOKS.append(True)


def create_nosa_backend(model_runner):
    from nosa.serve.backend import NosaAttnBackend  # optional: sglang (imported when SGLang builds the backend)

    return NosaAttnBackend(model_runner)
