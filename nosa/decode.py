"""NOSA decode: one query per sequence per step with incremental state, the path serving and
generate() use.

Layout: q [R, Hq, D] (one row per decoding sequence); the keys/values of a sequence [L, Hkv, D], or
a paged pool [N, Hkv, D] shared by the sequences plus a slot table: token t of row i lives at pool
row ``slot_table[table_rows[i], t]`` (SGLang's req_to_token).

``decode_attend`` runs a whole batch in one call: per sequence only the q . compressed-key product
(its compressed keys are its own), then one batched selection (nosa.select), then per sequence one
gather of its selected blocks (all KV heads) from the pool and two matmuls.
``NosaDecodeState.attend`` is the same call for one sequence.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from nosa.attention import NEG_INF, attend_gathered, dense_attention, selected_tokens
from nosa.compress import compress_windows, pool_to_blocks
from nosa.config import NosaConfig
from nosa.eviction import block_means
from nosa.select import block_scores_from_logits, blocks_entering, select_blocks


class NosaDecodeState:
    """Incremental NOSA state of one sequence in one layer.

    Holds what the decode path needs beyond the KV itself: compressed keys [Hkv, C, D], token
    eviction scores cis [L, Hkv], the static block keys [Hkv, NB, 2] (pooled eviction score, block
    mean: the ``evict_scores`` of nosa.select.select_blocks) and the previous selection [Hkv, K].
    Everything grows linearly with the context (amortised doubling buffers) and is updated
    incrementally: a step touches only the newest window and block.
    The KV itself stays wherever the caller keeps it (HF cache, SGLang pool, host memory).
    """

    def __init__(self, cfg: NosaConfig, num_kv_heads: int, head_dim: int, device=None):
        self.cfg = cfg
        self.num_kv_heads = num_kv_heads
        self.length = 0
        self._ck = _Growable((num_kv_heads, 0, head_dim), torch.float32, device)
        self._cis = _Growable((0, num_kv_heads), torch.float32, device)
        self._static = _Growable((num_kv_heads, 0, 2), torch.float32, device, fill=NEG_INF)
        self.selection: torch.Tensor | None = None  # [Hkv, K]
        self.entering: torch.Tensor | None = None  # [Hkv] blocks new in the last selection

    @property
    def num_windows(self) -> int:
        return self._ck.size

    @property
    def compressed_keys(self) -> torch.Tensor:
        """[Hkv, C, D] float32."""
        return self._ck.view()

    @property
    def cis(self) -> torch.Tensor:
        """[L, Hkv] float32 token eviction scores."""
        return self._cis.view()

    @property
    def static_keys(self) -> torch.Tensor:
        """[Hkv, NB, 2] float32, as ``nosa.eviction.block_eviction_scores`` of the whole context, except
        that the current (incomplete) block's mean is only filled in when the block completes: it is
        always inside the local window, so it is never ranked before then."""
        return self._static.view()

    def append(self, k_all: torch.Tensor, cis_new: torch.Tensor, slots: torch.Tensor | None = None) -> None:
        """Account for m new tokens; cis_new: [m, Hkv].

        k_all: the sequence's keys including the new ones, [L, Hkv, D]; or, with ``slots`` [L]
        (token t at pool row slots[t], SGLang's req_to_token row), a paged pool [N, Hkv, D]. Only the
        rows of the new compressed windows are read."""
        cfg = self.cfg
        old_length = self.length
        new_length = old_length + cis_new.shape[0]
        have = k_all.shape[0] if slots is None else slots.shape[0]
        if have != new_length:
            raise ValueError(f"NosaDecodeState.append: expected keys for {new_length} tokens, got {have}")
        self._cis.extend(cis_new.detach().float())
        num_blocks = cfg.num_blocks(new_length)
        self._static.grow_to(num_blocks)
        static = self._static.view()
        # block means of the blocks this append completed
        done_lo, done_hi = old_length // cfg.block_size, new_length // cfg.block_size
        if done_hi > done_lo:
            tokens = self._cis.view()[done_lo * cfg.block_size : done_hi * cfg.block_size]
            static[:, done_lo:done_hi, 1] = block_means(tokens, done_hi - done_lo, cfg.block_size)
        first, total = self.num_windows, cfg.num_compressed(new_length)
        if total > first:
            lo = cfg.compress_stride * first
            hi = cfg.compress_stride * (total - 1) + cfg.compress_kernel
            rows = k_all[lo:hi] if slots is None else k_all.index_select(0, slots[lo:hi].long())
            self._ck.extend(compress_windows(rows.detach().float(), cfg, 0, total - first).transpose(0, 1))
            window_cis = compress_windows(self._cis.view(), cfg, first, total - first)  # [c, Hkv]
            pooled = pool_to_blocks(window_cis.transpose(0, 1), num_blocks, cfg, first_window=first)
            torch.maximum(static[..., 0], pooled, out=pooled)
            static[..., 0] = pooled
        self.length = new_length

    def select(self, q: torch.Tensor, scale: float) -> torch.Tensor:
        """Selection for the query of the last token. q: [Hq, D] -> [Hkv, K]."""
        return decode_select([self], q[None], scale)[0]

    def attend(
        self, q: torch.Tensor, k_all: torch.Tensor, v_all: torch.Tensor, scale: float,
        slots: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Decode attention for the last token: q [Hq, D] -> [Hq, D]. k_all/v_all: [L, Hkv, D], or
        paged pools [N, Hkv, D] with ``slots`` [L] as in ``append``."""
        table = None if slots is None else slots[None]
        return decode_attend([self], q[None], k_all, v_all, scale, slot_table=table)[0]


def decode_select(states: Sequence[NosaDecodeState], q: torch.Tensor, scale: float) -> torch.Tensor:
    """Selections for the last token of every sequence; q [R, Hq, D] -> [R, Hkv, K].

    Updates each state's ``selection`` and ``entering``."""
    cfg = states[0].cfg
    rows, hq, d = q.shape
    hkv = states[0].num_kv_heads
    group = hq // hkv
    lengths = [s.length for s in states]
    windows = [s.num_windows for s in states]
    num_blocks = cfg.num_blocks(max(lengths))
    max_windows = max(windows)
    qg = q.detach().float().reshape(rows, hkv, group, d)
    # Per sequence: its own compressed keys. Every complete window is visible to the last token.
    logits = qg.new_full((rows, hkv, group, max_windows), NEG_INF)
    static = qg.new_full((rows, hkv, num_blocks, 2), NEG_INF)
    for i, state in enumerate(states):
        if windows[i]:
            logits[i, :, :, : windows[i]] = torch.matmul(qg[i], state.compressed_keys.transpose(1, 2))
        nb = state.static_keys.shape[1]
        static[i, :, :nb] = state.static_keys
    logits.mul_(scale)
    visible = torch.arange(max_windows, device=q.device)[None, :] < torch.tensor(windows, device=q.device)[:, None]
    positions = torch.tensor(lengths, device=q.device) - 1
    qs = block_scores_from_logits(logits, visible, num_blocks, cfg)
    sel = select_blocks(qs, static, positions, cfg)  # [R, Hkv, K]
    have_prev = [i for i, s in enumerate(states) if s.selection is not None]
    if have_prev:
        prev = torch.stack([states[i].selection for i in have_prev])
        entering = blocks_entering(prev, sel[have_prev])
        for j, i in enumerate(have_prev):
            states[i].entering = entering[j]
    for i, state in enumerate(states):
        state.selection = sel[i]
    return sel


def decode_attend(
    states: Sequence[NosaDecodeState],
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    scale: float,
    slot_table: torch.Tensor | None = None,
    table_rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode attention of a batch: q [R, Hq, D] -> [R, Hq, D], the last token of each sequence.

    k_pool, v_pool: [N, Hkv, D]. Token t of sequence i lives at pool row
    ``slot_table[table_rows[i], t]`` (slot_table [*, T], int; table_rows [R], default 0..R-1);
    without a slot table, at row t (a single sequence whose keys are the pool).
    One selection for the whole batch (``decode_select``); then sequences above dense_len read only
    their selected blocks (K * block_size tokens per KV head), the others attend densely, as in
    ``nosa_prefill``."""
    cfg = states[0].cfg
    rows, hq, d = q.shape
    if len(states) != rows:
        raise ValueError(f"decode_attend: {len(states)} states for {rows} query rows")
    if slot_table is None and rows != 1:
        raise ValueError("decode_attend: several sequences need a slot table into the shared pool")
    if table_rows is None:
        table_rows = torch.arange(rows, device=q.device)
    hkv = k_pool.shape[1]
    sel = decode_select(states, q, scale)
    out = torch.empty(rows, hq, v_pool.shape[-1], dtype=q.dtype, device=q.device)
    sparse = [i for i, s in enumerate(states) if s.length > cfg.dense_len]
    for i, state in enumerate(states):
        if state.length <= cfg.dense_len:
            k, v = k_pool, v_pool
            if slot_table is not None:
                slots = slot_table[table_rows[i], : state.length].long()
                k, v = k_pool.index_select(0, slots), v_pool.index_select(0, slots)
            out[i] = dense_attention(q[i : i + 1], k[: state.length], v[: state.length], scale)[0]
    if not sparse:
        return out
    if len(sparse) < rows:
        index = torch.tensor(sparse, device=q.device)
        sel, table_rows = sel.index_select(0, index), table_rows.index_select(0, index)
    lengths = torch.tensor([states[i].length for i in sparse], device=q.device)
    tokens, valid = selected_tokens(sel, lengths, cfg.block_size)  # [n, Hkv, T]
    if slot_table is None:
        slots = tokens
    else:  # slot_table[table_rows[i], tokens[i]] for every i, one index_select (advanced indexing is slower)
        where = table_rows[:, None, None] * slot_table.shape[1] + tokens
        slots = slot_table.reshape(-1).index_select(0, where.flatten()).view_as(tokens).long()
    heads = torch.arange(hkv, device=q.device)[:, None]
    rows_kv = slots * hkv + heads  # pool row of (slot, head) in the [N * Hkv, D] view
    rows_cis = tokens * hkv + heads  # row of (token, head) in a state's [L * Hkv] cis
    cis = torch.stack([states[i].cis.reshape(-1).index_select(0, rows_cis[j].flatten()).view(hkv, -1)
                       for j, i in enumerate(sparse)])
    bias = torch.where(valid, cis, NEG_INF)  # [n, Hkv, T]
    # k_pool.reshape is a view of SGLang's contiguous buffers
    out[sparse] = attend_gathered(q[sparse], k_pool.reshape(-1, d), v_pool.reshape(-1, v_pool.shape[-1]),
                                  rows_kv, bias, scale)[0]
    return out


class _Growable:
    """A tensor growing along its one 0-sized dimension (``shape`` has exactly one 0), with
    amortised O(1) appends (capacity doubling)."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, device, fill: float = 0.0):
        self.axis = shape.index(0)
        cap_shape = list(shape)
        cap_shape[self.axis] = 16
        self._buf = torch.full(cap_shape, fill, dtype=dtype, device=device)
        self._fill = fill
        self.size = 0

    def _reserve(self, size: int) -> None:
        cap = self._buf.shape[self.axis]
        if size > cap:
            shape = list(self._buf.shape)
            shape[self.axis] = max(size, 2 * cap)
            new = self._buf.new_full(shape, self._fill)
            new.narrow(self.axis, 0, self.size).copy_(self.view())
            self._buf = new

    def extend(self, rows: torch.Tensor) -> None:
        count = rows.shape[self.axis]
        self._reserve(self.size + count)
        self._buf.narrow(self.axis, self.size, count).copy_(rows)
        self.size += count

    def grow_to(self, size: int) -> None:
        """Extend with fill entries up to ``size``."""
        if size > self.size:
            self._reserve(size)
            self.size = size

    def view(self) -> torch.Tensor:
        return self._buf.narrow(self.axis, 0, self.size)
