"""transformers causal-LM classes of the NOSA model types, and the two ways to get a NOSA model.

``NosaLlamaForCausalLM`` (``NosaQwen2ForCausalLM``, ``NosaQwen3ForCausalLM``,
``NosaGemma3ForCausalLM``) is the base causal LM whose construction adds an eviction head to every
full-attention module (a hybrid model's sliding-window layers stay as they are) and whose attention
defaults to "nosa". ``AutoModelForCausalLM.from_pretrained`` of a NOSA checkpoint therefore builds
it and loads the eviction heads like any other weight, once the types are registered (``register``,
run when this module is imported, which ``import nosa`` arranges once transformers has built its
Auto classes) or through ``trust_remote_code=True`` (nosa.checkpoint_format).

``convert(model, config)`` turns a loaded base model into its NOSA class in place;
``from_pretrained(path)`` loads a NOSA, legacy NOSA or dense checkpoint as a NOSA model.
"""

from __future__ import annotations

import torch
import transformers.initialization as init
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    Gemma3ForCausalLM,
    LlamaForCausalLM,
    Qwen2ForCausalLM,
    Qwen3ForCausalLM,
)
from transformers.utils import logging as hf_logging

from nosa.checkpoint_format import BY_NAME, MODEL_TYPES
from nosa.config import CONFIG_KEY, NosaConfig
from nosa.eviction import MODULE_NAME, EvictionHead
from nosa.hf import ATTN_IMPLEMENTATION, SUPPORTED_MODEL_TYPES, add_eviction_heads, nosa_config_of
from nosa.hf import register as register_attention
from nosa.hf_configs import CONFIG_CLASSES, NosaGemma3TextConfig, NosaLlamaConfig, NosaQwen2Config, NosaQwen3Config
from nosa.hf_configs import register as register_configs


class NosaCausalLM:
    """What a NOSA causal-LM class adds to its base class (listed first among the bases)."""

    def __init__(self, config, *args, **kwargs):
        register_attention()  # "nosa" must be a known attention before the base class checks it
        super().__init__(config, *args, **kwargs)
        add_eviction_heads(self, nosa_config_of(config) or NosaConfig())

    def get_correct_attn_implementation(self, requested_attention: str | None, is_init_check: bool = False) -> str:
        """transformers asks with None when the caller chose nothing: then NOSA. An explicit choice
        ("sdpa", "eager") stands; it is how the dense weights are run on purpose."""
        return super().get_correct_attn_implementation(requested_attention or ATTN_IMPLEMENTATION, is_init_check)

    def initialize_weights(self) -> None:
        """Eviction heads absent from a checkpoint start with A = 0 (training-free selection), as
        after ``convert``; transformers' init covers W and b (a Linear). Done here rather than in
        ``_init_weights``: the heads sit inside the base model, which transformers initialises with
        its own class's ``_init_weights``. ``init.zeros_`` skips an A loaded from the checkpoint."""
        super().initialize_weights()
        with torch.no_grad():
            for module in self.modules():
                if isinstance(module, EvictionHead):
                    init.zeros_(module.scale)

    @classmethod
    def register_for_auto_class(cls, auto_class: str = "AutoModel") -> None:
        """Nothing to record (see NosaConfigMixin.register_for_auto_class)."""


class NosaLlamaForCausalLM(NosaCausalLM, LlamaForCausalLM):
    config_class = NosaLlamaConfig


class NosaQwen2ForCausalLM(NosaCausalLM, Qwen2ForCausalLM):
    config_class = NosaQwen2Config


class NosaQwen3ForCausalLM(NosaCausalLM, Qwen3ForCausalLM):
    config_class = NosaQwen3Config


class NosaGemma3ForCausalLM(NosaCausalLM, Gemma3ForCausalLM):
    config_class = NosaGemma3TextConfig


CAUSAL_LMS = {cls.config_class.nosa_type.base: cls for cls in (NosaLlamaForCausalLM, NosaQwen2ForCausalLM,
                                                              NosaQwen3ForCausalLM, NosaGemma3ForCausalLM)}
BASE_CLASSES = {LlamaForCausalLM: NosaLlamaForCausalLM, Qwen2ForCausalLM: NosaQwen2ForCausalLM,
                Qwen3ForCausalLM: NosaQwen3ForCausalLM, Gemma3ForCausalLM: NosaGemma3ForCausalLM}


# What to do instead, for model types people try that nosa does not take as they are.
UNSUPPORTED_HINTS = {
    "gemma3": ". Gemma 3's multimodal checkpoints (Gemma3ForConditionalGeneration) are not supported; nosa "
              "converts Gemma 3's text-only causal LM (Gemma3ForCausalLM, model_type gemma3_text, as "
              "gemma-3-270m and gemma-3-1b ship)",
}


