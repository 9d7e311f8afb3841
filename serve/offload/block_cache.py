"""The device block cache: the blocks each decode step attends to, resident in device memory.

Per layer the cache is one set of device buffers, k and v [S, B, D] and cis [S, B] float32, of
S = G * Hkv * NS items: NS block slots for each of the Hkv KV heads of each of G requests (G =
the device budget's request count; request row r of SGLang's ReqToTokenPool owns group r - 1).
``blocks[layer]`` [G, Hkv, NS] says which block each slot holds (-1: none). The KV view that
decode and prefill read through is nosa.serve.offload.kv.OffloadKV; it calls ``resolve``.

Resolve, per layer and step, for the whole batch at once: the slot diff, one batched recall, the
write-through of the new tokens, the counters and the device rows attention reads; the device side
is ``resolve_step`` (nosa.serve.offload.resolve: its torch spec and the CPU kernel call).
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
from typing import NamedTuple

import torch

from nosa.kv import DeviceRows
from nosa.serve.offload.recall import PREFETCH, Transfer
from nosa.serve.offload.resolve import COUNT_KEYS, NewTokens, ResolveStep, place


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


class DeviceBlockCache(ResolveStep):
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

