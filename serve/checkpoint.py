"""What the backend reads from the checkpoint: the NosaConfig and the eviction-head weights.

A NOSA checkpoint (``nosa.convert`` + ``save_pretrained``, or nosa.train; the NOSA format or the
legacy one, nosa.checkpoint_format) stores its NosaConfig in config.json under "nosa" and the
eviction heads as
``model.layers.{i}.self_attn.nosa_evict.{proj.weight, proj.bias, scale}``. SGLang's model classes
have no such parameters and its loader skips unknown tensors, so the backend reads them from the
safetensors files itself. A dense checkpoint gets training-free selection (A = 0) and its
NosaConfig from the NOSA_CONFIG environment variable (JSON text or a path to a JSON file) or the
defaults. With tensor parallelism each rank builds heads for its own KV heads
(nosa.serve.parallel.KVHeadShard, nosa.serve.sharded_eviction).
"""

from __future__ import annotations

import json
import os
import re

import torch

from nosa import checkpoint_format, env
from nosa.config import CONFIG_KEY, NosaConfig
from nosa.eviction import MODULE_NAME, EvictionHead, read_eviction_tensors
from nosa.hf import nosa_config_of
from nosa.serve.parallel import KVHeadShard
from nosa.serve.sharded_eviction import ShardedEvictionHead

ENV_CONFIG = "NOSA_CONFIG"
_PARAM = re.compile(rf"(?:^|\.)layers\.(\d+)\.self_attn\.{MODULE_NAME}\.(proj\.weight|proj\.bias|scale)$")


def resolve_model_dir(model_path: str, revision: str | None = None) -> str:
    """A local directory holding the checkpoint (downloads config + safetensors for a hub id)."""
    if os.path.isdir(model_path):
        return model_path
    from huggingface_hub import snapshot_download  # optional: huggingface_hub, for a hub id only

    return snapshot_download(model_path, revision=revision, allow_patterns=["*.json", "*.safetensors"])


def load_nosa_config(model_dir: str) -> tuple[NosaConfig, bool]:
    """(config, from_checkpoint). Raises ValueError naming the file for a malformed section."""
    path = os.path.join(model_dir, "config.json")
    with open(path) as f:
        data = json.load(f)
    stored = nosa_config_of(data, source=f"{path} (nosa backend)")
    if stored is not None:
        return stored, True
    if checkpoint_format.kind(data) == "nosa":  # a NOSA model type is never served as dense
        raise ValueError(f"nosa backend: {path} has model_type {data['model_type']!r} but no '{CONFIG_KEY}' section")
    return config_from_env(), False


def config_from_env() -> NosaConfig:
    """NosaConfig for a dense checkpoint: $NOSA_CONFIG (JSON text or a JSON file) or defaults."""
    text = env.text(ENV_CONFIG)
    if not text:
        return NosaConfig()
    if not text.startswith("{"):
        if not os.path.isfile(text):
            raise ValueError(f"nosa backend: ${ENV_CONFIG}={text!r} is neither JSON nor a file")
        with open(text) as f:
            text = f.read()
    try:
        return NosaConfig.from_json(text)
    except (TypeError, ValueError) as err:  # json.JSONDecodeError is a ValueError
        raise ValueError(f"nosa backend: malformed ${ENV_CONFIG}: {err}") from err


def load_eviction_heads(model_dir: str, layers: list[int], kv_heads: KVHeadShard, head_dim: int, device) -> list:
    """One eviction head per layer of ``layers`` (the layers with NOSA attention,
    nosa.checkpoint_format.nosa_layers; in that order) with the checkpoint's W, b, A, mapping this rank's value heads
    v [T, kv_heads.local, D] to cis [T, kv_heads.local]: a float32 EvictionHead with one
    tensor-parallel rank, else a ShardedEvictionHead (nosa.serve.sharded_eviction) that sums its
    partial projections over SGLang's attention-TP group.

    Raises ValueError when a layer's tensors are missing or do not fit the model's KV heads."""
    found: dict[tuple[int, str], torch.Tensor] = {}
    for key, tensor in read_eviction_tensors(model_dir).items():
        m = _PARAM.search(key)
        if m and int(m.group(1)) in layers:
            found[(int(m.group(1)), m.group(2))] = tensor
    all_reduce = _attention_tp_all_reduce() if kv_heads.communicates else None
    heads = []
    for layer in layers:
        head = EvictionHead(kv_heads.real, head_dim, device=device, dtype=torch.float32)
        state = {}
        for part in ("proj.weight", "proj.bias", "scale"):
            if (layer, part) not in found:
                raise ValueError(
                    f"nosa backend: {model_dir} has a '{CONFIG_KEY}' section but no tensor "
                    f"model.layers.{layer}.self_attn.{MODULE_NAME}.{part}"
                )
            state[part] = found[(layer, part)].float()
        try:
            head.load_state_dict(state)
        except RuntimeError as err:
            raise ValueError(
                f"nosa backend: eviction head of layer {layer} in {model_dir} does not fit "
                f"{kv_heads.real} KV heads x head_dim {head_dim}: {err}"
            ) from err
        head.requires_grad_(False)
        heads.append(head if kv_heads.size == 1 else ShardedEvictionHead(head, kv_heads, all_reduce))
    return heads


def _attention_tp_all_reduce():
    """SGLang's sum over the attention tensor-parallel group (gloo on CPU, NCCL or its custom
    all-reduce on GPU)."""
    from sglang.srt.runtime_context import get_parallel  # optional: sglang (an SGLang process's TP group)

    return get_parallel().attn_tp_group.all_reduce


def zero_eviction_heads(num_layers: int, num_kv_heads: int, head_dim: int, device) -> list[EvictionHead]:
    """A = 0 heads for a dense checkpoint (cis == 0: training-free selection); per rank, for its
    ``num_kv_heads`` heads (no rank needs another's V to compute zeros)."""
    heads = []
    for _ in range(num_layers):
        head = EvictionHead(num_kv_heads, head_dim, device=device, dtype=torch.float32)
        torch.nn.init.zeros_(head.proj.weight)
        torch.nn.init.zeros_(head.proj.bias)
        heads.append(head.requires_grad_(False))
    return heads
