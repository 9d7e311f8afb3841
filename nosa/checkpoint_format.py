"""The NOSA checkpoint format: what a saved NOSA model's config.json says, so that no loader can
mistake it for its dense base model.

A NOSA checkpoint is a transformers checkpoint whose
config.json has ``model_type`` "nosa_llama" / "nosa_qwen2" / "nosa_qwen3" / "nosa_gemma3_text" and
``architectures`` ["NosaLlamaForCausalLM"] / ... (a loader that does not know NOSA stops instead of
building the dense model); ``auto_map`` naming the classes in ``modeling_nosa.py``, a file beside it
that imports them from the installed nosa package; the NosaConfig under "nosa"; the eviction heads
as ``model.layers.{i}.self_attn.nosa_evict.{proj.weight, proj.bias, scale}`` tensors, for every
layer with full attention (a hybrid model's sliding-window layers have none: they attend to their
window exactly as the base model does). The *legacy* format (written before the NOSA model types)
has the base model's type and a "nosa" section: nosa.from_pretrained and the server still load it,
and ``upgraded_config`` (``python -m nosa.upgrade``) rewrites it. Only json is needed here.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from nosa.config import CONFIG_KEY

CODE_FILE = "modeling_nosa.py"


@dataclass(frozen=True)
class ModelType:
    """One NOSA model type and the dense base model it extends."""

    base: str  # transformers' model_type of the base model: "llama"
    name: str  # "nosa_llama"
    base_architecture: str  # "LlamaForCausalLM"
    architecture: str  # "NosaLlamaForCausalLM": the causal-LM class name (nosa.hf_models)
    config_class: str  # "NosaLlamaConfig" (nosa.hf_configs)

    @property
    def auto_map(self) -> dict[str, str]:
        """config.json's ``auto_map``: the classes transformers takes from CODE_FILE."""
        module = CODE_FILE.removesuffix(".py")
        return {"AutoConfig": f"{module}.{self.config_class}", "AutoModelForCausalLM": f"{module}.{self.architecture}"}


def _model_type(base: str, camel: str, config_camel: str | None = None) -> ModelType:
    return ModelType(base, f"nosa_{base}", f"{camel}ForCausalLM", f"Nosa{camel}ForCausalLM",
                     f"Nosa{config_camel or camel}Config")


# gemma3_text: Gemma 3's text-only causal LM (Gemma3ForCausalLM, config Gemma3TextConfig), a hybrid of
# sliding-window and full-attention layers; only its full-attention layers carry eviction heads.
MODEL_TYPES = {t.base: t for t in (_model_type("llama", "Llama"), _model_type("qwen2", "Qwen2"),
                                   _model_type("qwen3", "Qwen3"), _model_type("gemma3_text", "Gemma3", "Gemma3Text"))}
BY_NAME = {t.name: t for t in MODEL_TYPES.values()}

CODE_TEXT = f'''"""NOSA model classes of this checkpoint (model types {", ".join(BY_NAME)}).

transformers imports this file for AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True).
The classes are those of the installed nosa package (pip install nosa). Without trust_remote_code,
`import nosa` before a plain from_pretrained registers them.
"""

from nosa.hf_configs import {", ".join(t.config_class for t in MODEL_TYPES.values())}
from nosa.hf_models import {", ".join(t.architecture for t in MODEL_TYPES.values())}
'''


def nosa_layers(config) -> list[int]:
    """Indices of the layers that carry eviction heads, from a config.json (a dict) or a transformers
    config: every layer, except a hybrid model's sliding-window ones (``layer_types`` entries
    "sliding_attention", as Gemma 3 has)."""
    get = config.get if isinstance(config, dict) else lambda key, default=None: getattr(config, key, default)
    types = get("layer_types") or ["full_attention"] * get("num_hidden_layers")
    return [i for i, t in enumerate(types) if t != "sliding_attention"]


def kind(config: dict) -> str:
    """What a config.json (as a dict) holds: "nosa" (a NOSA model type), "legacy" (a base model type
    with a "nosa" section), "dense" (a base model type without one) or "other"."""
    model_type = config.get("model_type")
    if model_type in BY_NAME:
        return "nosa"
    if model_type in MODEL_TYPES:
        return "legacy" if CONFIG_KEY in config else "dense"
    return "other"


def upgraded_config(config: dict, source: str = "config.json") -> dict:
    """The config.json of the NOSA format for a legacy (or already NOSA) one: model_type,
    architectures and auto_map replaced, every other key kept in place. ValueError naming
    ``source`` for a dense or unsupported checkpoint."""
    found = kind(config)
    if found == "dense":
        raise ValueError(
            f"{source} has model_type {config['model_type']!r} and no '{CONFIG_KEY}' section: a dense checkpoint, "
            "not a NOSA one. To make it NOSA: model = nosa.from_pretrained(path, nosa.NosaConfig(...)) "
            "(training-free selection, A = 0), then model.save_pretrained(new_path)"
        )
    if found == "other":
        raise ValueError(
            f"{source} has model_type {config.get('model_type')!r}; a NOSA checkpoint has one of "
            f"{sorted(BY_NAME)}, or (legacy) one of {sorted(MODEL_TYPES)} with a '{CONFIG_KEY}' section"
        )
    target = MODEL_TYPES[config["model_type"]] if found == "legacy" else BY_NAME[config["model_type"]]
    out = dict(config)
    out["model_type"] = target.name
    out["architectures"] = [target.architecture]
    out["auto_map"] = target.auto_map
    return out


def write_code_file(directory: str) -> None:
    """Write CODE_FILE into a checkpoint directory (the trust_remote_code route's entry point)."""
    with open(os.path.join(directory, CODE_FILE), "w") as f:
        f.write(CODE_TEXT)
