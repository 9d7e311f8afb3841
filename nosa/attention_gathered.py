"""The gathered path of selected-block attention (``_attend_selected``, the CPU reference for long
contexts): its plan of row groups (``_row_groups``), the knobs that size those groups, and the
row-by-row inference path (``_attend_rows``). The autograd Function it runs for training is
nosa.attention_pooled's ``_SelectedAttention``; nosa.attention.attend_selected picks this path.
"""

from __future__ import annotations

import torch

from nosa.attention_math import NEG_INF, attend_gathered, compute_dtype, selected_tokens
from nosa.attention_pooled import _group_output, _group_probs, _pools, _SelectedAttention
from nosa.config import NosaConfig
from nosa.select import selection_mask

# A group of rows gathers at most about this many (row, KV head, key) entries for the keys its rows
# do not share; a group above it is split in halves (down to single rows). Bounds the gathered
# memory of a group (x head_dim), so it stays in cache between gather and matmul.
REST_TOKENS = 1 << 16
# rows per group (rounded to whole blocks): larger groups share fewer blocks, so each row gathers
# more keys of its own; smaller ones pay the per-group overhead more often (measured on CPU)
ROW_CHUNK_ROWS = 64
# (inference) a chunk whose rows together select at most UNION_LIMIT * topk_blocks blocks attends
# over that union, each row masked to its own blocks (short contexts: one matmul beats gathers)
UNION_LIMIT = 2
# (inference) rows with more than this many keys of their own per KV head go one at a time
ROW_REST_TOKENS = 512


def default_row_chunk(cfg: NosaConfig) -> int:
    """Rows per group of ``_attend_selected``: the whole blocks nearest ROW_CHUNK_ROWS rows."""
    return max(1, round(ROW_CHUNK_ROWS / cfg.block_size)) * cfg.block_size


def _attend_selected(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cis: torch.Tensor,
    sel: torch.Tensor,
    positions: torch.Tensor,
    cfg: NosaConfig,
    scale: float,
    row_chunk: int | None = None,
) -> torch.Tensor:
    """Each row attends over its own selected blocks, at or before its position, token j weighted by
    exp(cis_j): the selected-block attention of prefill and training (one call for all sparse rows).

    q [n, Hq, D]; k/v [L, Hkv, D]; cis [L, Hkv]; sel [n, Hkv, K] (-1 = none); positions [n]
    ascending, < L. Returns out [n, Hq, Dv] in q's dtype; differentiable in q, k, v and cis.

    Rows go in groups (``_row_groups``): the rows of one chunk of ``row_chunk`` positions
    (default: ``default_row_chunk``, 64 rows rounded to whole blocks) share their sinks, much of
    their forced window and most of their
    static blocks. The blocks every row of the group selected are gathered once per KV head and
    attended by all rows in one matmul; each row gathers only its other selected blocks (batched
    over the group's rows); one softmax spans both parts. So no key is computed that a row did not
    select, and no row-by-row Python loop runs. (Inference only: a chunk whose rows have many keys
    of their own, long contexts with A = 0, goes row by row through ``attend_gathered``, which
    measured faster there on CPU.) The backward is written out
    (``_SelectedAttention``): it recomputes each group's probabilities from the saved log-sum-exp
    and accumulates dK, dV, dcis with one index_add per group, so autograd holds one node, not a
    graph of per-row gathers whose backward would allocate tensors of size L per group.
    """
    if row_chunk is None:
        row_chunk = default_row_chunk(cfg)
    training = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, cis))
    with torch.no_grad():
        groups = _row_groups(sel, positions, cfg, row_chunk, k.shape[0], split=training)
    if training:  # outside no_grad: the autograd node must be recorded
        return _SelectedAttention.apply(q, k, v, cis, groups, scale, cfg.block_size, True)
    with torch.no_grad():
        # inference: groups whose rows have many keys of their own go row by row (attend_gathered:
        # each row's keys stay in cache between gather and matmul; measured faster on CPU there)
        pools = _pools(k, v, cis, compute_dtype(q), cfg.block_size)
        out = q.new_empty(q.shape[0], q.shape[1], v.shape[-1], dtype=compute_dtype(q))
        for start, stop, shared, rest in groups:
            if shared is None:
                out[start:stop] = _attend_rows(q[start:stop], k, v, cis, sel[start:stop], positions[start:stop],
                                               cfg, scale)
            else:
                out[start:stop] = _group_output(_group_probs(q[start:stop], pools, shared, rest, scale),
                                                stop - start, q.shape[1])
        return out.to(q.dtype)


def _attend_rows(q, k, v, cis, sel, positions, cfg: NosaConfig, scale: float) -> torch.Tensor:
    """``_attend_selected`` one row at a time, without autograd (inference only)."""
    hkv = k.shape[1]
    tokens, valid = selected_tokens(sel, positions + 1, cfg.block_size)  # [n, Hkv, T]
    rows = tokens * hkv + torch.arange(hkv, device=q.device)[:, None]  # row of (token, head) in [L*Hkv]
    bias = torch.where(valid, cis.reshape(-1).index_select(0, rows.flatten()).view_as(rows), NEG_INF)
    return attend_gathered(q, k.reshape(-1, k.shape[-1]), v.reshape(-1, v.shape[-1]), rows, bias, scale)[0]


