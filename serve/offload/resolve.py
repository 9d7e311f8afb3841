"""The tensor math of a layer's resolve in the device block cache, and where blocks live on the host.

Functions of tensors only: DeviceBlockCache.resolve_layer (nosa.serve.offload.block_cache) runs them
on its slot maps and buffers. Fixed shapes and no host synchronisation, so a decode step that calls
them can be captured. R requests, Hkv KV heads, NS slots per (request, KV head), W wanted blocks
per KV head (-1 padded), B tokens per block. The CPU kernel nosa.kernels.resolve_cpu is tested
equal to this code, its spec.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

# What a slot offers a miss in the slot diff, best first (the key misses sort the slots by).
EMPTY_SLOT = 0  # holds no block
STALE_SLOT = 1  # holds a block this step does not want: evicted for the miss
KEPT_SLOT = 2  # holds a block this step wants
NO_COLUMN = 3  # an extra slot (admission) with no borrowed column behind it

# the device counters of one layer, in the order of ``step_counts``' result (the cache adds it to them)
COUNT_KEYS = ("steps", "selected", "hits", "misses", "warm_selected", "warm_hits", "prefetch_hits")


class NewTokens(NamedTuple):
    """The decode step's token of each request in one layer, written through into its tail block's
    slot: k [R, Hkv, D], v [R, Hkv, Dv], cis [R, Hkv]."""

    k: torch.Tensor
    v: torch.Tensor
    cis: torch.Tensor


class PageTable(NamedTuple):
    """Where a step's blocks live in the host pool, looked up where they are needed (the CPU kernel
    reads the table itself): SGLang's req_to_token [rows, max_ctx] (int32) and the step's table rows [R]."""

    req_to_token: torch.Tensor
    rows: torch.Tensor

    def pages(self, blocks: torch.Tensor, block: int) -> torch.Tensor:
        return host_pages(self.req_to_token, self.rows, blocks, block)


def host_pages(req_to_token: torch.Tensor, table_rows: torch.Tensor, blocks: torch.Tensor, block: int) -> torch.Tensor:
    """Host page of each block [R, Hkv, W] of the requests at ``req_to_token`` rows ``table_rows`` [R]
    (the page of the block's first token; -1 blocks -> -1)."""
    first_token = blocks.clamp(min=0).to(req_to_token.device) * block
    where = table_rows.to(req_to_token.device)[:, None, None] * req_to_token.shape[1] + first_token
    first = req_to_token.reshape(-1).index_select(0, where.flatten()).view(blocks.shape).long()
    return torch.where(blocks >= 0, first.to(blocks.device) // block, -1)


def place(current: torch.Tensor, dst_slot: torch.Tensor, wanted: torch.Tensor, miss: torch.Tensor, ns: int):
    """current [R, Hkv, NS] with wanted[miss] written at dst_slot[miss] (others untouched)."""
    spill = torch.cat([current, current.new_full((*current.shape[:-1], 1), -1)], dim=-1)
    spill.scatter_(-1, torch.where(miss, dst_slot, ns), torch.where(miss, wanted, -1))
    return spill[..., :ns]


class SlotDiff(NamedTuple):
    """The slot diff of one layer's resolve: ``blocks`` [R, Hkv, NS], the groups' slot maps after it;
    per wanted block [R, Hkv, W] (bool): ``hit`` (resident, not by a prefetch), ``miss`` (not
    resident before the prefetch), ``prefetch_hit`` (a miss a prefetch landed), ``demand`` (recalled
    from the host); ``dst_slot`` the slot a miss takes, ``slot_of`` where each wanted block sits
    after; ``landed_slot`` where a prefetch landed it (None without a prefetch)."""

    blocks: torch.Tensor
    hit: torch.Tensor
    miss: torch.Tensor
    prefetch_hit: torch.Tensor
    demand: torch.Tensor
    dst_slot: torch.Tensor
    slot_of: torch.Tensor
    landed_slot: torch.Tensor | None


def diff_slots(current: torch.Tensor, wanted: torch.Tensor, usable: torch.Tensor,
               prefetched: torch.Tensor | None = None) -> SlotDiff:
    """The slot diff of ``wanted`` [R, Hkv, W] against the resident blocks ``current`` [R, Hkv, NS]:
    hits keep their slot; misses take, in order, empty slots, then those whose block is not wanted,
    never a slot without a column (``usable`` [R, 1, NS] False). ``prefetched`` [R, Hkv, NS]: slots
    a prefetch landed, counted as empty, so the slot map after is exactly the one without prefetch;
    a wanted block a prefetch landed is a prefetch hit (moved on the device, not recalled)."""
    virtual = current if prefetched is None else torch.where(prefetched, -1, current)
    valid_w = wanted[..., None, :] >= 0
    match = (virtual[..., :, None] == wanted[..., None, :]) & valid_w  # [R, Hkv, NS, W]
    keep = match.any(dim=-1)  # slot holds a wanted block
    hit = match.any(dim=-2)  # wanted block already resident
    miss = (wanted >= 0) & ~hit  # [R, Hkv, W]
    if prefetched is None:
        landed_slot, prefetch_hit, demand = None, torch.zeros_like(miss), miss
    else:
        landed = (current[..., :, None] == wanted[..., None, :]) & valid_w & prefetched[..., None]
        prefetch_hit = landed.any(dim=-2) & miss
        demand = miss & ~prefetch_hit
        landed_slot = landed.long().argmax(dim=-2)
    offer = torch.where(keep, KEPT_SLOT, torch.where(virtual >= 0, STALE_SLOT, EMPTY_SLOT))
    offer = torch.where(usable, offer, NO_COLUMN)
    free_slots = offer.sort(dim=-1, stable=True).indices  # [R, Hkv, NS]
    rank = (miss.cumsum(dim=-1) - 1).clamp(min=0)
    dst_slot = free_slots.gather(-1, rank)  # [R, Hkv, W] slot of each miss
    blocks = place(virtual, dst_slot, wanted, miss, current.shape[-1])
    slot_of = torch.where(hit, (match.long().argmax(dim=-2)), dst_slot)  # where each wanted block now sits
    return SlotDiff(blocks, hit, miss, prefetch_hit, demand, dst_slot, slot_of, landed_slot)


def attended_rows(item: torch.Tensor, wanted: torch.Tensor, lengths: torch.Tensor, block: int):
    """(rows [R, Hkv, W*B], valid [R, Hkv, W*B], slots [R, Hkv, W], fill [R, Hkv, W] int32) that
    attention reads, for wanted blocks [R, Hkv, W] at device items ``item`` [R, Hkv, W] of contexts
    ``lengths`` [R]: row = item * B + token offset; slots -1 and fill 0 where nothing is wanted."""
    offsets = torch.arange(block, device=wanted.device)
    token_rows = (item[..., None] * block + offsets).flatten(-2)  # [R, Hkv, W*B]
    positions = (wanted.clamp(min=0)[..., None] * block + offsets).flatten(-2)
    length_t = lengths[:, None, None]
    valid = (wanted >= 0).repeat_interleave(block, dim=-1) & (positions < length_t)
    fill = (length_t - wanted * block).clamp(0, block).int()
    return token_rows, valid, torch.where(wanted >= 0, item, -1), torch.where(wanted >= 0, fill, 0)


def tail_rows(wanted: torch.Tensor, item: torch.Tensor, lengths: torch.Tensor, block: int,
              dump_row: int) -> torch.Tensor:
    """[R * Hkv] the device token row of each request's new token (the last of ``lengths`` [R]) in
    its tail block's item (``item`` [R, Hkv, W] of wanted [R, Hkv, W]); ``dump_row`` where that block
    is not resident (e.g. a padding row's)."""
    last = lengths - 1
    here = wanted == (last // block)[:, None, None]  # [R, Hkv, W]: the tail block
    slot_item = torch.where(here, item, -1).max(dim=-1).values  # [R, Hkv]
    rows = torch.where(slot_item >= 0, slot_item * block + (last % block)[:, None], dump_row)
    return rows.flatten()


def step_counts(wanted: torch.Tensor, hit: torch.Tensor, miss: torch.Tensor, prefetch_hit: torch.Tensor,
                warm: torch.Tensor, real: torch.Tensor | None):
    """One layer's counters of a step: (the COUNT_KEYS deltas [7], the most misses of a warm (request,
    KV head) [], misses per (request, KV head) [R, Hkv]). ``hit`` includes prefetch hits, ``miss``
    is the demand; warm [R] and real [R] bool (padding rows, real False, count nowhere)."""
    counted = warm.new_ones(warm.shape) if real is None else real
    warm = warm & counted
    # one stacked count for the four kinds (selected, hits, misses, prefetch hits): fewer ops per layer
    per_head = (torch.stack([wanted >= 0, hit, miss, prefetch_hit]) & counted[:, None, None]).sum(dim=-1)
    totals = per_head.sum(dim=(1, 2))  # [4]
    warm_totals = (per_head[:2] * warm[:, None]).sum(dim=(1, 2))  # selected and hits of warm rows
    deltas = torch.cat([totals.new_ones(1), totals[:3], warm_totals, totals[3:]])
    misses = per_head[2]  # [R, Hkv]
    warm_misses = torch.where(warm[:, None], misses, 0).amax() if misses.numel() else misses.new_zeros(())
    return deltas, warm_misses, misses
