"""transformers config classes of the NOSA model types: NosaLlamaConfig, NosaQwen2Config, NosaQwen3Config,
NosaGemma3TextConfig.

Each subclasses its base model's config and adds no field (the NosaConfig is the "nosa" attribute,
as in every NOSA checkpoint). The subclass changes what config.json says: model_type "nosa_llama",
the ``auto_map``, and ``modeling_nosa.py`` written beside it (nosa.checkpoint_format). ``register()``
adds the types to AutoConfig; importing this module runs it, which nosa/__init__ does once
transformers has built AutoConfig (nosa.after_import).
"""

from __future__ import annotations

from transformers import AutoConfig, Gemma3TextConfig, LlamaConfig, Qwen2Config, Qwen3Config

from nosa.checkpoint_format import MODEL_TYPES, write_code_file


class NosaConfigMixin:
    """What a NOSA config class adds to its base config class (listed first among the bases)."""

    nosa_type = None  # the checkpoint_format.ModelType, set by each class

    def to_dict(self) -> dict:
        out = super().to_dict()
        out["auto_map"] = self.nosa_type.auto_map
        return out

    def save_pretrained(self, save_directory, push_to_hub: bool = False, **kwargs) -> None:
        super().save_pretrained(save_directory, push_to_hub=push_to_hub, **kwargs)
        write_code_file(save_directory)

    @classmethod
    def register_for_auto_class(cls, auto_class: str = "AutoConfig") -> None:
        """Nothing to record. transformers calls this on a class it took from remote code, so that
        a later save copies the class's source file into the checkpoint; that file would be nosa's
        own module, while a NOSA checkpoint carries modeling_nosa.py (``save_pretrained``)."""


class NosaLlamaConfig(NosaConfigMixin, LlamaConfig):
    model_type = MODEL_TYPES["llama"].name
    nosa_type = MODEL_TYPES["llama"]


class NosaQwen2Config(NosaConfigMixin, Qwen2Config):
    model_type = MODEL_TYPES["qwen2"].name
    nosa_type = MODEL_TYPES["qwen2"]


class NosaQwen3Config(NosaConfigMixin, Qwen3Config):
    model_type = MODEL_TYPES["qwen3"].name
    nosa_type = MODEL_TYPES["qwen3"]


class NosaGemma3TextConfig(NosaConfigMixin, Gemma3TextConfig):
    model_type = MODEL_TYPES["gemma3_text"].name
    nosa_type = MODEL_TYPES["gemma3_text"]


CONFIG_CLASSES = {cls.nosa_type.base: cls
                  for cls in (NosaLlamaConfig, NosaQwen2Config, NosaQwen3Config, NosaGemma3TextConfig)}


def register() -> None:
    """Make AutoConfig know the NOSA model types. Idempotent."""
    for cls in CONFIG_CLASSES.values():
        AutoConfig.register(cls.model_type, cls, exist_ok=True)


# Importing this module is what registers: the import that triggers it (nosa.after_import) may come
# while this very module is half-imported (its transformers imports above build AutoConfig), and
# then only its own last line can register.
register()
