"""OffloadKV: the KV view (nosa.kv) of a batch whose KV lives in the host pool.

- ``keys`` / ``cis``: token rows read from the host pool (a state's newest compressed window,
  or its catch-up after a prefill chunk);
- ``gather_blocks``: a prefill chunk's union of blocks, copied from the host pool into a working
  buffer as whole (block, KV head) items (the context is never resident as a whole);
- ``resolve``: the decode step's blocks through the device block cache (diff, one batched recall,
  write-through of the new token; nosa.serve.block_cache); then ``after_resolve`` (the backend
  issues the next layer's prefetch there, so it moves while this layer attends);
- ``prefetch``: the predicted blocks (``predicted_blocks``) of this view's layer into empty slots.
Every read goes through nosa.ops.copy_items, which on CUDA reads the pinned host pool directly.
"""

from __future__ import annotations

import torch

from nosa import ops


class OffloadKV:
    def __init__(self, pool, cache, layer_id: int, req_to_token: torch.Tensor, rows: list[int],
                 lengths: list[int], device, new_tokens: tuple | None = None):
        self.pool, self.cache, self.layer_id = pool, cache, layer_id
        self.req_to_token, self.rows, self.lengths = req_to_token, rows, lengths
        self.device, self.new_tokens = device, new_tokens
        self.after_resolve = None  # callable run once this layer's blocks are resident
        self.block = pool.page_size
        self.host = pool.items(layer_id)  # (k [P*Hkv, B, D], v, cis [P*Hkv, B])

    def length(self, i: int) -> int:
        return self.lengths[i]

    def _token_read(self, which: int, i: int, lo: int, hi: int) -> torch.Tensor:
        rows = self.pool.token_rows(self.req_to_token[self.rows[i], lo:hi]).to(self.device)  # [n, Hkv]
        src = self.host[which]
        width = src.shape[-1] if which < 2 else 1
        out = torch.empty(rows.numel(), width, dtype=src.dtype, device=self.device)
        ops.copy_items([out], [src.view(-1, width)], torch.arange(rows.numel(), device=self.device), rows.flatten())
        return out.view(*rows.shape, width) if which < 2 else out.view(rows.shape)

    def keys(self, i: int, lo: int, hi: int) -> torch.Tensor:
        return self._token_read(0, i, lo, hi)

    def cis(self, i: int, lo: int, hi: int) -> torch.Tensor:
        return self._token_read(2, i, lo, hi)

    def _pages(self, row, blocks: torch.Tensor) -> torch.Tensor:
        """Host page of each block of a request (-1 blocks -> -1)."""
        first = self.req_to_token[row].index_select(0, blocks.clamp(min=0) * self.block).long()
        return torch.where(blocks >= 0, first // self.block, -1)

    def gather_blocks(self, i: int, blocks: torch.Tensor, block_size: int):
        hkv = self.pool.head_num
        pages = self._pages(self.rows[i], blocks.to(self.req_to_token.device)).to(self.device)  # [U]
        src = (pages[:, None] * hkv + torch.arange(hkv, device=self.device)).flatten()
        work = [torch.empty(src.numel(), *t.shape[1:], dtype=t.dtype, device=self.device) for t in self.host]
        ops.copy_items(work, list(self.host), torch.arange(src.numel(), device=self.device), src)
        u = blocks.numel()
        # items [U * Hkv, B, ...] -> token-major [U * B, Hkv, ...]
        return tuple(w.view(u, hkv, block_size, *w.shape[2:]).transpose(1, 2).reshape(u * block_size, hkv, *w.shape[2:])
                     for w in work)

    def _block_pages(self, blocks: torch.Tensor) -> torch.Tensor:
        """Host page of each block [R, Hkv, W] of the batch's requests (-1 blocks -> -1)."""
        table_rows = torch.tensor(self.rows, device=self.req_to_token.device)
        first_token = blocks.clamp(min=0).to(table_rows.device) * self.block
        where = table_rows[:, None, None] * self.req_to_token.shape[1] + first_token
        first = self.req_to_token.reshape(-1).index_select(0, where.flatten()).view(blocks.shape).long()
        return torch.where(blocks >= 0, first.to(blocks.device) // self.block, -1)

    def resolve(self, blocks: torch.Tensor, lengths: torch.Tensor, block_size: int):
        found = self.cache.resolve(self.layer_id, self.rows, blocks, self.lengths, self._block_pages(blocks),
                                   self.host, self.new_tokens)
        if self.after_resolve is not None:
            self.after_resolve()
        return found

    def prefetch(self, predicted: torch.Tensor) -> int:
        """Start recalling predicted blocks [R, Hkv, P] of this layer (nosa.serve.block_cache.prefetch)."""
        return self.cache.prefetch(self.layer_id, self.rows, predicted, self.lengths, self._block_pages(predicted),
                                   self.host)


def predicted_blocks(states, lengths: list[int], cfg) -> torch.Tensor:
    """[R, Hkv, 2K] blocks the decode step of context ``lengths`` will probably select, per request
    (states: its NosaDecodeState in the layer, or None): the static part of the new token's
    selection (nosa.select.static_selection: by the locality theorem it stays selected) first, then
    the previous step's selection; every block for requests within dense_len. -1 padded."""
    from nosa.attention.math import NEG_INF
    from nosa.select import static_selection

    known = [s for s in states if s is not None]
    if not known:
        raise ValueError("predicted_blocks: no state to predict from")
    hkv, device, k = known[0].num_kv_heads, known[0].static_keys.device, cfg.topk_blocks
    rows, nb = len(states), cfg.num_blocks(max(lengths))
    static = torch.full((rows, hkv, nb, 2), NEG_INF, device=device)
    previous = torch.full((rows, hkv, k), -1, dtype=torch.long, device=device)
    for i, state in enumerate(states):
        if state is not None:
            keys = state.static_keys[:, :nb]
            static[i, :, : keys.shape[1]] = keys
            if state.selection is not None:
                previous[i] = state.selection
    positions = torch.tensor(lengths, device=device) - 1
    out = torch.cat([static_selection(static, positions, cfg), previous], dim=-1)
    every = torch.arange(2 * k, device=device).expand(rows, hkv, 2 * k)
    count = torch.tensor([cfg.num_blocks(n) for n in lengths], device=device)[:, None, None]
    dense = (positions + 1 <= cfg.dense_len)[:, None, None]
    out = torch.where(dense, torch.where(every < count, every, -1), out)
    missing = torch.tensor([s is None for s in states], device=device)[:, None, None]
    return torch.where(missing, -1, out)
