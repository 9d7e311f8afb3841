"""DeviceBlockCache: the blocks each decode step attends to, resident in device memory.

Per layer: k, v [S, B, D] and cis [S, B] float32 of S = (G + 1) * Hkv * home items (G requests
of the device budget, request row r owning group r - 1, plus the spare group of a captured batch's
padding rows); ``blocks[layer]`` [G + 1, Hkv, NS]: the block each slot holds (-1: none); slot j of
group g is physical column ``col_of[g, j]`` (admission lends idle groups' columns as extra slots).
Two ways in, one per contract: ``resolve`` is the KV view's (nosa.serve.offload.kv.OffloadKV, eager:
stale blocks dropped, prefetch claimed, groups synced for that layer); ``resolve_layer`` is a decode
step's layer (nosa.serve.offload.engine, on fixed shapes, after ``begin_decode`` and
``claim_prefetch``): the slot diff, one batched recall, the new tokens' write-through, the counters
(the math: nosa.serve.offload.resolve). ``prefetch`` fills empty slots only, so the slot map after
every resolve is the one without prefetch. ``stats`` reads the counters on the host.
"""

from __future__ import annotations

import threading
import time
from typing import NamedTuple

import torch

from nosa import ops
from nosa.kernels import resolve_cpu
from nosa.kv import DeviceRows
from nosa.kvquant import QuantizedItems
from nosa.serve.metadata import captured
from nosa.serve.offload.recall import PREFETCH, Transfer
from nosa.serve.offload.resolve import (
    COUNT_KEYS,
    NewTokens,
    PageTable,
    attended_rows,
    diff_slots,
    place,
    step_counts,
    tail_rows,
)


class Loan(NamedTuple):
    """A column lent to another group as one of its extra slots."""

    group: int
    slot: int


class PendingPrefetch(NamedTuple):
    """A layer's prefetch in flight: the transfer, and for its m-th item the group [M], KV head [M]
    and slot [M] it lands in (claimed when the layer resolves)."""

    transfer: Transfer
    groups: torch.Tensor
    heads: torch.Tensor
    slots: torch.Tensor