def register() -> None:
    """Make AutoConfig and AutoModelForCausalLM know the NOSA model types. Idempotent."""
    register_configs()
    for cls in CAUSAL_LMS.values():
        AutoModelForCausalLM.register(cls.config_class, cls, exist_ok=True)


def convert(model, config: NosaConfig | None = None):
    """Turn a transformers Llama / Qwen2 / Qwen3 / Gemma 3 (text) causal LM into NOSA attention, in place.

    Adds ``self_attn.nosa_evict`` (W, b, A with A = 0, so outputs start as training-free NOSA
    selection) to every full-attention layer that lacks one (sliding-window layers keep attending
    to their window exactly as before), stores ``config`` in ``model.config.nosa`` and
    switches the attention implementation to "nosa". Without ``config``, the one already stored in
    ``model.config.nosa`` is used (a model loaded from a NOSA checkpoint), else NosaConfig().
    The model becomes its NOSA class (LlamaForCausalLM -> NosaLlamaForCausalLM, its config
    LlamaConfig -> NosaLlamaConfig), so ``save_pretrained`` writes a NOSA checkpoint. Returns the model.
    """
    config = config or nosa_config_of(model.config) or NosaConfig()
    model_type = getattr(model.config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES and model_type not in BY_NAME:
        raise ValueError(
            f"nosa.convert: unsupported architecture {model_type!r} ({type(model).__name__}); "
            f"supported model_type values are {list(SUPPORTED_MODEL_TYPES)}{UNSUPPORTED_HINTS.get(model_type, '')}"
        )
    nosa_class = BASE_CLASSES.get(type(model), type(model))
    if nosa_class not in CAUSAL_LMS.values():
        raise ValueError(
            f"nosa.convert: {type(model).__name__} is not a causal LM class nosa supports; "
            f"supported: {[cls.__name__ for cls in BASE_CLASSES]}"
        )
    register_attention()
    add_eviction_heads(model, config)
    # The same object takes the NOSA classes (they add no state beyond the heads just added), so
    # whoever holds the model (an optimizer, a DeepSpeed engine) keeps it and save_pretrained
    # writes the NOSA model type and architecture.
    model.config.__class__ = nosa_class.config_class
    model.__class__ = nosa_class
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    return model


def from_pretrained(path: str, config: NosaConfig | None = None, **kwargs):
    """Load a checkpoint as a NOSA model.

    A NOSA checkpoint (written by ``save_pretrained`` after ``convert``, or by nosa.train), in the
    NOSA format or the legacy one, gets its NosaConfig and eviction heads back; a dense checkpoint
    gets ``config`` (default NosaConfig()) and A = 0. ``kwargs`` go to transformers'
    ``from_pretrained`` (attention "nosa" unless ``attn_implementation`` says otherwise).
    """
    hf_config = AutoConfig.from_pretrained(path)
    stored = nosa_config_of(hf_config, source=f"{path}/config.json")
    if stored is not None and config is not None and stored != config:
        raise ValueError(f"{path} holds NosaConfig {stored}, which differs from the one passed: {config}")
    nosa_type = MODEL_TYPES.get(hf_config.model_type) or BY_NAME.get(hf_config.model_type)
    if nosa_type is None:
        raise ValueError(
            f"nosa.from_pretrained: {path} has model_type {hf_config.model_type!r}; supported are "
            f"{list(SUPPORTED_MODEL_TYPES)} (dense or legacy NOSA) and {list(BY_NAME)}"
            f"{UNSUPPORTED_HINTS.get(hf_config.model_type, '')}"
        )
    nosa_class = CAUSAL_LMS[nosa_type.base]
    # A legacy or dense checkpoint's config is the base class, with the same fields.
    hf_config.__class__ = CONFIG_CLASSES[nosa_type.base]
    setattr(hf_config, CONFIG_KEY, (stored or config or NosaConfig()).to_dict())
    kwargs.setdefault("attn_implementation", ATTN_IMPLEMENTATION)
    # A dense checkpoint has no eviction heads: transformers reports them missing and starts them
    # at A = 0 (NosaCausalLM._init_weights), which is the point here, so keep that report quiet.
    verbosity = hf_logging.get_verbosity()
    if stored is None:
        hf_logging.set_verbosity_error()
    try:
        model, info = nosa_class.from_pretrained(path, config=hf_config, output_loading_info=True, **kwargs)
    finally:
        hf_logging.set_verbosity(verbosity)
    missing = sorted(k for k in info["missing_keys"] if f".{MODULE_NAME}." in k)
    if stored is not None and missing:
        raise ValueError(f"{path} is a NOSA checkpoint but lacks eviction-head weights: {missing[:4]}...")
    return model


register()  # importing this module registers (see the end of nosa.hf_configs)
