"""ShardedEvictionHead: one layer's eviction head on one tensor-parallel rank.

``cis = A * softplus(W v + b)`` reads every value head of a token (W is [H, H*D]); a rank holds V
for its own heads only (nosa.serve.parallel.KVHeadShard), so it computes the partial
pre-activation ``p_r = sum over its heads h of W[:, h*D:(h+1)*D] v_h`` [T, H], one all-reduce sums
the partials, and each rank finishes ``A * softplus(p + b)`` for its heads. A replicated head enters
the sum from its first replica only; SGLang's padding heads (CPU) get cis 0. The result equals TP
1's up to float rounding (exactly, where nothing is exchanged: one rank, or one real KV head). A
collective: every rank of the group calls it at the same point with the same number of tokens.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from nosa.eviction import EvictionHead
from nosa.serve.parallel import KVHeadShard


class ShardedEvictionHead(nn.Module):
    """cis [..., local] for this rank's value heads v [..., local, D] (``shard.local`` heads).

    head: the layer's whole eviction head (``shard.real`` KV heads); all_reduce: sums a [T, H]
    tensor over the shard's ranks and returns the sum (SGLang's ``GroupCoordinator.all_reduce``),
    required when ``shard.communicates``."""

    def __init__(self, head: EvictionHead, shard: KVHeadShard, all_reduce: Callable | None = None):
        super().__init__()
        if head.num_kv_heads != shard.real:
            raise ValueError(f"ShardedEvictionHead: the eviction head has {head.num_kv_heads} KV heads, "
                             f"the shard {shard.real}")
        if shard.communicates and all_reduce is None:
            raise ValueError("ShardedEvictionHead: this layout needs an all_reduce across the ranks")
        self.shard, self.head_dim, self.all_reduce = shard, head.head_dim, all_reduce
        self.mine = shard.real_heads()  # global indices; a rank's real heads come before its padding heads
        d = head.head_dim
        weight = head.proj.weight.detach()
        own_columns = [weight[:, h * d : (h + 1) * d] for h in self.mine] or [weight[:, :0]]
        partial_weight = torch.cat(own_columns, dim=1)  # [H, len(mine) * D]
        self.register_buffer("partial_weight", partial_weight if shard.counts else torch.zeros_like(partial_weight))
        self.register_buffer("bias", head.proj.bias.detach()[self.mine].clone())
        self.register_buffer("scale", head.scale.detach()[self.mine].clone())
        self.whole = head if len(self.mine) == shard.real else None  # this rank holds every real head

    def partial(self, v: torch.Tensor) -> torch.Tensor:
        """v [..., local, D] -> this rank's share of W v, [..., H] (zeros from a non-first replica)."""
        x = v[..., : len(self.mine), :].flatten(-2).to(self.partial_weight.dtype)
        return x @ self.partial_weight.T

    def finish(self, pre: torch.Tensor) -> torch.Tensor:
        """The all-reduced W v [..., H] -> cis [..., local] of this rank's heads (0 for padding heads)."""
        cis = pre.new_zeros(*pre.shape[:-1], self.shard.local)
        cis[..., : len(self.mine)] = self.scale * F.softplus(pre[..., self.mine] + self.bias)
        return cis

    def forward(self, v: torch.Tensor) -> torch.Tensor:
        if v.shape[-2:] != (self.shard.local, self.head_dim):
            raise ValueError(f"ShardedEvictionHead expects v [..., {self.shard.local}, {self.head_dim}], "
                             f"got {tuple(v.shape)}")
        if self.shard.communicates:
            return self.finish(self.all_reduce(self.partial(v)))
        cis = v.new_zeros(v.shape[:-1], dtype=self.scale.dtype)
        if self.whole is not None:
            cis[..., : len(self.mine)] = self.whole(v[..., : len(self.mine), :])
        return cis
