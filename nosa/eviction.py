"""The query-agnostic eviction head: ``cis = A * softplus(W v + b)``, one score per token and KV head.

``cis`` depends only on V, so a completed block's pooled score never changes: that is what makes
part of the selection static. Attention weights token j by ``exp(cis_j)`` (``cis_j`` is added to its
logit), which is how W, b and A receive gradients from the plain LM loss. A starts at zero, so a
freshly converted model attends exactly like InfLLM-v2 selection.
"""

from __future__ import annotations

import json
import os

import torch
import torch.nn.functional as F
from torch import nn

from nosa.compress import compress_windows, pool_to_blocks
from nosa.config import NosaConfig

# Parameter names inside an attention module; the server's weight loader relies on them.
MODULE_NAME = "nosa_evict"


class EvictionHead(nn.Module):
    """cis [..., Hkv] = A * softplus(W v.flatten(-2) + b) for v [..., Hkv, D]."""

    def __init__(self, num_kv_heads: int, head_dim: int, device=None, dtype=None):
        super().__init__()
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.proj = nn.Linear(num_kv_heads * head_dim, num_kv_heads, device=device, dtype=dtype)
        self.scale = nn.Parameter(torch.zeros(num_kv_heads, device=device, dtype=dtype))  # A

    def forward(self, v: torch.Tensor) -> torch.Tensor:
        if v.shape[-2:] != (self.num_kv_heads, self.head_dim):
            raise ValueError(
                f"EvictionHead expects v [..., {self.num_kv_heads}, {self.head_dim}], got {tuple(v.shape)}"
            )
        x = v.flatten(-2).to(self.proj.weight.dtype)
        return self.scale * F.softplus(self.proj(x))


def block_eviction_scores(cis: torch.Tensor, cfg: NosaConfig, num_blocks: int | None = None) -> torch.Tensor:
    """Static block keys from token scores, as ranked by nosa.select.select_blocks.

    cis: [L, Hkv]. Returns [Hkv, NB, 2] float32: ``[..., 0]`` the eviction score (mean over
    compressed windows, max onto blocks; ``-inf`` where no complete window overlaps the block),
    ``[..., 1]`` the tie-breaker (mean of the block's own tokens, over those present).
    """
    if num_blocks is None:
        num_blocks = cfg.num_blocks(cis.shape[0])
    cis = cis.detach().float()
    windows = compress_windows(cis, cfg)  # [C, Hkv]
    pooled = pool_to_blocks(windows.transpose(0, 1), num_blocks, cfg)
    return torch.stack([pooled, block_means(cis, num_blocks, cfg.block_size)], dim=-1)


def block_means(cis: torch.Tensor, num_blocks: int, block_size: int) -> torch.Tensor:
    """Mean of cis [L, Hkv] over each block's tokens -> [Hkv, NB] (partial blocks: tokens present)."""
    length, hkv = cis.shape
    padded = cis.new_zeros(num_blocks * block_size, hkv)
    count = cis.new_zeros(num_blocks * block_size)
    take = min(length, padded.shape[0])
    padded[:take] = cis[:take]
    count[:take] = 1
    sums = padded.reshape(num_blocks, block_size, hkv).sum(dim=1)
    counts = count.reshape(num_blocks, block_size).sum(dim=1).clamp(min=1)
    return (sums / counts[:, None]).transpose(0, 1)


def read_eviction_tensors(model_dir: str) -> dict[str, torch.Tensor]:
    """Every ``*.nosa_evict.*`` tensor of a checkpoint's safetensors files (sharded or not), by name.
    Read directly, because model classes without eviction heads (transformers', SGLang's) skip them."""
    from safetensors import safe_open  # optional: safetensors (import nosa needs only torch)

    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = sorted(n for n in os.listdir(model_dir) if n.endswith(".safetensors"))
    tensors = {}
    for file in files:
        with safe_open(os.path.join(model_dir, file), framework="pt") as f:
            for name in f.keys():
                if f".{MODULE_NAME}." in name:
                    tensors[name] = f.get_tensor(name)
    return tensors
