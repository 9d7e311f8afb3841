"""The device block cache: the blocks each decode step attends to, resident in device memory.

Per layer the cache is one set of device buffers, k and v [S, B, D] and cis [S, B] float32, of
S = G * Hkv * NS items: NS block slots for each of the Hkv KV heads of each of G requests (G =
the device budget's request count; request row r of SGLang's ReqToTokenPool owns group r - 1).
``blocks[layer]`` [G, Hkv, NS] says which block each slot holds (-1: none). The KV view that
decode and prefill read through is nosa.serve.offload.kv.OffloadKV; it calls ``resolve``.

Resolve, per layer and step, for the whole batch at once (``resolve_step``: tensors of fixed
shapes only and no host synchronisation, so a decode step can be captured):
1. diff the blocks the step needs (the selection; every block for a dense request) against the
   resident ones: hits keep their slot; misses take the slots whose blocks are no longer needed
   (empty slots first);
2. recall the misses from the host pool with ONE batched gather-scatter (nosa.ops.copy_items: K,
   V and cis together, index lists of fixed length padded with -1);
3. write the step's new token into its block's slot from the freshly computed K/V (the host pool
   got it too: write-through), so a resident tail block never needs a recall;
4. count, in device tensors (``stats`` reads them on the host, between steps);
5. return the device rows attention reads (nosa.kv.DeviceRows).
That torch code is the spec and what a GPU (and a CUDA graph) runs; on a CPU server, where its ~190
small operations per layer cost more than the copies, the same five steps run as one C++ call
(nosa.kernels.resolve_cpu; tested equal to the torch code).
The host side runs before: a group whose resident blocks went stale (tokens written other than by
a decode step, e.g. a prefill chunk) drops those blocks, so they are recalled (``begin_decode``
for every layer before a step; ``resolve`` does it per layer and wraps ``resolve_step`` with the
prefetch claim). A captured batch's padding rows resolve in the spare group (one more than the
requests), which no request owns.

Scheduling (``scheduler``: nosa.serve.offload.recall): the misses are a demand copy (prefetching
pauses at its next chunk boundary meanwhile) and the layer waits only for them;
``prefetch(layer + 1, ...)``, issued while layer ``layer`` computes, copies predicted blocks into
EMPTY slots only (never evicting a resident block), and the layer's resolve first claims it:
only the items that landed count as resident, the rest are dropped. The diff then runs as if the
prefetch had not happened, so the slot map after every resolve is exactly the one without
prefetch (outputs and every later hit and miss are the same with scheduling on or off); a
selected block that a prefetch landed is moved on the device into its slot, a hit
(``prefetch_hits``) instead of a host recall.

Slot columns (admission): slot j of group g is physical column ``col_of[g, j]``; column p is the
item set ``((p // home) * Hkv + h) * home + p % home`` of every KV head h (``home`` slots per
group: without admission all NS slots, so column g * NS + j is simply slot j of group g). With
admission, groups own ``home = topk`` columns and may borrow idle groups' columns as extra slots
(``set_extra``); a group that starts takes its own columns back (``activate``).

Counters (``stats``, kept on the device by the step): per layer, selected blocks, hits (prefetch
hits included), misses (= items recalled on demand), recalled bytes, prefetched / prefetch_hits /
prefetch_dropped items, recall and stall seconds of synchronous copies (without a scheduler; with
one, see its ``stats``; not measured in a captured step),
and for "warm" steps (the group's previous step was a decode step, so the cache is in steady
state) selected blocks, hits and the most misses one (request, KV head) had: the locality bound
says at most query_blocks + 1 for heads with A != 0.
"""

from __future__ import annotations

import threading
import time
from typing import NamedTuple

import torch

from nosa.kv import DeviceRows
from nosa.serve.offload.recall import PREFETCH, Transfer
from nosa.serve.step import captured

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
            blocks.index_copy_(0, groups, _place(current, dst_slot, predicted, take, self.ns))
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

    def resolve(self, layer: int, groups: torch.Tensor, wanted: torch.Tensor, lengths: list[int],
                pages: torch.Tensor, host_items, new_tokens: NewTokens | None = None) -> DeviceRows:
        """Make ``wanted`` [R, Hkv, W] (block ids, -1 padded; W <= NS) resident and return their rows.

        groups [R]: the requests' device groups (``groups_of``); lengths: their context lengths
        (tokens); pages [R, Hkv, W]: the host page of each wanted block; host_items: the layer's
        (k, v, cis) item views of the host pool. new_tokens: the step's last token of each request
        (decode), written into its block's slot. The host side around ``resolve_step``: stale blocks
        dropped, the layer's prefetch claimed, the groups recorded as synced.
        """
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
            found = self.resolve_step(layer, groups, wanted, torch.tensor(lengths, device=device), pages, host_items,
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
        blocks.index_copy_(0, groups, _place(virtual, dst_slot, wanted, miss, self.ns))
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


def _place(current: torch.Tensor, dst_slot: torch.Tensor, wanted: torch.Tensor, miss: torch.Tensor, ns: int):
    """current [R, Hkv, NS] with wanted[miss] written at dst_slot[miss] (others untouched)."""
    spill = torch.cat([current, current.new_full((*current.shape[:-1], 1), -1)], dim=-1)
    spill.scatter_(-1, torch.where(miss, dst_slot, ns), torch.where(miss, wanted, -1))
    return spill[..., :ns]
