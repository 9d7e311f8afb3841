"""The model: a dense Llama / Qwen2 / Qwen3 causal LM from a local checkpoint or built from a config,
its conversion to NOSA, and the optimizer's parameter groups (eviction heads vs the rest)."""

from __future__ import annotations

import torch

import nosa
from nosa.eviction import MODULE_NAME
from nosa.hf import nosa_config_of
from nosa.tiny import build_causal_lm
from nosa.train.config import check_model_path


def build_model(build: dict, tokenizer, dtype=torch.float32):
    """A randomly initialised causal LM from a config dict (``model_type`` default llama), built by
    nosa.tiny.build_causal_lm (the project's one model builder) from the global RNG state."""
    spec = dict(build)
    kind = spec.pop("model_type", "llama")
    spec.setdefault("vocab_size", len(tokenizer))
    spec.setdefault("pad_token_id", tokenizer.pad_token_id)
    spec.setdefault("bos_token_id", tokenizer.bos_token_id)
    spec.setdefault("eos_token_id", tokenizer.eos_token_id)
    try:
        model = build_causal_lm(kind, dtype=dtype, **spec)
    except ValueError as err:
        raise ValueError(f"model.build: {err}") from err
    if len(tokenizer) > model.config.vocab_size:
        raise ValueError(f"model.build.vocab_size={model.config.vocab_size} < tokenizer size {len(tokenizer)}")
    return model


def load_model(path: str, dtype=torch.float32):
    """A local checkpoint: dense (sdpa attention) or NOSA (eviction heads and NosaConfig restored)."""
    from transformers import AutoConfig, AutoModelForCausalLM  # optional: after nosa.train sets HF_HUB_OFFLINE

    check_model_path(path)
    if is_nosa(AutoConfig.from_pretrained(path)):
        return nosa.from_pretrained(path, dtype=dtype)
    return AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa", dtype=dtype)


def is_nosa(hf_config) -> bool:
    return nosa_config_of(hf_config) is not None


def param_groups(model, lr: float, lr_evict: float, weight_decay: float, freeze_base: bool) -> list[dict]:
    """Two groups: ``evict`` (W, b, A of every eviction head) and ``base`` (the rest; frozen and
    left out when ``freeze_base``). Group names go to the logs as ``lr/<name>``."""
    evict, base = [], []
    for name, p in model.named_parameters():
        if f".{MODULE_NAME}." in name:
            evict.append(p)
        else:
            p.requires_grad_(not freeze_base)
            if not freeze_base:
                base.append(p)
    groups = []
    if base:
        groups.append({"name": "base", "params": base, "lr": lr, "weight_decay": weight_decay})
    if evict:
        groups.append({"name": "evict", "params": evict, "lr": lr_evict, "weight_decay": 0.0})
    if not groups:
        raise ValueError("freeze_base=true on a dense model leaves nothing to train")
    return groups


def eviction_scales(model) -> dict[int, torch.Tensor]:
    """Layer index -> A [Hkv] of its eviction head."""
    out = {}
    for name, module in model.named_modules():
        if name.endswith(MODULE_NAME):
            layer = int(name.split("layers.")[1].split(".")[0])
            out[layer] = module.scale.detach().float().cpu()
    return out
