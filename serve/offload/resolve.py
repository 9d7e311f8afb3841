"""The device side of a layer's resolve (DeviceBlockCache.resolve_step), for the whole batch at once,
on tensors of fixed shapes and without host synchronisation, so a decode step can be captured:
1. diff the blocks the step needs (the selection; every block for a dense request) against the
   resident ones: hits keep their slot; misses take the slots whose blocks are no longer needed
   (empty slots first);
2. recall the misses from the host pool with ONE batched gather-scatter (nosa.ops.copy_items: K,
   V and cis together, index lists of fixed length padded with -1);
3. write the step's new token into its block's slot from the freshly computed K/V (the host pool
   got it too: write-through), so a resident tail block never needs a recall;
4. count, in device tensors (``DeviceBlockCache.stats`` reads them on the host, between steps);
5. return the device rows attention reads (nosa.kv.DeviceRows).
That torch code is the spec and what a GPU (and a CUDA graph) runs; on a CPU server, where its ~190
small operations per layer cost more than the copies, the same five steps run as one C++ call
(nosa.kernels.resolve_cpu; tested equal to the torch code). The cache's state (slot maps, columns,
buffers, counters) and its host side are nosa.serve.offload.block_cache's.
"""

from __future__ import annotations

import time
from typing import NamedTuple

import torch

from nosa.kv import DeviceRows
from nosa.serve.metadata import captured

# What a slot offers a miss in the slot diff, best first (the key misses sort the slots by).
EMPTY_SLOT = 0  # holds no block
STALE_SLOT = 1  # holds a block this step does not want: evicted for the miss
KEPT_SLOT = 2  # holds a block this step wants
NO_COLUMN = 3  # an extra slot (admission) with no borrowed column behind it

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


