"""StatePool: the decode selection state of every running sequence, in buffers allocated once, so
that a decode step of the whole batch runs on fixed shapes (a captured CUDA graph, or SGLang's CPU
graph runner under torch.compile) with no host synchronisation.

Per layer (lists of L per-layer tensors: a compiled step writes ``buffer[layer]`` in place): ck
[Hkv, P, B/s, D] and static [P, Hkv, 2] float32 in pages, one per block of a context (``table``
[N, NB + 1] long: block -> page; page 0 is the spare that no sequence owns); the last selection
[N, Hkv, K]; the rings tail_k [N, c, Hkv, D] and tail_cis [N, T, Hkv] (T = max(c, B)), so a step
never reads the KV pool. Shapes: L layers, N sequence slots (row 0 is padding), s compress stride,
c compress kernel, others as nosa.layout. Per step: ``advance``, ``select`` (batched,
shape-static); host side: ``open`` (a NosaDecodeState over a row: ``PoolRow``), ``reserve``,
``release``, ``refill_tails``.
"""

from __future__ import annotations

import logging
import threading

import torch

from nosa import env
from nosa.compress import compress_windows
from nosa.config import NosaConfig
from nosa.decode import NosaDecodeState
from nosa.kv import KVView
from nosa.layout import NEG_INF
from nosa.select import block_scores_from_logits

logger = logging.getLogger(__name__)

SPARE_PAGE = 0


