"""The device block cache and the offloaded KV view (the "resolve" step of a decode step).

Per layer the cache is one set of device buffers, k and v [S, B, D] and cis [S, B] float32, of
S = G * Hkv * NS items: NS block slots for each of the Hkv KV heads of each of G requests (G =
the device budget's request count; request row r of SGLang's ReqToTokenPool owns group r - 1).
``blocks[layer]`` [G, Hkv, NS] says which block each slot holds (-1: none).

Resolve, per layer and step, for the whole batch at once:
1. diff the blocks the step needs (the selection; every block for a dense request) against the
   resident ones: hits keep their slot; misses take the slots whose blocks are no longer needed
   (empty slots first);
2. recall the misses from the host pool with ONE batched gather-scatter (nosa.ops.copy_items: K,
   V and cis together, fixed-length index lists padded with -1);
3. write the step's new token into its block's slot from the freshly computed K/V (the host pool
   got it too: write-through), so a resident tail block never needs a recall;
4. return the device rows attention reads (nosa.kv.DeviceRows).
A group whose resident blocks went stale (tokens written other than by a decode step, e.g. a
prefill chunk) drops those blocks before the diff, so they are recalled.

Counters (``stats``): per layer, selected blocks, hits, misses (= recalled items), recalled bytes,
and for "warm" steps (the group's previous step was a decode step, so the cache is in steady
state) selected blocks, hits and the most misses one (request, KV head) had: the locality bound
says at most query_blocks + 1 for heads with A != 0.
"""

from __future__ import annotations

import threading

import torch

from nosa.kv import DeviceRows