class ResolveStep:
    """DeviceBlockCache's device side (a mixin: the cache's buffers, slot maps and counters are its own)."""

    def resolve_step(self, layer: int, groups: torch.Tensor, wanted: torch.Tensor, lengths: torch.Tensor,
                     pages, host_items, new_tokens: NewTokens | None, warm: torch.Tensor,
                     real: torch.Tensor | None = None, prefetched: torch.Tensor | None = None) -> DeviceRows:
        """The device side of ``resolve``, shape-static and without host synchronisation (a decode
        step that may be captured): the slot diff, one batched recall (index lists of the fixed
        width R * Hkv * W, -1 where nothing is missing: a cold step may miss every wanted block, a
        warm one at most query_blocks + 1 per KV head when the eviction heads are on), the
        write-through of the new tokens and the counters, kept on the device.

        pages: [R, Hkv, W] host pages, or the PageTable to look them up in; lengths [R] long; warm
        [R] bool (counters); real [R] bool, False for padding rows (their group is the spare group;
        counted nowhere). ``prefetched`` [R, Hkv, NS]: slots a prefetch landed (host side only:
        ``resolve`` passes it).

        On a CPU server (no prefetch to place) the same step runs as one fused kernel,
        nosa.kernels.resolve_cpu; this torch code is its spec."""
        from nosa import ops
        from nosa.kernels import resolve_cpu

        if prefetched is None and resolve_cpu.wanted_here(wanted, self.k[layer]):
            return self._resolve_fused(layer, groups, wanted, lengths, pages, host_items, new_tokens, warm, real)
        if isinstance(pages, PageTable):
            pages = pages.pages(wanted, self.block)
        blocks = self.blocks[layer]
        current = blocks.index_select(0, groups)  # [R, Hkv, NS]
        # The diff runs as if no prefetch had happened (prefetched slots count as empty), so the
        # slot map after this resolve is exactly the one without prefetch; a selected block that
        # a prefetch landed is then moved on the device to the slot the diff gave it (a prefetch
        # hit) instead of being recalled from the host (a demand miss).
        virtual = current if prefetched is None else torch.where(prefetched, -1, current)
        valid_w = wanted[..., None, :] >= 0
        match = (virtual[..., :, None] == wanted[..., None, :]) & valid_w  # [R, Hkv, NS, W]
        keep = match.any(dim=-1)  # slot holds a wanted block
        hit = match.any(dim=-2)  # wanted block already resident
        miss = (wanted >= 0) & ~hit  # [R, Hkv, W]
        if prefetched is None:
            landed, prefetch_hit, demand = None, torch.zeros_like(miss), miss
        else:
            landed = (current[..., :, None] == wanted[..., None, :]) & valid_w & prefetched[..., None]
            prefetch_hit = landed.any(dim=-2) & miss
            demand = miss & ~prefetch_hit
        # misses take the free slots in order: empty ones first, then those whose block left
        # (slots without a column, i.e. extra slots not granted, never)
        usable = (self.col_of.index_select(0, groups) >= 0)[:, None, :]
        offer = torch.where(keep, KEPT_SLOT, torch.where(virtual >= 0, STALE_SLOT, EMPTY_SLOT))
        offer = torch.where(usable, offer, NO_COLUMN)
        free_slots = offer.sort(dim=-1, stable=True).indices  # [R, Hkv, NS]
        rank = (miss.cumsum(dim=-1) - 1).clamp(min=0)
        dst_slot = free_slots.gather(-1, rank)  # [R, Hkv, W] slot of each miss
        blocks.index_copy_(0, groups, place(virtual, dst_slot, wanted, miss, self.ns))
        # where each wanted block now sits
        slot_of = torch.where(hit, (match.long().argmax(dim=-2)), dst_slot)  # [R, Hkv, W]
        item = self._items(groups, slot_of)  # device item of each wanted block
        dst_bufs = [self.k[layer], self.v[layer], self.cis[layer]]
        if landed is not None:
            move = prefetch_hit & (landed.long().argmax(dim=-2) != dst_slot)
            if bool(move.any()):  # read every source first: a destination may be another's
                src_items = self._items(groups, landed.long().argmax(dim=-2))[move]
                moved = [t.index_select(0, src_items) for t in dst_bufs]
                for t, m in zip(dst_bufs, moved):
                    t.index_copy_(0, item[move], m)
        # 2. one batched recall for every request and KV head of the batch
        heads = torch.arange(self.hkv, device=wanted.device)[None, :, None]
        src = torch.where(demand, pages * self.hkv + heads, -1).flatten()
        dst = torch.where(demand, item, -1).flatten()
        if captured():
            ops.copy_items(dst_bufs, list(host_items), dst, src)
        elif self.scheduler is not None:  # prefetching pauses while this layer's own misses are copied
            which = demand.flatten().nonzero().flatten()
            self.scheduler.demand(layer, dst_bufs, list(host_items), dst.index_select(0, which),
                                  src.index_select(0, which))
        else:
            start = time.perf_counter()
            ops.copy_items(dst_bufs, list(host_items), dst, src)
            seconds = time.perf_counter() - start  # CPU: the copy; CUDA: its launch only
            self.host_stats["recall_seconds"][layer] += seconds
            self.host_stats["stall_seconds"][layer] += seconds
        # 3. the new token of each request into its block's slot (write-through; no recall needed)
        if new_tokens is not None:
            self._write_tokens(layer, wanted, item, lengths, new_tokens)
        self._count(layer, groups, wanted, hit | prefetch_hit, demand, prefetch_hit, warm, real)
        # 4. rows of the resolved blocks: item * B + token offset
        offsets = torch.arange(self.block, device=wanted.device)
        token_rows = (item[..., None] * self.block + offsets).flatten(-2)  # [R, Hkv, W*B]
        positions = (wanted.clamp(min=0)[..., None] * self.block + offsets).flatten(-2)
        length_t = lengths[:, None, None]
        valid = (wanted >= 0).repeat_interleave(self.block, dim=-1) & (positions < length_t)
        fill = (length_t - wanted * self.block).clamp(0, self.block).int()
        return self._device_rows(layer, token_rows, valid, torch.where(wanted >= 0, item, -1),
                                 torch.where(wanted >= 0, fill, 0))

    def _resolve_fused(self, layer, groups, wanted, lengths, pages, host_items, new_tokens, warm, real) -> DeviceRows:
        """``resolve_step`` without a prefetch, as one CPU kernel call (nosa.kernels.resolve_cpu)."""
        from nosa.kernels import resolve_cpu

        bufs = [self.k[layer], self.v[layer], self.cis[layer]]
        new = None
        if new_tokens is not None:
            new = [t if t.dtype == b.dtype else t.to(b.dtype) for t, b in zip(new_tokens, bufs)]
        if captured():  # a compiled step (SGLang's CPU graph runner): the kernel as one operator
            # the operator takes the pages, or the table to look them up in
            given, table = (None, pages) if isinstance(pages, PageTable) else (pages, PageTable(None, None))
            item, rows, valid, fill = resolve_cpu.resolve_layer_op(
                self.blocks[layer], self.col_of, groups, wanted, given, table.req_to_token, table.rows, lengths,
                warm, real, bufs, list(host_items), new or [], self.dump_row, self.counts[layer],
                self.max_warm_misses[layer], self.group_misses, self.home)
            return self._device_rows(layer, rows, valid, item, fill)
        by_scheduler = self.scheduler is not None
        start = time.perf_counter()
        done = resolve_cpu.resolve_layer(self.blocks[layer], self.col_of, groups, wanted, pages, lengths, warm, real,
                                         bufs, list(host_items), new, self.dump_row, self.counts[layer],
                                         self.max_warm_misses[layer], self.group_misses, self.home,
                                         copy=not by_scheduler)
        with self._lock:
            # (padding rows resolve in the spare group, which the kernel does not count)
            self.full[layer] = set(groups.tolist()) - {self.spare_group} if done.empty == 0 else set()
        if by_scheduler:  # the demand copy through the scheduler (prefetching pauses meanwhile), then the new tokens
            self.scheduler.demand(layer, bufs, list(host_items), done.miss_dst, done.miss_src)
            if new is not None:
                resolve_cpu.write_tokens(wanted, lengths, done.item, bufs, new, self.dump_row)
        elif done.miss_dst.numel():
            seconds = time.perf_counter() - start  # the kernel's whole call: the copy and the diff
            self.host_stats["recall_seconds"][layer] += seconds
            self.host_stats["stall_seconds"][layer] += seconds
        return self._device_rows(layer, done.rows, done.valid, done.item, done.fill)

    def _device_rows(self, layer: int, rows, valid, slots, fill) -> DeviceRows:
        """The layer's buffers as attention reads them (row-major K, V, cis and the items), with the
        step's rows [R, Hkv, W*B], valid, slots [R, Hkv, W] (-1 = none) and fill."""
        k, v, cis = self.k[layer], self.v[layer], self.cis[layer]
        return DeviceRows(k.view(-1, k.shape[-1]), v.view(-1, v.shape[-1]), cis.view(-1), rows, valid,
                          items=(k, v, cis), slots=slots, fill=fill)

    def _write_tokens(self, layer, wanted, item, lengths, new_tokens) -> None:
        """The new token of each request [R] into the resident slot of its block (the window always
        holds it; where it is not resident, e.g. a padding row's, the write goes to the dump row):
        plain index copies, which a compiled step fuses."""
        k_new, v_new, cis_new = new_tokens
        last = lengths - 1
        here = wanted == (last // self.block)[:, None, None]  # [R, Hkv, W]: the tail block
        slot_item = torch.where(here, item, -1).max(dim=-1).values  # [R, Hkv]
        rows = torch.where(slot_item >= 0, slot_item * self.block + (last % self.block)[:, None], self.dump_row)
        rows = rows.flatten()
        # (item, token) indices into the buffers themselves: after the recall's operator mutated them, a
        # write through a view made torch.compile copy each whole buffer onto itself every step
        where = (rows // self.block, rows % self.block)
        k, v = self.k[layer], self.v[layer]
        k.index_put_(where, k_new.reshape(rows.numel(), -1).to(k.dtype))
        v.index_put_(where, v_new.reshape(rows.numel(), -1).to(v.dtype))
        self.cis[layer].index_put_(where, cis_new.reshape(-1).float())

    def _count(self, layer, groups, wanted, hit, miss, prefetch_hit, warm, real) -> None:
        """Add the step's counters on the device (read on the host with ``stats``, outside a step)."""
        counted = warm.new_ones(warm.shape) if real is None else real
        warm = warm & counted
        # one stacked count for the four kinds (selected, hits, misses, prefetch hits): fewer ops per layer
        per_head = (torch.stack([wanted >= 0, hit, miss, prefetch_hit]) & counted[:, None, None]).sum(dim=-1)
        totals = per_head.sum(dim=(1, 2))  # [4]
        warm_totals = (per_head[:2] * warm[:, None]).sum(dim=(1, 2))  # selected and hits of warm rows
        self.counts[layer] += torch.cat([totals.new_ones(1), totals[:3], warm_totals, totals[3:]])
        misses = per_head[2]  # [R, Hkv]
        warm_misses = torch.where(warm[:, None], misses, 0).amax() if misses.numel() else misses.new_zeros(())
        self.max_warm_misses[layer] = torch.maximum(self.max_warm_misses[layer], warm_misses)
        self.group_misses.index_add_(0, groups, misses.sum(dim=-1))




def place(current: torch.Tensor, dst_slot: torch.Tensor, wanted: torch.Tensor, miss: torch.Tensor, ns: int):
    """current [R, Hkv, NS] with wanted[miss] written at dst_slot[miss] (others untouched)."""
    spill = torch.cat([current, current.new_full((*current.shape[:-1], 1), -1)], dim=-1)
    spill.scatter_(-1, torch.where(miss, dst_slot, ns), torch.where(miss, wanted, -1))
    return spill[..., :ns]