class StatePool:
    def __init__(self, cfg: NosaConfig, num_layers: int, num_rows: int, num_kv_heads: int, head_dim: int,
                 max_context: int, num_pages: int, key_dtype: torch.dtype = torch.float32, device=None,
                 key_tails: bool = True):
        if cfg.block_size % cfg.compress_stride:
            raise ValueError("StatePool: block_size must be a multiple of compress_stride (NosaConfig checks it)")
        self.cfg, self.num_layers, self.num_rows, self.hkv = cfg, num_layers, num_rows, num_kv_heads
        self.head_dim, self.device = head_dim, device
        self.per_page = cfg.block_size // cfg.compress_stride  # windows starting in one block
        self.max_context = max_context
        self.max_blocks = cfg.num_blocks(max_context)
        self.max_windows = cfg.num_compressed(max_context)
        self._span_limits = self._buckets()
        self.tail_len = max(cfg.compress_kernel, cfg.block_size)
        # block -> page; column max_blocks is the spare column of writes that complete nothing
        self.table = torch.zeros(num_rows, self.max_blocks + 1, dtype=torch.long, device=device)
        layers = range(num_layers)
        self.selection = [torch.full((num_rows, num_kv_heads, cfg.topk_blocks), -1, dtype=torch.long, device=device)
                          for _ in layers]
        # without key tails the caller passes each step's window keys (read from a KV pool on the device)
        self.tail_k = [torch.zeros(num_rows if key_tails else 1, cfg.compress_kernel, num_kv_heads, head_dim,
                                   dtype=key_dtype, device=device) for _ in layers]
        self.key_tails = key_tails
        self.tail_cis = [torch.zeros(num_rows, self.tail_len, num_kv_heads, device=device) for _ in layers]
        # index tensors of the writes in ``advance`` (all-tensor indices: a Python int or a slice in an
        # index would make the write go through a view, which a compiled step would copy whole)
        self._heads = torch.arange(num_kv_heads, device=device)
        self._pooled, self._mean = (torch.tensor([i], device=device) for i in (0, 1))
        self._alloc_pages(num_pages)
        self._pages: dict[int, list[int]] = {}  # row -> its pages, in block order
        self._released: list[int] = []  # pages of rows that left, free at the next ``recycle``
        self._lock = threading.Lock()  # ``release`` may come from another thread than the forward
        self.frozen = False  # CUDA graphs captured over the buffers: they must not move

    def _alloc_pages(self, num_pages: int) -> None:
        layers = range(self.num_layers)
        self.ck = [torch.zeros(self.hkv, num_pages, self.per_page, self.head_dim, device=self.device) for _ in layers]
        self.static = [torch.full((num_pages, self.hkv, 2), NEG_INF, device=self.device) for _ in layers]
        self._free = list(range(num_pages - 1, SPARE_PAGE, -1))  # popped from the end: low pages first

    @property
    def num_pages(self) -> int:
        return self.static[0].shape[0]

    @property
    def nbytes(self) -> int:
        tensors = [self.table, *self.selection, *self.tail_k, *self.tail_cis, *self.ck, *self.static]
        return sum(t.numel() * t.element_size() for t in tensors)

    # ---- host side (outside a captured step) ---------------------------------------------------
    def open(self, row: int, layer: int) -> NosaDecodeState:
        """A fresh NosaDecodeState of ``layer`` over row ``row`` (its pages reset to no key)."""
        if not 0 < row < self.num_rows:
            raise ValueError(f"StatePool.open: row {row} outside 1..{self.num_rows - 1}")
        pages = self._pages.get(row)
        if pages:
            self.static[layer][torch.tensor(pages, device=self.device)] = NEG_INF
        self.selection[layer][row] = -1
        return NosaDecodeState(self.cfg, self.hkv, self.head_dim, self.device, store=PoolRow(self, layer, row))

    def reserve(self, row: int, length: int) -> None:
        """Pages for every block of a ``length``-token context of ``row`` (new pages hold no key)."""
        need = self.cfg.num_blocks(length)
        if need > self.max_blocks:
            raise ValueError(f"StatePool: a context of {length} tokens is longer than the pool's "
                             f"{self.max_context}")
        with self._lock:
            pages = self._pages.setdefault(row, [])
            if need <= len(pages):
                return
            if need - len(pages) > len(self._free):
                self._grow(need - len(pages))
            new = [self._free.pop() for _ in range(need - len(pages))]
            index = torch.tensor(new, device=self.device)
            for static in self.static:
                static[index] = NEG_INF
            self.table[row, len(pages) : need] = index
            pages.extend(new)

    def release(self, row: int) -> None:
        """The sequence of ``row`` left: its pages are free from the next ``recycle`` (a forward in
        flight may still write them)."""
        with self._lock:
            pages = self._pages.pop(row, None)
            if pages:
                self._released.extend(pages)
                self.table[row, : len(pages)] = SPARE_PAGE

    def recycle(self) -> None:
        """Released pages become free (call between forward passes)."""
        with self._lock:
            self._free.extend(reversed(self._released))
            self._released.clear()

    def _grow(self, more: int) -> None:
        """More pages (sequences sharing a prefix hold their own pages for it, so the pages can
        outnumber the tokens of the KV pool). The buffers move: a graph captured over the old ones
        is stale: a pool under CUDA graphs is ``frozen`` and raises instead."""
        old_ck, old_static = self.ck, self.static
        size = self.num_pages
        if self.frozen:
            raise RuntimeError(f"nosa decode state pool: its {size} pages are in use and CUDA graphs were captured "
                               "over them (growing would move them); run with --disable-cuda-graph, or with fewer "
                               "requests sharing long prefixes at once")
        new_size = max(2 * size, size + more)
        logger.warning("nosa decode state pool: %d pages are not enough, growing to %d (%.1f MiB)", size, new_size,
                       self.nbytes * (new_size / size) / 2**20)
        free = self._free
        self._alloc_pages(new_size)
        for layer in range(self.num_layers):
            self.ck[layer][:, :size] = old_ck[layer]
            self.static[layer][:size] = old_static[layer]
        self._free = list(range(new_size - 1, size - 1, -1)) + free

    def refill_tails(self, layer: int, row: int, kv: KVView, seq: int, length: int) -> None:
        """The rings of ``row`` from tokens ``[length - T, length)`` of sequence ``seq`` of the KV
        view ``kv`` (after a prefill or a catch-up, before the row's next step)."""
        c, t = self.cfg.compress_kernel, self.tail_len
        lo = max(0, length - t)
        if length <= lo:
            return
        pos = torch.arange(lo, length, device=self.device)
        self.tail_cis[layer][row, pos % t] = kv.cis(seq, lo, length).float()
        if self.key_tails:
            lo_k = max(0, length - c)
            tail_k = self.tail_k[layer]
            tail_k[row, pos[lo_k - lo :] % c] = kv.keys(seq, lo_k, length).to(tail_k.dtype)

    # ---- one decode step, batched and shape-static -------------------------------------------
    def advance(self, layer: int, rows: torch.Tensor, lengths: torch.Tensor, k_new: torch.Tensor,
                cis_new: torch.Tensor, window_keys: torch.Tensor | None = None) -> None:
        """Account for each sequence's newest token, at position lengths - 1: rows [R] (sequence
        slots; 0 for padding), lengths [R], its key k_new [R, Hkv, D] and eviction score cis_new
        [R, Hkv] as the KV pool stores them. The rows must hold ``length - 1`` tokens and pages for
        ``length`` (``reserve``). Writes the rings, the compressed key of the window the token
        completes and the pooled score of the blocks it overlaps, and the mean of the block it
        completes; a row that completes none writes the spare column / page. ``window_keys``
        [R, c, Hkv, D]: the keys of tokens [length - c, length) (any values where length < c),
        needed when the pool keeps no key tails."""
        cfg, c, s, b, t = self.cfg, self.cfg.compress_kernel, self.cfg.compress_stride, self.cfg.block_size, \
            self.tail_len
        tail_cis, table = self.tail_cis[layer], self.table
        ck, static = self.ck[layer], self.static[layer]
        last = lengths - 1
        ring = lengths[:, None] - c + torch.arange(c, device=rows.device)
        if window_keys is None:
            tail_k = self.tail_k[layer]
            tail_k[rows, last % c] = k_new.to(tail_k.dtype)
            window_keys = tail_k[rows[:, None], ring % c]
        tail_cis[rows, last % t] = cis_new.float()
        # the window [length - c, length), as nosa.compress.compress_windows computes one window
        completes = (lengths >= c) & ((lengths - c) % s == 0)
        j = torch.where(completes, (lengths - c) // s, 0)
        keys = compress_windows(window_keys.float().transpose(0, 1), cfg, 0, 1)[0]  # [R, Hkv, D]
        window_cis = compress_windows(tail_cis[rows[:, None], ring % t].transpose(0, 1), cfg, 0, 1)[0]  # [R, Hkv]
        spare = self.max_blocks
        page = table[rows, torch.where(completes, j // self.per_page, spare)]
        heads = self._heads
        ck[heads, page[:, None], (j % self.per_page)[:, None]] = keys
        # its pooled score onto the blocks it overlaps (max with what they had)
        span = (c - 1) // b + 2
        cols = (s * j // b)[:, None] + torch.arange(span, device=rows.device)
        cols = torch.where(completes[:, None] & (cols <= ((s * j + c - 1) // b)[:, None]), cols, spare)
        pages = table[rows[:, None], cols][..., None]  # [R, span, 1]
        pooled = (pages, heads, self._pooled)
        static[pooled] = torch.maximum(static[pooled], window_cis[:, None, :])
        # the block [length - B, length), as nosa.eviction.block_means computes it
        closes = lengths % b == 0
        tokens = tail_cis[rows[:, None], (lengths[:, None] - b + torch.arange(b, device=rows.device)) % t]
        page = table[rows, torch.where(closes, lengths // b - 1, spare)]
        static[page[:, None], heads, self._mean] = tokens.sum(dim=1) / torch.full((), float(b), device=rows.device)

    def record(self, layer: int, rows: torch.Tensor, lengths: torch.Tensor, k_new: torch.Tensor,
               cis_new: torch.Tensor) -> None:
        """``advance`` for a step whose new tokens complete no window and no block (the caller
        knows it on the host): only the rings take them."""
        last = lengths - 1
        if self.key_tails:
            tail_k = self.tail_k[layer]
            tail_k[rows, last % self.cfg.compress_kernel] = k_new.to(tail_k.dtype)
        self.tail_cis[layer][rows, last % self.tail_len] = cis_new.float()

    def select(self, layer: int, rows: torch.Tensor, lengths: torch.Tensor, q: torch.Tensor, scale: float,
               windows: int | None, blocks: int | None) -> torch.Tensor:
        """Selections [R, Hkv, K] of the newest tokens (after ``advance``) for queries q [R, Hq, D],
        recorded as the rows' last selection. ``windows`` / ``blocks``: how many compressed keys and
        blocks to read per row (at least the longest context's of the batch; the pool's maxima for
        a captured CUDA graph). None: the spans of the batch's context bucket (``span_limits``),
        chosen by ``torch.cond`` on the longest length, so that a step torch.compile captured for
        SGLang's CPU graph runner reads about as far as its requests reach, not as far as the
        server's longest context (the predicate is read on the host: never inside a CUDA graph).
        The same as nosa.decode.decode_select on the same states."""
        if windows is None or blocks is None:
            sel = self._select_bucketed(layer, rows, lengths, q, scale)
        else:
            sel = _select_pages(self.cfg, self.table, self.ck[layer], self.static[layer], rows, lengths, q, scale,
                                windows, blocks)
        self.selection[layer][rows] = sel
        return sel

    def span_limits(self) -> list[int]:
        """The context buckets of ``select`` without spans, shortest first (read once, when the
        pool is made): the server's longest context, halved while a half still holds the budget
        (``topk_blocks`` blocks), at most $NOSA_GRAPH_SPAN_BUCKETS of them. A bucket reads at most
        twice what its longest request needs (but the shortest); each is one more copy of the
        selection for torch.compile to compile."""
        return self._span_limits

    def _buckets(self) -> list[int]:
        cfg, most = self.cfg, env.integer("NOSA_GRAPH_SPAN_BUCKETS", minimum=1)
        limits = [self.max_context]
        while len(limits) < most and limits[-1] // 2 >= cfg.topk_blocks * cfg.block_size:
            limits.append(limits[-1] // 2)
        return limits[::-1]

    def _select_bucketed(self, layer: int, rows: torch.Tensor, lengths: torch.Tensor, q: torch.Tensor,
                         scale: float) -> torch.Tensor:
        cfg, table, ck, static = self.cfg, self.table, self.ck[layer], self.static[layer]
        limits = self.span_limits()

        def within(limit: int):  # a branch of torch.cond: the tensors it reads come as its operands
            return lambda q, rows, lengths, table, ck, static: _select_pages(
                cfg, table, ck, static, rows, lengths, q, scale, cfg.num_compressed(limit), cfg.num_blocks(limit))

        operands = (q, rows, lengths, table, ck, static)
        if not torch.compiler.is_compiling():  # run eagerly (a batch size no graph was captured for)
            longest = int(lengths.max())
            return within(next((n for n in limits if n >= longest), limits[-1]))(*operands)
        longest = lengths.max()

        def bucket(i: int):  # limits[i] and longer
            if i == len(limits) - 1:
                return within(limits[i])
            return lambda *ops: torch.cond(longest <= limits[i], within(limits[i]), bucket(i + 1), ops)

        return bucket(0)(*operands)


def _select_pages(cfg: NosaConfig, table: torch.Tensor, ck: torch.Tensor, static: torch.Tensor, rows: torch.Tensor,
                  lengths: torch.Tensor, q: torch.Tensor, scale: float, windows: int, blocks: int) -> torch.Tensor:
    """StatePool.select of one layer's pages (ck [Hkv, P, B/s, D], static [P, Hkv, 2]) over
    ``windows`` compressed keys and ``blocks`` blocks per row -> [R, Hkv, K]."""
    r, hq, d = q.shape
    hkv, per = ck.shape[0], ck.shape[2]
    qg = q.detach().float().reshape(r, hkv, hq // hkv, d)
    window_blocks = -(-windows // per)
    pages = table[rows[:, None], torch.arange(max(blocks, window_blocks), device=rows.device)]  # [R, nb]
    # the rows' pages in one index_select of contiguous page rows (an advanced index of the 4-d
    # buffer, and the permute it needed, cost about 15x more at 64K), already head-major
    heads = torch.arange(hkv, device=rows.device)
    items = (heads[:, None] * ck.shape[1] + pages[:, :window_blocks].flatten()).flatten()  # head-major
    ck = ck.view(-1, per * d).index_select(0, items).view(hkv, r, window_blocks * per, d)[:, :, :windows]
    logits = torch.matmul(qg.transpose(0, 1), ck.transpose(-1, -2)).transpose(0, 1) * scale  # [R, Hkv, G, W]
    num_windows = torch.where(lengths >= cfg.compress_kernel,
                              (lengths - cfg.compress_kernel) // cfg.compress_stride + 1, 0)
    visible = torch.arange(windows, device=rows.device)[None, :] < num_windows[:, None]
    query = block_scores_from_logits(logits, visible, blocks, cfg)  # [R, Hkv, NB]
    exists = torch.arange(blocks, device=rows.device)[None, :] < (lengths[:, None] - 1) // cfg.block_size + 1
    static = static.view(-1, hkv * 2).index_select(0, pages[:, :blocks].flatten())
    static = static.view(r, blocks, hkv, 2).transpose(1, 2)  # [R, Hkv, NB, 2]
    static = torch.where(exists[:, None, :, None], static, NEG_INF)
    from nosa import ops  # optional: import nosa loads no kernel code (nosa.ops imports kernels/)

    return ops.select_blocks(query, static, lengths - 1, cfg, branch_free=True)  # C++ on a CPU's eager step


def pages_for(cfg: NosaConfig, token_capacity: int, num_rows: int) -> int:
    """Pages for sequences holding ``token_capacity`` tokens in all (a KV pool's size) in up to
    ``num_rows`` - 1 sequences: one per block plus each sequence's partial block, plus the spare."""
    return token_capacity // cfg.block_size + num_rows + 1


class PoolRow:
    """The DecodeStore (nosa.decode) of a NosaDecodeState over one row and layer of a StatePool:
    its keys live in the row's pages. Beyond the protocol, ``tails_at``: the context length the
    row's rings were last brought to (``refill_tails``), read and written by the serving runner on
    the host (-1: never)."""

    def __init__(self, pool: StatePool, layer: int, row: int):
        self.pool, self.layer, self.row = pool, layer, row
        self.num_windows = 0
        self.num_blocks = 0
        self.tails_at = -1  # the context length the row's rings were last brought to (host side)

    def _pages(self, count: int) -> torch.Tensor:
        return self.pool.table[self.row, :count]

    def keys(self) -> torch.Tensor:
        per = self.pool.per_page
        pages = self._pages(-(-self.num_windows // per))
        ck = self.pool.ck[self.layer][:, pages]  # [Hkv, nb, per, D]
        return ck.reshape(self.pool.hkv, -1, self.pool.head_dim)[:, : self.num_windows]

    def static(self) -> torch.Tensor:
        return self.pool.static[self.layer][self._pages(self.num_blocks)].transpose(0, 1)

    def add_windows(self, keys: torch.Tensor) -> None:
        per = self.pool.per_page
        j = torch.arange(self.num_windows, self.num_windows + keys.shape[1], device=keys.device)
        self.pool.ck[self.layer][:, self.pool.table[self.row, j // per], j % per] = keys
        self.num_windows += keys.shape[1]

    def grow_blocks(self, num_blocks: int) -> None:
        self.pool.reserve(self.row, num_blocks * self.pool.cfg.block_size)
        self.num_blocks = max(self.num_blocks, num_blocks)

    def set_means(self, first: int, means: torch.Tensor) -> None:
        pages = self._pages(first + means.shape[1])[first:]
        self.pool.static[self.layer][pages, :, 1] = means.transpose(0, 1)

    def raise_pooled(self, pooled: torch.Tensor) -> None:
        static = self.pool.static[self.layer]
        pages = self._pages(pooled.shape[1])
        static[pages, :, 0] = torch.maximum(static[pages, :, 0], pooled.transpose(0, 1))

    def set_sizes(self, num_windows: int, num_blocks: int) -> None:
        self.num_windows, self.num_blocks = num_windows, num_blocks