class DeviceBlockCache:
    def __init__(self, num_layers: int, num_groups: int, num_kv_heads: int, slots_per_head: int,
                 block_size: int, head_dim: int, v_head_dim: int, dtype: torch.dtype, device):
        self.groups, self.hkv, self.ns, self.block = num_groups, num_kv_heads, slots_per_head, block_size
        items = num_groups * num_kv_heads * slots_per_head
        self.k = [torch.zeros(items, block_size, head_dim, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(items, block_size, v_head_dim, dtype=dtype, device=device) for _ in range(num_layers)]
        self.cis = [torch.zeros(items, block_size, dtype=torch.float32, device=device) for _ in range(num_layers)]
        self.blocks = [torch.full((num_groups, num_kv_heads, slots_per_head), -1, dtype=torch.long, device=device)
                       for _ in range(num_layers)]
        # tokens of each group's sequence reflected in its resident blocks, per layer
        self.synced = [[0] * num_groups for _ in range(num_layers)]
        self.warm = [[False] * num_groups for _ in range(num_layers)]
        self.item_bytes = block_size * (head_dim * self.k[0].element_size() + v_head_dim * self.v[0].element_size() + 4)
        self._lock = threading.Lock()
        # warm_*: steps whose group decoded at the previous step too (the cache is in steady state)
        self.stats = {key: [0] * num_layers for key in
                      ("selected", "hits", "misses", "recalled_bytes", "steps",
                       "warm_selected", "warm_hits", "max_warm_misses")}

    def group_of(self, row: int) -> int:
        group = row - 1
        if not 0 <= group < self.groups:
            raise RuntimeError(f"nosa offloading: request row {row} has no device slots (groups 0..{self.groups - 1})")
        return group

    def release(self, row: int) -> None:
        """Forget a request's resident blocks (finished, aborted, retracted): its slots are free."""
        group = row - 1
        if 0 <= group < self.groups:
            with self._lock:
                for layer in range(len(self.blocks)):
                    self.blocks[layer][group] = -1
                    self.synced[layer][group] = 0
                    self.warm[layer][group] = False

    def release_all(self) -> None:
        for row in range(1, self.groups + 1):
            self.release(row)

    def resident_slots(self) -> int:
        return int(sum(int((b >= 0).sum()) for b in self.blocks))

    def resolve(self, layer: int, rows: list[int], wanted: torch.Tensor, lengths: list[int], pages: torch.Tensor,
                host_items, new_tokens: tuple | None = None) -> DeviceRows:
        """Make ``wanted`` [R, Hkv, W] (block ids, -1 padded; W <= NS) resident and return their rows.

        rows: the requests' ReqToTokenPool rows; lengths: their context lengths (tokens);
        pages [R, Hkv, W]: the host page of each wanted block; host_items: the layer's (k, v, cis)
        item views of the host pool. new_tokens: (k [R, Hkv, D], v, cis [R, Hkv]) of the step's
        last token of each request (decode), written into its block's slot.
        """
        from nosa import ops

        groups = torch.tensor([self.group_of(r) for r in rows], device=wanted.device)
        blocks = self.blocks[layer]
        with self._lock:
            warm = []
            for i, g in enumerate(groups.tolist()):
                # decode writes exactly the last token itself; anything older than that went to the
                # host pool only, so the blocks holding it are dropped and recalled
                fresh = lengths[i] - (1 if new_tokens is not None else 0)
                stale_from = self.synced[layer][g] // self.block
                if self.synced[layer][g] < fresh:
                    row_blocks = blocks[g]
                    row_blocks[row_blocks >= stale_from] = -1
                warm.append(self.warm[layer][g] and self.synced[layer][g] == fresh)
            current = blocks.index_select(0, groups)  # [R, Hkv, NS]
            match = (current[..., :, None] == wanted[..., None, :]) & (wanted[..., None, :] >= 0)  # [R,Hkv,NS,W]
            keep = match.any(dim=-1)  # slot holds a wanted block
            hit = match.any(dim=-2)  # wanted block already resident
            miss = (wanted >= 0) & ~hit  # [R, Hkv, W]
            # misses take the free slots in order: empty ones first, then those whose block left
            order = keep.long() * 2 + (current >= 0).long()  # 0 empty, 1 stale, 2 kept
            free_slots = order.sort(dim=-1, stable=True).indices  # [R, Hkv, NS]
            rank = (miss.cumsum(dim=-1) - 1).clamp(min=0)
            dst_slot = free_slots.gather(-1, rank)  # [R, Hkv, W] slot of each miss
            new = _place(current, dst_slot, wanted, miss, self.ns)
            blocks.index_copy_(0, groups, new)
            # where each wanted block now sits
            slot_of = torch.where(hit, (match.long().argmax(dim=-2)), dst_slot)  # [R, Hkv, W]
            base = (groups[:, None, None] * self.hkv + torch.arange(self.hkv, device=wanted.device)[None, :, None])
            item = base * self.ns + slot_of  # device item of each wanted block
            # 2. one batched recall for every request and KV head of the batch
            heads = torch.arange(self.hkv, device=wanted.device)[None, :, None]
            src = torch.where(miss, pages * self.hkv + heads, -1).flatten()
            dst = torch.where(miss, item, -1).flatten()
            ops.copy_items([self.k[layer], self.v[layer], self.cis[layer]], list(host_items), dst, src)
            # 3. the new token of each request into its block's slot (write-through; no recall needed)
            if new_tokens is not None:
                self._write_tokens(layer, wanted, item, lengths, new_tokens)
            for g, n in zip(groups.tolist(), lengths):
                self.synced[layer][g] = n
                self.warm[layer][g] = new_tokens is not None
            self._count(layer, wanted, hit, miss, warm)
        # 4. rows of the resolved blocks: item * B + token offset
        offsets = torch.arange(self.block, device=wanted.device)
        token_rows = (item[..., None] * self.block + offsets).flatten(-2)  # [R, Hkv, W*B]
        positions = (wanted.clamp(min=0)[..., None] * self.block + offsets).flatten(-2)
        length_t = torch.tensor(lengths, device=wanted.device)[:, None, None]
        valid = (wanted >= 0).repeat_interleave(self.block, dim=-1) & (positions < length_t)
        fill = (length_t - wanted * self.block).clamp(0, self.block).int()
        return DeviceRows(self.k[layer].view(-1, self.k[layer].shape[-1]),
                          self.v[layer].view(-1, self.v[layer].shape[-1]),
                          self.cis[layer].view(-1), token_rows, valid,
                          items=(self.k[layer], self.v[layer], self.cis[layer]),
                          slots=torch.where(wanted >= 0, item, -1), fill=torch.where(wanted >= 0, fill, 0))

    def _write_tokens(self, layer, wanted, item, lengths, new_tokens) -> None:
        from nosa import ops

        k_new, v_new, cis_new = new_tokens  # [R, Hkv, D], [R, Hkv, D], [R, Hkv]
        last = torch.tensor(lengths, device=wanted.device) - 1
        here = wanted == (last // self.block)[:, None, None]  # [R, Hkv, W]: the tail block
        slot_item = torch.where(here, item, -1).max(dim=-1).values  # [R, Hkv]
        dst = (slot_item * self.block + (last % self.block)[:, None]).flatten()
        src = torch.where(slot_item.flatten() >= 0, torch.arange(dst.numel(), device=dst.device), -1)
        dst_k, dst_v, dst_c = (t.view(-1, t.shape[-1]) if t.dim() == 3 else t.view(-1, 1)
                               for t in (self.k[layer], self.v[layer], self.cis[layer]))
        ops.copy_items([dst_k, dst_v, dst_c],
                       [k_new.reshape(dst.numel(), -1).to(dst_k.dtype), v_new.reshape(dst.numel(), -1).to(dst_v.dtype),
                        cis_new.reshape(-1, 1).float()], dst, src)

    def _count(self, layer, wanted, hit, miss, warm) -> None:
        s = self.stats
        s["steps"][layer] += 1
        s["selected"][layer] += int((wanted >= 0).sum())
        s["hits"][layer] += int(hit.sum())
        misses = miss.sum(dim=-1)  # [R, Hkv]
        s["misses"][layer] += int(misses.sum())
        s["recalled_bytes"][layer] += int(misses.sum()) * self.item_bytes
        warm_t = torch.tensor(warm, device=misses.device)
        if bool(warm_t.any()):
            s["warm_selected"][layer] += int((wanted[warm_t] >= 0).sum())
            s["warm_hits"][layer] += int(hit[warm_t].sum())
            s["max_warm_misses"][layer] = max(s["max_warm_misses"][layer], int(misses[warm_t].max()))


def _place(current: torch.Tensor, dst_slot: torch.Tensor, wanted: torch.Tensor, miss: torch.Tensor, ns: int):
    """current [R, Hkv, NS] with wanted[miss] written at dst_slot[miss] (others untouched)."""
    spill = torch.cat([current, current.new_full((*current.shape[:-1], 1), -1)], dim=-1)
    spill.scatter_(-1, torch.where(miss, dst_slot, ns), torch.where(miss, wanted, -1))
    return spill[..., :ns]