class DeviceBlockCache:
    """The device block slots of ``num_groups`` requests (and the spare group) x ``num_kv_heads``
    x ``slots_per_head``, per layer, of blocks of ``block_size`` tokens. ``home_slots``: the slots a
    group owns (default all; admission: topk_blocks, the rest borrowed); ``scheduler``: the recall
    scheduler (nosa.serve.offload.recall) its copies go through, or None (copied inline)."""

    def __init__(self, num_layers: int, num_groups: int, num_kv_heads: int, slots_per_head: int,
                 block_size: int, head_dim: int, v_head_dim: int, dtype: torch.dtype, device,
                 scheduler=None, home_slots: int | None = None):
        self.groups, self.hkv, self.ns, self.block = num_groups, num_kv_heads, slots_per_head, block_size
        self.home = slots_per_head if home_slots is None else home_slots
        if not 1 <= self.home <= slots_per_head:
            raise ValueError(f"DeviceBlockCache: home_slots={self.home} must be in [1, {slots_per_head}] "
                             "(slots_per_head)")
        self.scheduler = scheduler
        # one more group than requests, the spare group: a captured step's padding rows resolve there
        self.spare_group = num_groups
        stored = num_groups + 1
        # a token row of the spare group: writes that must land somewhere harmless go there
        self.dump_row = self.spare_group * num_kv_heads * self.home * block_size
        items = stored * num_kv_heads * self.home
        # slot -> physical column; a group's own columns first, extra slots (j >= home) borrowed
        self.col_of = torch.full((stored, slots_per_head), -1, dtype=torch.long, device=device)
        self.col_of[:, : self.home] = torch.arange(stored * self.home, device=device).view(stored, self.home)
        self.lent: dict[int, Loan] = {}  # column -> the borrower's group and slot
        self.active: set[int] = set()
        self.k = [torch.zeros(items, block_size, head_dim, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(items, block_size, v_head_dim, dtype=dtype, device=device) for _ in range(num_layers)]
        self.cis = [torch.zeros(items, block_size, dtype=torch.float32, device=device) for _ in range(num_layers)]
        # the slot maps of every layer in one tensor (resident_slots reads it in one op); blocks[layer] its views
        self.slot_map = torch.full((num_layers, stored, num_kv_heads, slots_per_head), -1, dtype=torch.long,
                                   device=device)
        self.blocks = list(self.slot_map.unbind(0))
        # tokens of each group's sequence reflected in its resident blocks, per layer
        self.synced = [[0] * num_groups for _ in range(num_layers)]
        self.warm = [[False] * num_groups for _ in range(num_layers)]
        self.item_bytes = block_size * (head_dim * self.k[0].element_size() + v_head_dim * self.v[0].element_size() + 4)
        self._lock = threading.RLock()
        self.prefetched = [torch.zeros(stored, num_kv_heads, slots_per_head, dtype=torch.bool, device=device)
                           for _ in range(num_layers)]
        self.pending: dict[int, PendingPrefetch] = {}  # layer -> its prefetch in flight
        self.landed = [False] * num_layers  # a claimed prefetch landed items not yet resolved (host side)
        # per layer, groups known to have no empty usable slot (the CPU kernel says so after a resolve;
        # whatever frees a slot forgets the group): may_prefetch needs no tensor work for them
        self.full: list[set[int]] = [set() for _ in range(num_layers)]
        # warm_*: steps whose group decoded at the previous step too (the cache is in steady state)
        # prefetched: items a prefetch landed; prefetch_hits: wanted blocks resident thanks to one
        # counters a step adds on the device (``_count``; COUNT_KEYS), and those the host side keeps
        self.counts = torch.zeros(num_layers, len(COUNT_KEYS), dtype=torch.long, device=device)
        self.max_warm_misses = torch.zeros(num_layers, dtype=torch.long, device=device)
        self.group_misses = torch.zeros(stored, dtype=torch.long, device=device)  # items per group (admission)
        self.host_stats = {"prefetched": [0] * num_layers, "prefetch_dropped": [0] * num_layers,
                           "recall_seconds": [0.0] * num_layers, "stall_seconds": [0.0] * num_layers}

    def group_of(self, row: int) -> int:
        group = row - 1
        if not 0 <= group < self.groups:
            raise RuntimeError(f"nosa offloading: request row {row} has no device slots (groups 0..{self.groups - 1})")
        return group

    def groups_of(self, rows: list[int]) -> torch.Tensor:
        """[R] long: the device group of each request row (what resolve and prefetch take); the
        spare group for row 0, a captured batch's padding row."""
        return torch.tensor([self.group_of(r) if r else self.spare_group for r in rows], device=self.col_of.device)

    def release(self, row: int) -> None:
        """Forget a request's resident blocks (finished, aborted, retracted): its slots are free."""
        group = row - 1
        if 0 <= group < self.groups:
            with self._lock:
                for layer in range(len(self.blocks)):
                    self.blocks[layer][group] = -1
                    self.prefetched[layer][group] = False
                    self.synced[layer][group] = 0
                    self.warm[layer][group] = False
                    self.full[layer].discard(group)
                self.active.discard(group)
                for j in range(self.home, self.ns):  # borrowed columns go back
                    self._revoke(group, j)

    # ---- slot columns (admission) -------------------------------------------------------------
    def activate(self, row: int) -> None:
        """The request of ``row`` runs: its group takes back its own columns lent to others."""
        g = self.group_of(row)
        with self._lock:
            if g in self.active:
                return
            self.active.add(g)
            for p in range(g * self.home, (g + 1) * self.home):
                if p in self.lent:
                    self._revoke(*self.lent[p])

    def set_extra(self, grants: dict[int, int]) -> dict[int, int]:
        """Give each active group ``grants[g]`` extra slots (at most NS - home) from free columns
        (idle groups' own ones); returns what each group holds after (fewer if none were free)."""
        with self._lock:
            for g, n in grants.items():
                for j in range(self.home + max(0, n), self.ns):
                    self._revoke(g, j)
            free = [p for p in range(self.groups * self.home)
                    if p // self.home not in self.active and p not in self.lent]
            for g, n in sorted(grants.items()):
                for j in range(self.home, min(self.ns, self.home + n)):
                    if int(self.col_of[g, j]) < 0 and free:
                        p = free.pop(0)
                        self.col_of[g, j] = p
                        self.lent[p] = Loan(g, j)
                        for full in self.full:  # an empty usable slot now
                            full.discard(g)
            return {g: int((self.col_of[g, self.home:] >= 0).sum()) for g in grants}

    def free_columns(self) -> int:
        with self._lock:
            return sum(1 for p in range(self.groups * self.home)
                       if p // self.home not in self.active and p not in self.lent)

    def _revoke(self, g: int, j: int) -> None:
        p = int(self.col_of[g, j])
        if p < 0 or j < self.home:
            return
        for layer in range(len(self.blocks)):
            self.blocks[layer][g, :, j] = -1
            self.prefetched[layer][g, :, j] = False
        self.col_of[g, j] = -1  # the slot has no column: the group stays as full as it was
        self.lent.pop(p, None)

    def _items(self, groups: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """Device item of (groups[r], head h, slots[r, h, w]) -> [R, Hkv, W] (garbage where no column)."""
        cols = self.col_of.index_select(0, groups)[:, None, :].expand(-1, self.hkv, -1).gather(-1, slots)
        heads = torch.arange(self.hkv, device=slots.device)[None, :, None]
        return ((cols // self.home) * self.hkv + heads) * self.home + cols % self.home

    def _drop_stale(self, layer: int, g: int, fresh: int) -> bool:
        """Drop the group's blocks holding tokens written other than by decode; True if any were."""
        if self.synced[layer][g] < fresh:
            row_blocks = self.blocks[layer][g]
            row_blocks[row_blocks >= self.synced[layer][g] // self.block] = -1
            self.full[layer].discard(g)
            self.synced[layer][g] = fresh
            self.warm[layer][g] = False
            return True
        return False

    # ---- prefetch ------------------------------------------------------------------------------
    def may_prefetch(self, layer: int, groups: torch.Tensor, lengths: list[int]) -> bool:
        """Whether a prefetch for this decode step (groups [R], their context ``lengths``) could place
        anything: a group has blocks gone stale or an empty slot (in steady state neither, so the
        prediction is not even computed)."""
        if self.scheduler is None:
            return False
        with self._lock:
            listed = groups.tolist()
            if any(self.synced[layer][g] < n - 1 for g, n in zip(listed, lengths)):
                return True
            if all(g in self.full[layer] for g in listed):
                return False
            usable = (self.col_of.index_select(0, groups) >= 0)[:, None, :]
            return bool(((self.blocks[layer].index_select(0, groups) < 0) & usable).any())

    def prefetch(self, layer: int, groups: torch.Tensor, predicted: torch.Tensor, lengths: list[int],
                 pages: torch.Tensor, host_items) -> int:
        """Start copying the predicted blocks [R, Hkv, P] (-1 padded; pages: their host pages) of the
        decode step of groups [R] with context ``lengths`` into empty slots of ``layer``; returns the
        items issued. Needs a scheduler (no-op without). Never evicts a resident block."""
        if self.scheduler is None:
            return 0
        with self._lock:
            self._settle(layer)
            for i, g in enumerate(groups.tolist()):
                self._drop_stale(layer, g, lengths[i] - 1)
            blocks = self.blocks[layer]
            current = blocks.index_select(0, groups)  # [R, Hkv, NS]
            usable = (self.col_of.index_select(0, groups) >= 0)[:, None, :]
            same = predicted[..., :, None] == predicted[..., None, :]
            earlier = torch.ones_like(same[0, 0]).tril(-1)
            duplicate = (same & earlier).any(dim=-1)
            present = (current[..., :, None] == predicted[..., None, :]).any(dim=-2)
            want = (predicted >= 0) & ~present & ~duplicate  # [R, Hkv, P]
            empty = (current < 0) & usable
            rank = want.long().cumsum(dim=-1) - 1
            take = want & (rank < empty.sum(dim=-1, keepdim=True))
            if not bool(take.any()):
                return 0
            empty_slots = (~empty).long().sort(dim=-1, stable=True).indices  # empty slots first
            dst_slot = empty_slots.gather(-1, rank.clamp(0, self.ns - 1))
            blocks.index_copy_(0, groups, place(current, dst_slot, predicted, take, self.ns))
            item = self._items(groups, dst_slot)
            heads = torch.arange(self.hkv, device=predicted.device)[None, :, None]
            which = take.flatten().nonzero().flatten()
            src = (pages * self.hkv + heads).flatten().index_select(0, which)
            dst = item.flatten().index_select(0, which)
            g_of = groups[:, None, None].expand_as(take).flatten().index_select(0, which)
            h_of = heads.expand_as(take).flatten().index_select(0, which)
            s_of = dst_slot.flatten().index_select(0, which)
            job = self.scheduler.submit(layer, PREFETCH, [self.k[layer], self.v[layer], self.cis[layer]],
                                        list(host_items), dst, src)
            self.pending[layer] = PendingPrefetch(job, g_of, h_of, s_of)
            return int(which.numel())

    def _settle(self, layer: int) -> None:
        """Claim the layer's prefetch: landed items are resident (flagged), the others dropped."""
        pending = self.pending.pop(layer, None)
        if pending is None:
            return
        g_of, h_of, s_of = pending.groups, pending.heads, pending.slots
        landed = self.scheduler.claim(pending.transfer)
        blocks = self.blocks[layer]
        if landed < g_of.numel():
            blocks[g_of[landed:], h_of[landed:], s_of[landed:]] = -1
            self.full[layer].clear()  # (a prefetch only ever fills empty slots, so none were full)
        self.prefetched[layer][g_of[:landed], h_of[:landed], s_of[:landed]] = True
        self.landed[layer] = self.landed[layer] or landed > 0
        self.host_stats["prefetched"][layer] += landed
        self.host_stats["prefetch_dropped"][layer] += int(g_of.numel()) - landed

    def release_all(self) -> None:
        for row in range(1, self.groups + 1):
            self.release(row)

    def resident_slots(self) -> int:
        return int((self.slot_map[:, : self.groups] >= 0).sum())

    def begin_decode(self, groups: list[int], lengths: list[int]) -> list[bool]:
        """A decode step of groups ``groups`` with contexts ``lengths`` (the new token included) is
        about to run (host side, before a step that may be captured): each group drops its blocks
        that went stale in every layer (tokens written other than by a decode step, e.g. a prefill
        chunk, are in the host pool only) and is recorded as synced after the step. Returns whether
        each group was warm (its previous step was a decode step; the counters' steady state)."""
        warm = []
        with self._lock:
            for g, n in zip(groups, lengths):
                warm.append(self.warm[0][g] and self.synced[0][g] == n - 1)
                for layer in range(len(self.blocks)):
                    self._drop_stale(layer, g, n - 1)
                    self.synced[layer][g], self.warm[layer][g] = n, True
        return warm

    # ---- resolve: the KV view's (host side, eager) and a decode step's layer (fixed shapes) --------
    def resolve(self, layer: int, groups: torch.Tensor, wanted: torch.Tensor, lengths: list[int],
                pages: torch.Tensor, host_items, new_tokens: NewTokens | None = None) -> DeviceRows:
        """Make ``wanted`` [R, Hkv, W] (block ids, -1 padded; W <= NS) resident and return their rows:
        the KV view's resolve (nosa.serve.offload.kv.OffloadKV), run eagerly, outside a decode step.

        groups [R]: the requests' device groups (``groups_of``); lengths: their context lengths
        (tokens); pages [R, Hkv, W]: the host page of each wanted block; host_items: the layer's
        (k, v, cis) item views of the host pool. new_tokens: the step's last token of each request
        (decode), written into its block's slot. Around ``resolve_layer``, the host work a decode
        step does before it (``begin_decode``, ``claim_prefetch``), for this layer only: stale blocks
        dropped, the layer's prefetch claimed, the groups recorded as synced."""
        with self._lock:
            self._settle(layer)
            warm = []
            for i, g in enumerate(groups.tolist()):
                # decode writes exactly the last token itself; anything older than that went to the
                # host pool only, so the blocks holding it are dropped and recalled
                fresh = lengths[i] - (1 if new_tokens is not None else 0)
                warm.append(self.warm[layer][g] and self.synced[layer][g] == fresh)
                self._drop_stale(layer, g, fresh)
            prefetched = self.claim_prefetch(layer, groups) if self.scheduler is not None else None
            device = wanted.device
            found = self.resolve_layer(layer, groups, wanted, torch.tensor(lengths, device=device), pages, host_items,
                                       new_tokens, torch.tensor(warm, device=device), prefetched=prefetched)
            for g, n in zip(groups.tolist(), lengths):
                self.synced[layer][g] = n
                self.warm[layer][g] = new_tokens is not None
        return found

    def claim_prefetch(self, layer: int, groups: torch.Tensor) -> torch.Tensor | None:
        """Host side, before the layer resolves: its prefetch is claimed (landed items resident, the
        rest dropped); [R, Hkv, NS] the slots of ``groups`` it landed, or None when it landed none."""
        with self._lock:
            self._settle(layer)
            if not self.landed[layer]:  # nothing flagged since the last claim (steady state): no tensor work
                return None
            prefetched = self.prefetched[layer].index_select(0, groups)  # [R, Hkv, NS]
            self.prefetched[layer].index_fill_(0, groups, False)
            self.landed[layer] = bool(self.prefetched[layer].any())  # other groups' flags, if any, wait
        return prefetched if bool(prefetched.any()) else None

    def resolve_layer(self, layer: int, groups: torch.Tensor, wanted: torch.Tensor, lengths: torch.Tensor,
                      pages, host_items, new_tokens: NewTokens | None, warm: torch.Tensor,
                      real: torch.Tensor | None = None, prefetched: torch.Tensor | None = None) -> DeviceRows:
        """A decode step's layer: ``wanted`` [R, Hkv, W] of ``groups`` [R] resident, their DeviceRows.
        Shape-static, no host synchronisation (a step that may be captured): the slot diff, one
        batched recall (index lists of the fixed width R * Hkv * W, -1 where nothing is missing: a
        cold step may miss every wanted block), the new tokens' write-through, the counters.

        pages: [R, Hkv, W] host pages, or the PageTable to look them up in; lengths [R] long; warm
        [R] bool (counters); real [R] bool, False for padding rows (spare group; counted nowhere);
        ``prefetched`` [R, Hkv, NS]: slots a prefetch landed (``claim_prefetch``; host side only).
        On a CPU server (no prefetch to place) one fused kernel, nosa.kernels.resolve_cpu, runs it;
        this torch code is its spec."""
        quantized = isinstance(host_items[0], QuantizedItems)  # NOSA_HOST_KV_DTYPE: recalls dequantize
        if prefetched is None and resolve_cpu.wanted_here(wanted, self.k[layer]) and not (quantized and captured()):
            return self._resolve_fused(layer, groups, wanted, lengths, pages, host_items, new_tokens, warm, real)
        if isinstance(pages, PageTable):
            pages = pages.pages(wanted, self.block)
        # 1. the slot diff (nosa.serve.offload.resolve.diff_slots), as if no prefetch had happened
        blocks = self.blocks[layer]
        usable = (self.col_of.index_select(0, groups) >= 0)[:, None, :]
        diff = diff_slots(blocks.index_select(0, groups), wanted, usable, prefetched)
        blocks.index_copy_(0, groups, diff.blocks)
        item = self._items(groups, diff.slot_of)  # device item of each wanted block
        dst_bufs = [self.k[layer], self.v[layer], self.cis[layer]]
        if diff.landed_slot is not None:  # a prefetch hit moves on the device to the slot the diff gave it
            move = diff.prefetch_hit & (diff.landed_slot != diff.dst_slot)
            if bool(move.any()):  # read every source first: a destination may be another's
                src_items = self._items(groups, diff.landed_slot)[move]
                moved = [t.index_select(0, src_items) for t in dst_bufs]
                for t, m in zip(dst_bufs, moved):
                    t.index_copy_(0, item[move], m)
        # 2. one batched recall for every request and KV head of the batch
        heads = torch.arange(self.hkv, device=wanted.device)[None, :, None]
        src = torch.where(diff.demand, pages * self.hkv + heads, -1).flatten()
        dst = torch.where(diff.demand, item, -1).flatten()
        if captured():
            ops.copy_items(dst_bufs, list(host_items), dst, src)
        elif self.scheduler is not None:  # prefetching pauses while this layer's own misses are copied
            which = diff.demand.flatten().nonzero().flatten()
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
        self._count(layer, groups, wanted, diff.hit | diff.prefetch_hit, diff.demand, diff.prefetch_hit, warm, real)
        # 4. rows of the resolved blocks: item * B + token offset
        return self._device_rows(layer, *attended_rows(item, wanted, lengths, self.block))

    def _resolve_fused(self, layer, groups, wanted, lengths, pages, host_items, new_tokens, warm, real) -> DeviceRows:
        """``resolve_layer`` without a prefetch, as one CPU kernel call (nosa.kernels.resolve_cpu)."""
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
        # the kernel only diffs (and lists the misses) when the copy is someone else's: the scheduler's,
        # or nosa.ops.copy_items' for a quantized pool (it dequantizes: its C++ loop)
        copy_after = by_scheduler or isinstance(host_items[0], QuantizedItems)
        start = time.perf_counter()
        done = resolve_cpu.resolve_layer(self.blocks[layer], self.col_of, groups, wanted, pages, lengths, warm, real,
                                         bufs, list(host_items), new, self.dump_row, self.counts[layer],
                                         self.max_warm_misses[layer], self.group_misses, self.home,
                                         copy=not copy_after)
        with self._lock:
            # (padding rows resolve in the spare group, which the kernel does not count)
            self.full[layer] = set(groups.tolist()) - {self.spare_group} if done.empty == 0 else set()
        if copy_after:  # the demand copy (through the scheduler: prefetching pauses meanwhile), then the new tokens
            if by_scheduler:
                self.scheduler.demand(layer, bufs, list(host_items), done.miss_dst, done.miss_src)
            else:
                ops.copy_items(bufs, list(host_items), done.miss_dst, done.miss_src)
            if new is not None:
                resolve_cpu.write_tokens(wanted, lengths, done.item, bufs, new, self.dump_row)
        if not by_scheduler and done.miss_dst.numel():
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
        rows = tail_rows(wanted, item, lengths, self.block, self.dump_row)
        # (item, token) indices into the buffers themselves: after the recall's operator mutated them, a
        # write through a view made torch.compile copy each whole buffer onto itself every step
        where = (rows // self.block, rows % self.block)
        k, v = self.k[layer], self.v[layer]
        k.index_put_(where, k_new.reshape(rows.numel(), -1).to(k.dtype))
        v.index_put_(where, v_new.reshape(rows.numel(), -1).to(v.dtype))
        self.cis[layer].index_put_(where, cis_new.reshape(-1).float())

    def _count(self, layer, groups, wanted, hit, miss, prefetch_hit, warm, real) -> None:
        """Add the step's counters on the device (read on the host with ``stats``, outside a step)."""
        deltas, warm_misses, misses = step_counts(wanted, hit, miss, prefetch_hit, warm, real)
        self.counts[layer] += deltas
        self.max_warm_misses[layer] = torch.maximum(self.max_warm_misses[layer], warm_misses)
        self.group_misses.index_add_(0, groups, misses.sum(dim=-1))

    @property
    def stats(self) -> dict[str, list]:
        """Per layer counters (a host read of the device counters: not inside a step): steps, selected,
        hits (prefetch hits included), misses (= items recalled on demand), recalled_bytes,
        warm_selected / warm_hits / max_warm_misses, prefetched / prefetch_hits / prefetch_dropped,
        recall_seconds / stall_seconds (copies without a scheduler, not measured in captured steps)."""
        counts = self.counts.tolist()
        out = {key: [c[i] for c in counts] for i, key in enumerate(COUNT_KEYS)}
        out["recalled_bytes"] = [m * self.item_bytes for m in out["misses"]]
        out["max_warm_misses"] = self.max_warm_misses.tolist()
        for key, values in self.host_stats.items():
            out[key] = list(values)
        return out

    def step_group_bytes(self) -> dict[int, int]:
        """Bytes recalled per device group since ``clear_group_bytes`` (admission's per-request demand)."""
        misses = self.group_misses[: self.groups].tolist()
        return {g: n * self.item_bytes for g, n in enumerate(misses) if n}

    def clear_group_bytes(self) -> None:
        self.group_misses.zero_()

