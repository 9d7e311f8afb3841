"""Selected-block attention computed block by block (``attend_pairs``): the inference path of long
prefills on CPU, whose cost follows the budget, not the context.

A pair is one (query row, KV head, selected block). The pairs are sorted by block and cut into
tiles of TILE pairs of one block: a tile reads its block's keys once and attends them with TILE
rows x G query heads in torch's fused CPU attention (which also returns each row's log-sum-exp),
so the work stays in wide matmuls and no key a row did not select is computed; the partial
results (out, lse) of a (row, KV head) merge exactly. Keys come as block pools
(``nosa.attention.gathered.block_pools``: row h * NB + b holds block b of KV head h).

Layout as in nosa.layout: q [n, Hq, D]; sel [n, Hkv, K] (-1 = none). Inference only (no autograd).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from nosa.layout import NEG_INF

# pairs of one tile (one block): TILE x G query rows per fused attention call. Wider tiles run
# faster (on CPU, fused attention of 128 query rows against a 64-key block measured about 22
# GFLOP/s, 256 rows 28) but waste more on the last, partial tile of each block
TILE = 64
# pairs planned together (sorted by block and tiled): more pairs fill more of each block's tiles
# (measured at 32K tokens: 2^19 pairs about 10% faster than 2^17, no gain beyond); the plan's
# memory is a few index tensors of this length
PLAN_PAIRS = 1 << 19
# tiles attended and merged at once: each slice rescales the running merge of all of its plan's
# rows, so larger slices rescale less often (measured at 32K tokens: 256 tiles about 10% faster
# than 64), at 8 MiB of tile queries and as much output at the released config's G = 4, D = 32
SLICE_TILES = 256


@torch.no_grad()
def attend_pairs(
    q: torch.Tensor,
    pools: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    sel: torch.Tensor,
    positions: torch.Tensor,
    block_size: int,
    scale: float,
    window_blocks: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row over the tokens of its blocks ``sel`` at or before its position, token j's logit
    raised by cis_j.

    q [n, Hq, D]; pools = (k [Hkv * NB, B * D], v [Hkv * NB, B * Dv], cis [Hkv * NB, B]) in the
    softmax dtype, contiguous; sel [n, Hkv, K] block indices (-1 = none; a block after the row's
    position counts as none); positions [n] ascending. Returns (out [n, Hq, Dv], lse [n, Hq]) in
    the pools' dtype; a (row, KV head) with no key gets out 0 and lse -inf.

    ``window_blocks`` (the config's local window, the current block included): rows whose
    selection holds the whole window (every KV head; the forced part of every selection past the
    first blocks) attend to the window's whole blocks through ``attend_windows``, one fused call
    per query block against a view of the pools, instead of as pairs.
    """
    n, hq, _ = q.shape
    hkv, k_sel = sel.shape[1], sel.shape[2]
    dv = pools[1].shape[1] // block_size
    out = pools[0].new_zeros(n, hq, dv)
    lse = pools[0].new_full((n, hq), NEG_INF)
    rows = max(1, PLAN_PAIRS // max(1, hkv * k_sel))
    for start in range(0, n, rows):
        stop = min(n, start + rows)
        out[start:stop], lse[start:stop] = _attend_plan(q[start:stop], pools, sel[start:stop], positions[start:stop],
                                                        block_size, scale, window_blocks - 1)
    return out, lse


def _attend_plan(q, pools, sel, positions, block_size, scale, span):
    """``attend_pairs`` for one plan's rows: the ``span`` whole blocks before the current one where
    every head selected them all, then the pairs of other whole blocks and those of the rows'
    current, partial blocks (masked) in tiles of their own, merged into each (row, KV head) as they
    come."""
    n, hq, d = q.shape
    hkv = sel.shape[1]
    group = hq // hkv
    dt, device = pools[0].dtype, q.device
    nb = pools[2].shape[0] // hkv
    heads = torch.arange(hkv, device=device)[None, :, None]
    rows_pos = positions[:, None, None]
    real = (sel >= 0) & (sel * block_size <= rows_pos)
    partial = real & ((sel + 1) * block_size - 1 > rows_pos)  # blocks with tokens after the row
    row_of = (torch.arange(n, device=device)[:, None, None] * hkv + heads).expand_as(sel)  # (row, head)
    pool_row = sel + heads * nb
    # one zero query row (index n * Hkv, the spare) for the unused places of a block's last tile
    q_ext = torch.cat([q.to(dt).reshape(n * hkv, group, d), q.new_zeros(1, group, d, dtype=dt)])
    # running merge per (row, head) and spare: the largest lse so far, the sum of exp(lse - it) and
    # of exp(lse - it) * out. A finite floor instead of -inf keeps untouched rows free of NaN.
    dv = pools[1].shape[1] // block_size
    merged = _Merge(torch.full((n * hkv + 1, group), torch.finfo(dt).min, dtype=dt, device=device),
                    q.new_zeros(n * hkv + 1, group, dtype=dt), q.new_zeros(n * hkv + 1, group, dv, dtype=dt))
    if span > 0:
        cur = rows_pos // block_size
        in_window = (sel >= cur - span) & (sel < cur)  # [n, Hkv, K]
        whole = ((in_window.sum(dim=-1) == span).all(dim=-1) & (cur[:, 0, 0] >= span)).nonzero()[:, 0]
        if whole.numel():
            attend_windows(q, pools, whole, positions[whole], block_size, span, scale, merged)
            real[whole] &= ~in_window[whole]
    for mask, last_key in ((real & ~partial, None), (partial, (rows_pos - sel * block_size)[partial])):
        if bool(mask.any()):
            _attend_tiles(q_ext, pools, row_of[mask], pool_row[mask], last_key, block_size, scale, merged)
    top, total, acc = (x[:-1] for x in merged)
    out = acc / total.clamp(min=torch.finfo(dt).tiny)[..., None]  # no key: 0 / tiny = 0
    return out.view(n, hq, -1), (top + total.log()).view(n, hq)  # no key: log 0 = -inf


def attend_windows(q, pools, rows, positions, block_size, span, scale, merged) -> None:
    """Rows ``rows`` [m] of q [n, Hq, D] (positions [m] ascending) over the ``span`` whole blocks
    before their current block, merged into ``merged``. Rows of one query block share those keys,
    so each query block is one fused attention call of its B x G query rows per KV head against a
    strided view of the pools (query block c reads pool blocks c - span .. c - 1, overlapping its
    neighbours'): nothing is gathered."""
    k_pool, v_pool, c_pool = pools
    n, hq, d = q.shape
    hkv = (merged.top.shape[0] - 1) // n  # merged holds n * Hkv rows and the spare
    group, bsz, dt = hq // hkv, block_size, k_pool.dtype
    dv = v_pool.shape[1] // bsz
    nb = c_pool.shape[0] // hkv
    cur, offset = positions // bsz, positions % bsz
    first = int(cur[0])
    count = int(cur[-1]) - first + 1  # query blocks, some possibly without a row here
    # queries [query block, KV head, B * G, D]: row at offset o of its block, query head g -> o * G + g
    qw = q.new_zeros(count, hkv, bsz, group, d, dtype=dt)
    qw[cur - first, :, offset] = q[rows].to(dt).view(-1, hkv, group, d)
    base = (first - span) * bsz  # token offset of the first query block's window in a head's pool

    def window(pool, width):  # [query block, KV head, span * B, width] view of a head-major pool
        return pool.as_strided((count, hkv, span * bsz, width), (bsz * width, nb * bsz * width, width, 1),
                               pool.storage_offset() + base * width)

    bias = window(c_pool, 1).transpose(2, 3) if bool(c_pool.any()) else None  # [count, Hkv, 1, span * B]
    out, lse = _fused_attention(qw.view(count, hkv, bsz * group, d), window(k_pool, d), window(v_pool, dv), bias,
                                scale)
    out = out.view(count, hkv, bsz, group, dv)[cur - first, :, offset]  # [m, Hkv, G, Dv]
    lse = lse.view(count, hkv, bsz, group)[cur - first, :, offset]
    heads = torch.arange(hkv, device=q.device)
    merged.add((rows[:, None] * hkv + heads).flatten(), out.reshape(-1, group, dv), lse.reshape(-1, group))


class _Merge(NamedTuple):
    """Partial attention results merged exactly, per (row, head) [R, G]: top (the largest lse so
    far), total (sum of exp(lse - top)) and acc [R, G, Dv] (sum of exp(lse - top) * out)."""

    top: torch.Tensor
    total: torch.Tensor
    acc: torch.Tensor

    def add(self, rows: torch.Tensor, out: torch.Tensor, lse: torch.Tensor) -> None:
        """Merge results out [S, G, Dv], lse [S, G] of rows [S] (a row may repeat). Every row is
        rescaled (by 1 where its top stays): measured faster than finding the rows present."""
        top = self.top.clone().scatter_reduce_(0, rows[:, None].expand_as(lse), lse, reduce="amax")
        shrink = torch.exp(self.top - top)
        self.total.mul_(shrink)
        self.acc.mul_(shrink[..., None])
        self.top.copy_(top)
        weight = torch.exp(lse - top[rows])
        self.total.index_add_(0, rows, weight)
        self.acc.index_add_(0, rows, out.mul_(weight[..., None]))


def _attend_tiles(q_ext, pools, pair_row, pair_block, last_key, block_size, scale, merged: _Merge) -> None:
    """Attention of each pair over its block, in tiles, merged into ``merged``: pair_row [P] (row of
    ``q_ext`` [rows + 1, G, D], whose last row is zero), pair_block [P] (pool row), last_key [P]
    (the last token of the block each pair may see) or None (all of them)."""
    k_pool, v_pool, c_pool = pools
    group, d = q_ext.shape[1], q_ext.shape[2]
    dt, device, bsz = k_pool.dtype, q_ext.device, block_size
    dv = v_pool.shape[1] // bsz
    pair_block, order = pair_block.sort(stable=True)
    pair_row = pair_row[order]
    pairs = pair_block.numel()
    # each block's pairs in runs of TILE; place = tile * TILE + rank in the tile
    counts = torch.bincount(pair_block, minlength=c_pool.shape[0])
    tiles_of = (counts + TILE - 1) // TILE
    first_tile = tiles_of.cumsum(0) - tiles_of
    rank = torch.arange(pairs, device=device) - (counts.cumsum(0) - counts)[pair_block]
    place = (first_tile[pair_block] + rank // TILE) * TILE + rank % TILE
    num_tiles = int(tiles_of.sum())
    tile_block = torch.repeat_interleave(torch.arange(c_pool.shape[0], device=device), tiles_of)  # [tiles]
    slot_row = torch.full((num_tiles * TILE,), q_ext.shape[0] - 1, dtype=torch.long, device=device)
    slot_row[place] = pair_row
    if last_key is not None:
        slot_last = torch.full((num_tiles * TILE,), bsz - 1, dtype=torch.long, device=device)
        slot_last[place] = last_key[order]
    with_cis = bool(c_pool.any())  # all zero for eviction heads with A = 0: no bias to add
    for a in range(0, num_tiles, SLICE_TILES):
        b = min(num_tiles, a + SLICE_TILES)
        blocks, rows = tile_block[a:b], slot_row[a * TILE : b * TILE]
        bias = c_pool.index_select(0, blocks).view(b - a, 1, 1, bsz) if with_cis else None
        if last_key is not None:  # keys after each pair's row: -inf, for each of its G query heads
            late = torch.arange(bsz, device=device) > slot_last[a * TILE : b * TILE, None]  # [places, B]
            mask = torch.zeros(b - a, TILE, 1, bsz, dtype=dt, device=device).masked_fill_(
                late.view(b - a, TILE, 1, bsz), NEG_INF)
            if bias is not None:
                mask += bias
            bias = mask.expand(-1, -1, group, -1).reshape(b - a, 1, TILE * group, bsz)
        out, lse = _fused_attention(q_ext.index_select(0, rows).view(b - a, 1, TILE * group, d),
                                    k_pool.index_select(0, blocks).view(b - a, 1, bsz, d),
                                    v_pool.index_select(0, blocks).view(b - a, 1, bsz, dv), bias, scale)
        merged.add(rows, out.view(-1, group, dv), lse.view(-1, group))


def _fused_attention(q, k, v, bias, scale):
    """softmax(scale * q k^T + bias) v with its log-sum-exp: q [T, H, M, D], k/v [T, H, B, D] (any
    strides but the last), bias broadcastable to [T, H, M, B] or None -> (out [T, H, M, Dv], lse
    [T, H, M]). On CPU torch's
    fused flash kernel, the one SDPA runs, called through its aten op because SDPA does not return
    the lse; elsewhere (a GPU without the Triton kernels) the plain matmuls."""
    if q.device.type == "cpu":
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, False, attn_mask=bias,
                                                                          scale=scale)
    logits = torch.matmul(q, k.transpose(-1, -2)) * scale
    if bias is not None:
        logits = logits + bias
    lse = torch.logsumexp(logits, dim=-1)
    return torch.matmul(torch.exp(logits - lse[..., None]), v), lse
