"""NOSA decode: one query per sequence per step with incremental state (serving and generate()).

A step is three public functions that a caller (the SGLang backend) runs in a straight line,
acting between them: 1. select (``decode_select``, then ``decode_blocks``: the blocks each
sequence reads); 2. resolve (``nosa.kv.KVView.resolve``: make them readable, say where they are);
3. attend (``attend_resolved``: (out, lse), so results over disjoint block sets merge exactly).
``decode_attend`` runs the three for a batch, ``NosaDecodeState.attend`` for one sequence.
Layout: q [R, Hq, D], one row per decoding sequence; K, V and cis live in a pool the caller owns,
read through a KVView: a state holds selection state only (in a ``DecodeStore``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple, Protocol

import torch

from nosa.attention.gathered import chunk_end, default_row_chunk
from nosa.attention.math import attend_gathered, dense_attention
from nosa.attention.paired import PLAN_PAIRS
from nosa.attention.prefill import attend_selected, select_rows
from nosa.compress import compress_windows, pool_to_blocks
from nosa.config import NosaConfig
from nosa.eviction import block_means
from nosa.kv import ContiguousKV, DeviceRows, KVView
from nosa.layout import NEG_INF
from nosa.select import block_scores_from_logits, select_blocks, selection_change, static_selection


class DecodeStore(Protocol):
    """Where a NosaDecodeState keeps its compressed and static keys (``GrowingStore``, or a row of
    nosa.state_pool.StatePool: ``PoolRow``). Hkv KV heads, C windows, NB blocks, D head dim:

    - ``num_windows``: C, the compressed keys held; ``keys()`` -> [Hkv, C, D] float32;
    - ``static()`` -> [Hkv, NB, 2] float32 (pooled eviction score, block mean; -inf not yet known);
    - the writes of ``NosaDecodeState.append``: ``add_windows(keys [Hkv, c, D])``,
      ``grow_blocks(NB)`` (new blocks -inf), ``set_means(first, means [Hkv, n])``,
      ``raise_pooled(pooled [Hkv, NB])`` (elementwise max with the pooled scores);
    - ``set_sizes(C, NB)``: the sizes after a batched step wrote the keys in place (a pool row only;
      others raise ValueError).
    """

    @property
    def num_windows(self) -> int: ...

    def keys(self) -> torch.Tensor: ...

    def static(self) -> torch.Tensor: ...

    def add_windows(self, keys: torch.Tensor) -> None: ...

    def grow_blocks(self, num_blocks: int) -> None: ...

    def set_means(self, first: int, means: torch.Tensor) -> None: ...

    def raise_pooled(self, pooled: torch.Tensor) -> None: ...

    def set_sizes(self, num_windows: int, num_blocks: int) -> None: ...


def union_rows(cfg: NosaConfig, num_kv_heads: int, row_chunk: int) -> int:
    """Rows of a prefill whose selected blocks ``NosaDecodeState.prefill`` gathers at once: the rows
    of one ``attend_pairs`` plan (PLAN_PAIRS (row, KV head, block) pairs), in whole row chunks."""
    return max(row_chunk, PLAN_PAIRS // max(1, num_kv_heads * cfg.topk_blocks) // row_chunk * row_chunk)


class NosaDecodeState:
    """Incremental NOSA selection state of one sequence in one layer.

    Holds compressed keys [Hkv, C, D], the static block keys [Hkv, NB, 2] (pooled eviction score,
    block mean: the ``evict_scores`` of nosa.select.select_blocks) and the last selection [Hkv, K]
    with the blocks that entered and left it. Everything grows linearly with the context
    (amortised doubling buffers) and is updated incrementally: a step touches only the newest
    window and block. K, V and cis stay in the caller's pool and are read through a KVView.

    ``store``: where the compressed and static keys live (a DecodeStore), if not in the state's own
    ``GrowingStore`` (the serving backend passes one row of nosa.state_pool.StatePool, whose
    batched step then updates the keys in place).
    """

    def __init__(self, cfg: NosaConfig, num_kv_heads: int, head_dim: int, device=None,
                 store: DecodeStore | None = None):
        self.cfg = cfg
        self.num_kv_heads = num_kv_heads
        self.length = 0
        self.store: DecodeStore = GrowingStore(num_kv_heads, head_dim, device) if store is None else store
        self.selection: torch.Tensor | None = None  # [Hkv, K]
        self.entered: torch.Tensor | None = None  # [Hkv, K] blocks new in the last selection, -1 padded
        self.left: torch.Tensor | None = None  # [Hkv, K] blocks of the previous selection dropped, -1 padded

    @property
    def entering(self) -> torch.Tensor | None:
        """[Hkv] how many blocks entered the last selection."""
        return None if self.entered is None else (self.entered >= 0).sum(dim=-1)

    @property
    def num_windows(self) -> int:
        return self.store.num_windows

    @property
    def compressed_keys(self) -> torch.Tensor:
        """[Hkv, C, D] float32."""
        return self.store.keys()

    @property
    def static_keys(self) -> torch.Tensor:
        """[Hkv, NB, 2] float32, as ``nosa.eviction.block_eviction_scores`` of the whole context, except
        that the current (incomplete) block's mean is only filled in when the block completes: it is
        always inside the local window, so it is never ranked before then."""
        return self.store.static()

    def append(self, kv: KVView, seq: int = 0) -> None:
        """Catch up with sequence ``seq`` of the KV view ``kv``: account for its tokens
        ``[self.length, kv.length(seq))``. Reads only the keys of the new compressed windows and
        the cis of the new windows and completed blocks."""
        cfg = self.cfg
        old_length, new_length = self.length, kv.length(seq)
        if new_length < old_length:
            raise ValueError(f"NosaDecodeState.append: the view holds {new_length} tokens, the state {old_length}")
        if new_length == old_length:
            return
        num_blocks = cfg.num_blocks(new_length)
        self.store.grow_blocks(num_blocks)
        # block means of the blocks this append completed
        done_lo, done_hi = old_length // cfg.block_size, new_length // cfg.block_size
        if done_hi > done_lo:
            tokens = kv.cis(seq, done_lo * cfg.block_size, done_hi * cfg.block_size).float()
            self.store.set_means(done_lo, block_means(tokens, done_hi - done_lo, cfg.block_size))
        first, total = self.num_windows, cfg.num_compressed(new_length)
        if total > first:
            lo = cfg.compress_stride * first
            hi = cfg.compress_stride * (total - 1) + cfg.compress_kernel
            self.store.add_windows(compress_windows(kv.keys(seq, lo, hi).detach().float(), cfg, 0, total - first)
                                   .transpose(0, 1))
            window_cis = compress_windows(kv.cis(seq, lo, hi).detach().float(), cfg, 0, total - first)  # [c, Hkv]
            self.store.raise_pooled(pool_to_blocks(window_cis.transpose(0, 1), num_blocks, cfg, first_window=first))
        self.length = new_length

    def advanced(self, length: int) -> None:
        """The state's store was brought to ``length`` tokens in place by a batched step the host
        does not watch (nosa.state_pool.StatePool.advance): take the sizes that go with it."""
        self.length = length
        self.store.set_sizes(self.cfg.num_compressed(length), self.cfg.num_blocks(length))

    def select(self, q: torch.Tensor, scale: float) -> torch.Tensor:
        """Selection for the query of the last token. q: [Hq, D] -> [Hkv, K]."""
        return decode_select([self], q[None], scale)[0]

    def static_blocks(self, position: int | None = None) -> torch.Tensor:
        """[Hkv, K] the query-independent part of the selection of the token at ``position``
        (default: the last one), known before its query (nosa.select.static_selection)."""
        position = self.length - 1 if position is None else position
        nb = self.cfg.num_blocks(position + 1)
        static = self.static_keys.new_full((self.num_kv_heads, nb, 2), NEG_INF)
        have = min(nb, self.static_keys.shape[1])
        static[:, :have] = self.static_keys[:, :have]
        positions = torch.tensor([position], device=static.device)
        return static_selection(static[None], positions, self.cfg)[0]

    def attend(self, q: torch.Tensor, kv: KVView, scale: float) -> torch.Tensor:
        """Decode attention for the last token: q [Hq, D] -> [Hq, D] over a one-sequence KV view
        (e.g. ``nosa.kv.ContiguousKV(k, v, cis)``)."""
        return decode_attend([self], q[None], kv, scale)[0]

    def prefill(self, q: torch.Tensor, kv: KVView, scale: float, seq: int = 0, row_chunk: int | None = None):
        """Attention of the last n tokens of sequence ``seq`` of the KV view (q [n, Hq, D]), reading
        the context only through the view: (out [n, Hq, D], selection [n, Hkv, K]), equal to
        ``nosa_prefill`` on the whole context row for row.

        The state catches up first (its compressed and static keys then cover the rows), each row is
        selected from them (``select_rows``, nosa_prefill's own loop), and each group of
        ``union_rows`` rows gathers the union of its rows' blocks (``kv.gather_blocks``), never the
        whole context at once: the offloading server's prefill. Groups are one ``attend_pairs``
        plan wide: narrower ones (one row chunk of 64 rows) cut every block's pairs into partial
        tiles and re-read the blocks the rows share once per group (measured: a 16K-token
        offloaded prefill took 2.1x the in-pool one with 64-row groups).
        """
        cfg = self.cfg
        self.append(kv, seq)
        n, length = q.shape[0], self.length
        first, num_blocks = length - n, cfg.num_blocks(length)
        if row_chunk is None:
            row_chunk = default_row_chunk(cfg)
        positions = torch.arange(first, length, device=q.device)
        sel = select_rows(q, self.compressed_keys.transpose(0, 1), self.static_keys[None, :, :num_blocks], length,
                          cfg, scale, row_chunk)
        outs = []
        dense_rows = min(n, max(0, cfg.dense_len - first))
        if dense_rows:  # contexts within dense_len: every block, no eviction weighting
            context = first + dense_rows
            k, v, _ = kv.gather_blocks(seq, torch.arange(cfg.num_blocks(context), device=q.device), cfg.block_size)
            outs.append(dense_attention(q[:dense_rows], k[:context], v[:context], scale))
        start, group = dense_rows, union_rows(cfg, self.num_kv_heads, row_chunk)
        while start < n:
            stop = min(n, chunk_end(first + start, group) - first)
            rows_sel = sel[start:stop]
            union = torch.unique(rows_sel[rows_sel >= 0])  # ascending block ids, every KV head
            k, v, cis = kv.gather_blocks(seq, union, cfg.block_size)
            compact = torch.full((num_blocks,), -1, dtype=torch.long, device=q.device)
            compact[union] = torch.arange(union.numel(), device=q.device)
            sel_c = torch.where(rows_sel >= 0, compact[rows_sel.clamp(min=0)], -1)
            pos = positions[start:stop]
            pos_c = compact[pos // cfg.block_size] * cfg.block_size + pos % cfg.block_size
            outs.append(attend_selected(q[start:stop], k, v, cis, sel_c, pos_c, cfg, scale, row_chunk=row_chunk))
            start = stop
        return torch.cat(outs), sel

    def append_tokens(self, k: torch.Tensor, cis: torch.Tensor) -> None:
        """``append`` for a sequence held as plain tensors: k [L, Hkv, D], cis [L, Hkv] (all tokens)."""
        self.append(ContiguousKV(k, None, cis))


def decode_select(states: Sequence[NosaDecodeState], q: torch.Tensor, scale: float) -> torch.Tensor:
    """Selections for the last token of every sequence; q [R, Hq, D] -> [R, Hkv, K].

    Updates each state's ``selection``, ``entered`` and ``left``."""
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
        entered, left = selection_change(prev, sel[have_prev])
        for j, i in enumerate(have_prev):
            states[i].entered, states[i].left = entered[j], left[j]
    for i, state in enumerate(states):
        state.selection = sel[i]
    return sel


class WantedBlocks(NamedTuple):
    """What each sequence of a decode step reads: blocks [R, Hkv, W] (its selection, or every block
    for a sequence within dense_len; -1 padded), lengths [R] (its tokens) and dense [R] (bool: within
    dense_len, attended with no exp(cis) weighting)."""

    blocks: torch.Tensor
    lengths: torch.Tensor
    dense: torch.Tensor


def decode_blocks(states: Sequence[NosaDecodeState], sel: torch.Tensor) -> WantedBlocks:
    """The blocks to resolve for selections ``sel`` [R, Hkv, K] (``decode_select``) of the states'
    last tokens: sequences above dense_len read only their selected blocks (K * block_size tokens
    per KV head), the others every block, as in ``nosa_prefill``."""
    cfg = states[0].cfg
    lengths = torch.tensor([s.length for s in states], device=sel.device)
    dense = lengths <= cfg.dense_len
    width = cfg.topk_blocks
    if bool(dense.any()):  # dense rows read every block: widen to the longest dense context
        width = max(width, cfg.num_blocks(int(lengths[dense].max())))
    return read_blocks(sel, lengths, cfg, width)


def read_width(cfg: NosaConfig) -> int:
    """Blocks per (sequence, KV head) a decode step reads at most: the budget, or every block of a
    context within dense_len. The static width of ``read_blocks``."""
    return max(cfg.topk_blocks, cfg.num_blocks(cfg.dense_len))


def read_blocks(sel: torch.Tensor, lengths: torch.Tensor, cfg: NosaConfig, width: int) -> WantedBlocks:
    """``decode_blocks`` for tensors: selections sel [R, Hkv, K] of sequences of ``lengths`` [R]
    tokens, ``width`` (>= K, and >= the blocks of any sequence within dense_len) blocks per row.
    No host synchronisation: shapes depend on R and ``width`` only."""
    rows = sel.shape[0]
    dense = lengths <= cfg.dense_len  # [R]
    if width == sel.shape[-1] and cfg.dense_len == 0:
        return WantedBlocks(sel, lengths, dense)
    every = torch.arange(width, device=sel.device).expand(rows, sel.shape[1], width)
    every = torch.where(every < ((lengths - 1) // cfg.block_size + 1)[:, None, None], every, -1)
    padded = torch.nn.functional.pad(sel, (0, width - sel.shape[-1]), value=-1)
    return WantedBlocks(torch.where(dense[:, None, None], every, padded), lengths, dense)


def attend_resolved(q: torch.Tensor, found: DeviceRows, dense: torch.Tensor, block_size: int, scale: float,
                    static: bool = False):
    """Attention of q [R, Hq, D] over the resolved blocks ``found`` (nosa.kv.DeviceRows):
    (out [R, Hq, D], lse [R, Hq] float32). Keys are weighted by exp(cis) except in the ``dense``
    [R] rows; a GPU kernel runs when the blocks come in a form it reads and no row is dense.
    ``static``: no host synchronisation (a captured step): the kernels, which cannot leave out the
    weighting per row, are not used then."""
    from nosa import ops  # optional: import nosa loads no kernel code (nosa.ops imports kernels/)

    if ops.use_kernels(q) and not static and not bool(dense.any()):
        fast = _kernel_attend(q, found, block_size, scale)
        if fast is not None:
            return fast
    cis = found.cis.index_select(0, found.rows.flatten()).view_as(found.rows).float()
    cis = torch.where(dense[:, None, None], 0.0, cis)
    bias = torch.where(found.valid, cis, NEG_INF)  # [R, Hkv, T]
    return attend_gathered(q, found.k, found.v, found.rows, bias, scale)


def decode_attend(
    states: Sequence[NosaDecodeState], q: torch.Tensor, kv: KVView, scale: float, return_lse: bool = False
):
    """Decode attention of a batch: q [R, Hq, D] -> out [R, Hq, D] (and lse [R, Hq] float32 with
    ``return_lse``), the last token of each sequence; ``kv`` a KVView whose sequence i
    is ``states[i]``'s.

    select -> resolve -> attend: one selection for the whole batch (``decode_select``), the blocks
    each sequence reads (``decode_blocks``), ``kv.resolve`` once for the batch, then
    ``attend_resolved``."""
    cfg = states[0].cfg
    rows = q.shape[0]
    if len(states) != rows:
        raise ValueError(f"decode_attend: {len(states)} states for {rows} query rows")
    wanted = decode_blocks(states, decode_select(states, q, scale))
    found = kv.resolve(wanted.blocks, wanted.lengths, cfg.block_size)
    out, lse = attend_resolved(q, found, wanted.dense, cfg.block_size, scale)
    return (out, lse) if return_lse else out


def _kernel_attend(q, found: DeviceRows, block_size: int, scale: float):
    """(out, lse) from the GPU kernel that fits the resolved blocks (nosa.ops picks Triton on CUDA,
    or under NOSA_KERNELS=triton), or None to use the torch path (blocks in no form a kernel
    reads). Not for batches with dense rows, whose attention has no exp(cis) weighting, which the
    kernels always apply."""
    from nosa import ops  # optional: import nosa loads no kernel code (nosa.ops imports kernels/)

    if found.slots is not None:
        return ops.slot_decode(q, *found.items, found.slots, found.fill, scale)
    if found.paged is not None:
        paged = found.paged
        return ops.paged_sparse_decode(q, paged.k_pool, paged.v_pool, paged.cis_pool, paged.token_table.int(),
                                       paged.blocks.int(), paged.lengths.int(), block_size, scale)
    return None


class GrowingStore:
    """The DecodeStore a NosaDecodeState keeps its keys in by default: buffers of its own that grow
    with the context."""

    def __init__(self, num_kv_heads: int, head_dim: int, device):
        self._ck = _Growable((num_kv_heads, 0, head_dim), torch.float32, device)
        self._static = _Growable((num_kv_heads, 0, 2), torch.float32, device, fill=NEG_INF)

    @property
    def num_windows(self) -> int:
        return self._ck.size

    def keys(self) -> torch.Tensor:
        """[Hkv, C, D] the compressed keys."""
        return self._ck.view()

    def static(self) -> torch.Tensor:
        """[Hkv, NB, 2] the static block keys (-inf where not yet known)."""
        return self._static.view()

    def add_windows(self, keys: torch.Tensor) -> None:
        """Append compressed keys [Hkv, c, D]."""
        self._ck.extend(keys)

    def grow_blocks(self, num_blocks: int) -> None:
        """Static keys for ``num_blocks`` blocks, the new ones -inf."""
        self._static.grow_to(num_blocks)

    def set_means(self, first: int, means: torch.Tensor) -> None:
        """Block means [Hkv, n] of blocks ``first .. first + n - 1``."""
        self._static.view()[:, first : first + means.shape[1], 1] = means

    def raise_pooled(self, pooled: torch.Tensor) -> None:
        """Pooled eviction scores [Hkv, NB]: each block keeps the max of its own and this one."""
        static = self._static.view()
        torch.maximum(static[..., 0], pooled, out=pooled)
        static[..., 0] = pooled

    def set_sizes(self, num_windows: int, num_blocks: int) -> None:
        raise ValueError("NosaDecodeState.advanced: only a state in a pool (nosa.state_pool) is updated in place")


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