def _row_groups(sel, positions, cfg: NosaConfig, row_chunk: int, length: int, split: bool = True) -> list:
    """The plan of ``_attend_selected``: a list of (start, stop, shared, rest), one per group of rows.

    Keys are addressed as whole blocks of the block pools of ``_pools`` (pool row h * NB + b holds
    block b of KV head h, NB blocks of the L tokens). ``shared`` = (rows [Hkv, S] long, allowed
    [n, Hkv, S * B] bool): the blocks every row of the group selected, and whether each row may see
    each of their tokens (causality inside the current block; padding entries). ``rest`` = (rows
    [n * Hkv, R] long, valid [n * Hkv, R * B] bool): each row's other selected blocks (R may be 0).
    Groups are chunks of ``row_chunk`` positions, halved while their ``rest`` holds more than
    REST_TOKENS (row, KV head, token) entries. Without ``split`` (inference), a chunk whose union
    of blocks is at most UNION_LIMIT budgets attends over that union (``shared`` = the union, each
    row allowed its own blocks); a chunk above REST_TOKENS instead becomes (start, stop, None,
    None) when its rows average more than ROW_REST_TOKENS own keys (per KV head): rows to attend
    one at a time."""
    hkv, device, bsz = sel.shape[1], sel.device, cfg.block_size
    pool_base = (torch.arange(hkv, device=device) * cfg.num_blocks(length))[:, None]
    offsets = torch.arange(bsz, device=device)
    groups, todo = [], []
    pos = positions.tolist()
    start = 0
    while start < len(pos):  # chunks aligned to multiples of row_chunk in absolute position
        stop = start + min(len(pos) - start, pos[start] // row_chunk * row_chunk + row_chunk - pos[start])
        todo.append((start, stop))
        start = stop
    while todo:
        start, stop = todo.pop(0)
        n, last = stop - start, pos[stop - 1]
        sel_g = sel[start:stop]
        rows_pos = positions[start:stop, None, None]
        row_blocks = selection_mask(sel_g, cfg.num_blocks(last + 1))  # [n, Hkv, NB']
        in_any = row_blocks.any(dim=0)
        if not split and int(in_any.sum(dim=-1).max()) <= UNION_LIMIT * cfg.topk_blocks:
            # inference, rows that mostly agree: the union of their blocks, each row masked to its own
            count = int(in_any.sum(dim=-1).max())
            blocks_u = torch.sort(in_any.to(torch.int8), dim=-1, descending=True, stable=True).indices[..., :count]
            mine = row_blocks.gather(-1, blocks_u[None].expand(n, -1, -1))  # [n, Hkv, U]
            allowed_u = (mine[..., None] & ((blocks_u * bsz)[..., None] + offsets <= rows_pos[..., None])).flatten(-2)
            empty = blocks_u.new_zeros(n * hkv, 0)
            groups.append((start, stop, (blocks_u + pool_base, allowed_u), (empty, empty.bool())))
            continue
        in_all = row_blocks.all(dim=0)  # [Hkv, NB']
        # each row's selected blocks outside the shared set, compacted to the widest row
        shared_flag = in_all[None].expand(n, -1, -1).gather(-1, sel_g.clamp(min=0))
        rest_sel = torch.where((sel_g >= 0) & ~shared_flag, sel_g, -1)
        width = int((rest_sel >= 0).sum(dim=-1).max())
        if not split and n * hkv * width * bsz > REST_TOKENS:
            if int((rest_sel >= 0).sum()) * bsz > n * hkv * ROW_REST_TOKENS:
                groups.append((start, stop, None, None))
                continue
        if n > 1 and n * hkv * width * bsz > REST_TOKENS:
            mid = (start + stop) // 2
            todo[:0] = [(start, mid), (mid, stop)]
            continue
        rest_sel = rest_sel.sort(dim=-1, descending=True).values[..., :width]  # [n, Hkv, R]
        count = int(in_all.sum(dim=-1).max())
        blocks_s = torch.sort(in_all.to(torch.int8), dim=-1, descending=True, stable=True).indices[..., :count]
        real_s = in_all.gather(-1, blocks_s)  # [Hkv, S]
        allowed_s = (real_s[..., None] & ((blocks_s * bsz)[..., None] + offsets <= rows_pos[..., None])).flatten(-2)
        blocks_r = rest_sel.clamp(min=0)
        valid_r = ((rest_sel >= 0)[..., None] & ((blocks_r * bsz)[..., None] + offsets <= rows_pos[..., None]))
        shared = (blocks_s + pool_base, allowed_s)
        rest = ((blocks_r + pool_base).flatten(0, 1), valid_r.flatten(-2).flatten(0, 1))
        groups.append((start, stop, shared, rest))
    return groups
