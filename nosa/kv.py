"""KV views: how the decode path reads keys, values and eviction scores without knowing where they live.

``KVView`` is the contract. ``NosaDecodeState`` keeps selection state only; K, V and cis stay in
a pool the caller owns. The views here read pools that attention can index directly:
``ContiguousKV`` (one sequence, the HF cache) and ``PagedKV`` (SGLang's token-slot pool behind
``req_to_token``); the offloading server's ``nosa.serve.offload.kv.OffloadKV`` resolves through
its device block cache. Shapes (nosa.layout): R sequences, W blocks per (sequence, KV head).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch

from nosa.layout import block_token_ids, selected_tokens


class PagedBlocks(NamedTuple):
    """Resolved blocks as a token-slot pool holds them, the form nosa.ops.paged_sparse_decode reads:
    k_pool, v_pool [N, Hkv, D], cis_pool [N, Hkv]; token_table [R, T] (pool slot of token t of
    sequence i); blocks [R, Hkv, W] (-1 = none); lengths [R] (tokens)."""

    k_pool: torch.Tensor
    v_pool: torch.Tensor
    cis_pool: torch.Tensor
    token_table: torch.Tensor
    blocks: torch.Tensor
    lengths: torch.Tensor


@dataclass
class DeviceRows:
    """Where the resolved blocks are: k [N, D], v [N, Dv], cis [N] float32 (row-major buffers that
    attention indexes), rows [R, Hkv, T] long (buffer row of each key), valid [R, Hkv, T] bool
    (False: padding, or a position at or past the sequence's length)."""

    k: torch.Tensor
    v: torch.Tensor
    cis: torch.Tensor
    rows: torch.Tensor
    valid: torch.Tensor
    # The same blocks in the form the GPU kernels take (nosa.ops), when the view has one:
    # a block cache: items (k [S, B, D], v, cis [S, B]), slots [R, Hkv, W] (-1 = none) and fill
    # [R, Hkv, W] (valid tokens from the block start) -> nosa.ops.slot_decode;
    # a token-slot pool: paged -> nosa.ops.paged_sparse_decode.
    items: tuple | None = None
    slots: torch.Tensor | None = None
    fill: torch.Tensor | None = None
    paged: PagedBlocks | None = None


class KVView(Protocol):
    """Tokens of R sequences in a pool the caller owns (-1 = no block):

    - ``length(i)``: tokens of sequence ``i``;
    - ``keys(i, lo, hi)`` -> [hi - lo, Hkv, D] and ``cis(i, lo, hi)`` -> [hi - lo, Hkv] float32:
      tokens [lo, hi) of sequence i (a state's new compressed windows and completed blocks);
    - ``resolve(blocks [R, Hkv, W], lengths [R], block_size)`` -> DeviceRows: make those blocks of
      every sequence readable by attention and say where they are (decode);
    - ``gather_blocks(i, blocks [U], block_size)`` -> (k, v [U * B, Hkv, D], cis [U * B, Hkv]):
      blocks of sequence i, every KV head, token-major; tokens past the length are garbage
      (a prefill chunk reads the union of its rows' blocks this way).
    """

    def length(self, i: int) -> int: ...

    def keys(self, i: int, lo: int, hi: int) -> torch.Tensor: ...

    def cis(self, i: int, lo: int, hi: int) -> torch.Tensor: ...

    def resolve(self, blocks: torch.Tensor, lengths: torch.Tensor, block_size: int) -> DeviceRows: ...

    def gather_blocks(self, i: int, blocks: torch.Tensor,
                      block_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...


class ContiguousKV:
    """A KVView of one sequence whose K/V/cis are plain tensors: k, v [L, Hkv, D], cis [L, Hkv]."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor | None, cis: torch.Tensor):
        if cis.shape != k.shape[:2] or (v is not None and v.shape[:2] != k.shape[:2]):
            raise ValueError(
                f"ContiguousKV: k {tuple(k.shape)}, v {None if v is None else tuple(v.shape)} and "
                f"cis {tuple(cis.shape)} must agree on [L, Hkv]"
            )
        self.k, self.v, self.cis_all = k, v, cis

    def length(self, i: int = 0) -> int:
        return self.k.shape[0]

    def keys(self, i: int, lo: int, hi: int) -> torch.Tensor:
        return self.k[lo:hi]

    def cis(self, i: int, lo: int, hi: int) -> torch.Tensor:
        return self.cis_all[lo:hi]

    def resolve(self, blocks: torch.Tensor, lengths: torch.Tensor, block_size: int) -> DeviceRows:
        if self.v is None:
            raise ValueError("ContiguousKV: values are needed to attend (built with v=None)")
        tokens, valid = selected_tokens(blocks, lengths, block_size)
        return _token_rows(self.k, self.v, self.cis_all, tokens, valid)

    def gather_blocks(self, i: int, blocks: torch.Tensor, block_size: int):
        tokens = block_token_ids(blocks, block_size).clamp(max=self.length() - 1)
        return self.k[tokens], self.v[tokens], self.cis_all[tokens]


class PagedKV:
    """A KVView of sequences in a shared token-slot pool: k_pool, v_pool [N, Hkv, D], cis_pool [N, Hkv]; token t
    of sequence i at pool row ``slot_table[table_rows[i], t]`` (SGLang's req_to_token); lengths [R]
    (a list, or a tensor: read on the host only by ``length``)."""

    def __init__(self, k_pool, v_pool, cis_pool, slot_table, table_rows, lengths):
        if cis_pool.shape != k_pool.shape[:2]:
            raise ValueError(f"PagedKV: cis_pool {tuple(cis_pool.shape)} must be [N, Hkv] = {tuple(k_pool.shape[:2])}")
        self.k_pool, self.v_pool, self.cis_pool = k_pool, v_pool, cis_pool
        self.slot_table, self.table_rows = slot_table, table_rows
        self.lengths = lengths

    def length(self, i: int) -> int:
        return int(self.lengths[i])

    def slots(self, i: int, lo: int, hi: int) -> torch.Tensor:
        return self.slot_table[self.table_rows[i], lo:hi].long()

    def keys(self, i: int, lo: int, hi: int) -> torch.Tensor:
        return self.k_pool.index_select(0, self.slots(i, lo, hi))

    def cis(self, i: int, lo: int, hi: int) -> torch.Tensor:
        return self.cis_pool.index_select(0, self.slots(i, lo, hi))

    def resolve(self, blocks: torch.Tensor, lengths: torch.Tensor, block_size: int) -> DeviceRows:
        return paged_rows(self.k_pool, self.v_pool, self.cis_pool, self.slot_table, self.table_rows, blocks, lengths,
                          block_size)

    def gather_blocks(self, i: int, blocks: torch.Tensor, block_size: int):
        tokens = block_token_ids(blocks, block_size).clamp(max=self.lengths[i] - 1)
        slots = self.slot_table[self.table_rows[i]].index_select(0, tokens).long()
        return tuple(x.index_select(0, slots) for x in (self.k_pool, self.v_pool, self.cis_pool))


def paged_rows(k_pool, v_pool, cis_pool, slot_table, table_rows, blocks: torch.Tensor, lengths: torch.Tensor,
               block_size: int) -> DeviceRows:
    """``PagedKV.resolve`` as a function of tensors only (no host synchronisation: a captured decode
    step calls it): blocks [R, Hkv, W] of the sequences at ``slot_table`` rows ``table_rows`` [R],
    ``lengths`` [R] tokens each. The rows are read in place; ``paged`` (the form of the GPU kernel)
    only where kernels run."""
    from nosa import ops  # optional: import nosa loads no kernel code (nosa.ops imports kernels/)

    tokens, valid = selected_tokens(blocks, lengths, block_size)  # [R, Hkv, T]
    # slot_table[table_rows[i], tokens[i]] for every i, one index_select (advanced indexing is slower)
    table_rows = table_rows.to(slot_table.device)
    where = table_rows.to(tokens.device)[:, None, None] * slot_table.shape[1] + tokens
    slots = slot_table.reshape(-1).index_select(0, where.flatten()).view_as(tokens).long()
    found = _token_rows(k_pool, v_pool, cis_pool, slots, valid)
    if ops.use_kernels(k_pool):
        found.paged = PagedBlocks(k_pool, v_pool, cis_pool, slot_table.index_select(0, table_rows), blocks, lengths)
    return found


def _token_rows(k, v, cis, slots, valid) -> DeviceRows:
    """Rows of (slot, head) in a token-major pool [N, Hkv, D] viewed as [N * Hkv, D]."""
    hkv = k.shape[1]
    heads = torch.arange(hkv, device=slots.device)[:, None]
    return DeviceRows(k.reshape(-1, k.shape[-1]), v.reshape(-1, v.shape[-1]), cis.reshape(-1),
                      slots * hkv + heads, valid)
