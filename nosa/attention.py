"""NOSA attention for token-level queries, the reference implementation (pure PyTorch, autograd).

Layout (one sequence, token-major as in SGLang): q [n, Hq, D]; k, v [L, Hkv, D]; cis [L, Hkv];
the n query rows are the last n tokens of the L-token context (n == L for a plain prefill).
G = Hq // Hkv query heads share one KV head and one selection.

Two paths, one selection (nosa.select):
- ``nosa_prefill`` (here): training and prefill; every row gets its own selection from the blocks
  up to its position (causal inside the current block). Its attention (``attend_selected``) runs
  the Triton kernel on CUDA; on CPU masked dense SDPA (nosa.attention_masked) for short contexts,
  else gathers of each row's blocks (``_attend_selected``): the same math, measured crossover.
- ``nosa.decode.NosaDecodeState``: one query per step with incremental state; memory linear in
  the context, nothing of size L x L.
Rows whose context has at most ``dense_len`` tokens attend densely (plain causal softmax, no
eviction weighting), so short prompts behave exactly like the dense model.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from nosa.compress import compress_windows
from nosa.config import NosaConfig
from nosa.eviction import block_eviction_scores
from nosa.select import query_block_scores, select_blocks, selection_mask

NEG_INF = float("-inf")
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
# a training call keeps its groups' probabilities and gathered keys for backward up to this many
# elements (then recomputes the rest from the log-sum-exp): memory for about 1.5x less work
SAVE_ELEMENTS = 1 << 25
# at most this many float32 logits per selection chunk (query-aware scores of a chunk's rows at
# once): small enough that a chunk's logits stay in cache (measured about 25% faster at 1K tokens
# than one chunk for every row) and that later chunks' rows do not score windows they cannot see
SELECT_ELEMENTS = 1 << 18


def nosa_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cis: torch.Tensor,
    cfg: NosaConfig,
    scale: float,
    row_chunk: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse attention for the last n tokens of a context.

    q: [n, Hq, D]; k, v: [L, Hkv, D]; cis: [L, Hkv] (eviction-head scores, differentiable).
    Returns (out [n, Hq, D], selection [n, Hkv, K] long, -1 padded).

    Selection runs for many rows at once (bounded by SELECT_ELEMENTS); attention goes through
    ``_attend_selected`` in groups of rows aligned to ``row_chunk`` positions (default:
    ``default_row_chunk``), so the work per row follows the budget, not the context.
    """
    n, hq, d = q.shape
    length, hkv, _ = k.shape
    if n > length:
        raise ValueError(f"nosa_prefill: {n} query rows but only {length} key tokens")
    if hq % hkv:
        raise ValueError(f"nosa_prefill: Hq={hq} is not a multiple of Hkv={hkv}")
    if cis.shape != (length, hkv):
        raise ValueError(f"nosa_prefill: cis must be [L, Hkv] = [{length}, {hkv}], got {list(cis.shape)}")
    if row_chunk is None:
        row_chunk = default_row_chunk(cfg)
    first = length - n
    num_blocks = cfg.num_blocks(length)
    dense_rows = min(n, max(0, cfg.dense_len - first))  # rows whose context fits in dense_len
    outs, sels = [], []
    if dense_rows:
        outs.append(dense_attention(q[:dense_rows], k[: first + dense_rows], v[: first + dense_rows], scale))
    with torch.no_grad():
        compressed_k = compress_windows(k.detach(), cfg)  # [C, Hkv, D]
        evict = block_eviction_scores(cis, cfg, num_blocks)[None]  # [1, Hkv, NB, 2]
        # selections of every row (the dense rows' too: callers track churn from them), in chunks
        # of rows that each score only the windows their last row can see (the others would be
        # masked to probability 0), so the query-aware scores cost about half of rows x windows
        step = max(row_chunk, SELECT_ELEMENTS // max(1, hq * compressed_k.shape[0]))
        for start in range(0, n, step):
            stop = min(start + step, n)
            positions = torch.arange(first + start, first + stop, device=q.device)
            visible = compressed_k[: cfg.num_compressed(first + stop)]
            qs = query_block_scores(q[start:stop].detach(), visible, positions, num_blocks, cfg, scale)
            sels.append(select_blocks(qs, evict, positions, cfg))
    selection = torch.cat(sels)
    if dense_rows < n:
        positions = torch.arange(first + dense_rows, length, device=q.device)
        outs.append(attend_selected(q[dense_rows:], k, v, cis, selection[dense_rows:], positions, cfg, scale,
                                    row_chunk=row_chunk))
    return torch.cat(outs), selection


def attend_selected(q, k, v, cis, sel, positions, cfg: NosaConfig, scale: float, row_chunk: int | None = None):
    """Selected-block attention of query rows (shapes as in ``_attend_selected``): the Triton
    block-sparse kernel, forward and backward, on CUDA (or NOSA_KERNELS=triton, nosa.ops); on CPU
    masked dense attention (``nosa.attention_masked``) while the rows' contexts are within a few
    budgets (training, short prefills), else the gathered torch reference ``_attend_selected``.
    Both CPU paths compute the same attention and gradients. ``nosa_prefill`` and
    ``NosaDecodeState.prefill`` use it."""
    from nosa import attention_masked, ops

    if ops.use_kernels(q, k):
        return ops.sparse_prefill_attention(q, k, v, cis, sel, positions, cfg.block_size, scale)[0]
    training = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, cis))
    if attention_masked.use_masked(positions, k.shape[1], cfg, training):
        return attention_masked.attend_masked(q, k, v, cis, sel, positions, cfg, scale)
    return _attend_selected(q, k, v, cis, sel, positions, cfg, scale, row_chunk=row_chunk)


def default_row_chunk(cfg: NosaConfig) -> int:
    """Rows per group of ``_attend_selected``: the whole blocks nearest ROW_CHUNK_ROWS rows."""
    return max(1, round(ROW_CHUNK_ROWS / cfg.block_size)) * cfg.block_size


def nosa_prefill_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cis: torch.Tensor,
    cu_seqlens: torch.Tensor,
    cfg: NosaConfig,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``nosa_prefill`` over packed sequences: q [T, Hq, D], k/v [T, Hkv, D], cis [T, Hkv],
    cu_seqlens [B + 1] (offsets of each sequence, as in flash-attn varlen). Sequences never see
    each other. Returns (out [T, Hq, D], selection [T, Hkv, K])."""
    bounds = [int(b) for b in cu_seqlens.tolist()]
    if bounds[0] != 0 or bounds[-1] != q.shape[0] or any(b > a for a, b in zip(bounds[1:], bounds)):
        raise ValueError(f"cu_seqlens must rise from 0 to T={q.shape[0]}, got {bounds}")
    outs, sels = [], []
    for lo, hi in zip(bounds, bounds[1:]):
        if hi == lo:
            continue
        out, sel = nosa_prefill(q[lo:hi], k[lo:hi], v[lo:hi], cis[lo:hi], cfg, scale)
        outs.append(out)
        sels.append(sel)
    return torch.cat(outs), torch.cat(sels)


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal dense attention for the last n tokens (the dense_len path and a test yardstick).
    q [n, Hq, D], k/v [L, Hkv, D] -> [n, Hq, D]."""
    n, length = q.shape[0], k.shape[0]
    dt = compute_dtype(q)
    positions = torch.arange(length - n, length, device=q.device)
    causal = torch.arange(length, device=q.device)[None, :] <= positions[:, None]  # [n, L]
    out = F.scaled_dot_product_attention(
        q.to(dt).transpose(0, 1)[None], k.to(dt).transpose(0, 1)[None], v.to(dt).transpose(0, 1)[None],
        attn_mask=causal, scale=scale, enable_gqa=True,
    )
    return out[0].transpose(0, 1).to(q.dtype)


def gather_heads(x: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """x [L, Hkv, ...] (any strides), tokens [Hkv, T] -> [Hkv, T, ...]: row tokens[h] of head h.
    One index_select per KV head: several times faster on CPU than x[tokens, heads]."""
    return torch.stack([x[:, h].index_select(0, tokens[h]) for h in range(tokens.shape[0])])


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


class _SelectedAttention(torch.autograd.Function):
    """out = softmax(scale * q.k + cis over each row's allowed keys) @ v, group by group; each group
    in two parts with one softmax over both: the shared keys ([Hkv, n * G] query rows against
    [Hkv, S * B] keys) and each row's own ([n * Hkv, G] against [n * Hkv, R * B]).
    Inputs q [n, Hq, D], k/v [L, Hkv, D], cis [L, Hkv], the plan of ``_row_groups``, scale, B,
    and whether a backward will follow (then intermediates are kept, up to SAVE_ELEMENTS)."""

    @staticmethod
    def forward(ctx, q, k, v, cis, groups, scale, block_size, keep):
        n, hq, d = q.shape
        dt = compute_dtype(q)
        pools = _pools(k, v, cis, dt, block_size)
        out = q.new_empty(n, hq, v.shape[-1], dtype=dt)
        # keep each group's probabilities and gathered keys for backward while they are small
        # enough (no recomputation), else only the log-sum-exp to recompute them from
        kept, budget = [], SAVE_ELEMENTS if keep else 0
        for start, stop, shared, rest in groups:
            parts = _group_probs(q[start:stop], pools, shared, rest, scale)
            out[start:stop] = _group_output(parts, stop - start, hq)
            size = sum(t.numel() for t in parts.values() if t is not None)
            if size <= budget:
                budget -= size
                kept.append(parts)
            else:
                kept.append({"lse": parts["lse"]})
        ctx.save_for_backward(q, k, v, cis, out)
        ctx.groups, ctx.kept, ctx.scale, ctx.block_size = groups, kept, scale, block_size
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, cis, out = ctx.saved_tensors
        n, hq, d = q.shape
        length, hkv, _ = k.shape
        dt = out.dtype
        scale = ctx.scale
        pools = _pools(k, v, cis, dt, ctx.block_size)
        dq = torch.empty(n, hq, d, dtype=dt, device=q.device)
        dk, dv, dc = (torch.zeros_like(p) for p in pools)
        grad_out = grad_out.to(dt)
        for (start, stop, shared, rest), p in zip(ctx.groups, ctx.kept):
            rows_n = stop - start
            if "p_s" not in p:
                p = _group_probs(q[start:stop], pools, shared, rest, scale, lse=p["lse"])
            go = grad_out[start:stop]
            delta = (go * out[start:stop]).sum(-1, keepdim=True)  # [n, Hq, 1]
            # shared part, [Hkv, n*G, .] layout
            go_s, delta_s = _group_queries(go, hkv), _group_queries(delta, hkv)
            ds_s = p["p_s"] * (torch.bmm(go_s, p["v_s"].transpose(1, 2)) - delta_s)
            dq_g = _ungroup(torch.bmm(ds_s, p["k_s"]), rows_n, hq)
            _accumulate(dk, dv, dc, shared[0], torch.bmm(ds_s.transpose(1, 2), p["q_s"]),
                        torch.bmm(p["p_s"].transpose(1, 2), go_s), ds_s.sum(dim=1), scale)
            if p["p_r"] is not None:  # each row's own part, [n*Hkv, G, .] layout
                go_r = go.reshape(rows_n * hkv, -1, go.shape[-1])
                ds_r = p["p_r"] * (torch.bmm(go_r, p["v_r"].transpose(1, 2)) - delta.reshape(rows_n * hkv, -1, 1))
                dq_g += torch.bmm(ds_r, p["k_r"]).view(rows_n, hq, d)
                _accumulate(dk, dv, dc, rest[0], torch.bmm(ds_r.transpose(1, 2), p["q_r"]),
                            torch.bmm(p["p_r"].transpose(1, 2), go_r), ds_r.sum(dim=1), scale)
            dq[start:stop] = dq_g * scale

        def unpool(x, like):  # [Hkv * NB, B * D'] -> like's [L, Hkv, D'] layout
            return x.view(hkv, -1, *like.shape[2:])[:, :length].transpose(0, 1).to(like.dtype)

        grads = (dq.to(q.dtype), unpool(dk, k), unpool(dv, v), unpool(dc, cis))
        needed = ctx.needs_input_grad
        return tuple(g if needed[i] else None for i, g in enumerate(grads)) + (None, None, None, None)


def _accumulate(dk, dv, dc, rows, dk_x, dv_x, dc_x, scale):
    """Add one part's gradients (per gathered key: dk_x [b, W * B, D] before ``scale``, dv_x, dc_x
    [b, W * B]) into the block pools' gradients at its blocks ``rows`` [b, W]."""
    flat = rows.flatten()
    dk.index_add_(0, flat, dk_x.reshape(-1, dk.shape[1]), alpha=scale)
    dv.index_add_(0, flat, dv_x.reshape(-1, dv.shape[1]))
    dc.index_add_(0, flat, dc_x.reshape(-1, dc.shape[1]))


def _pools(k, v, cis, dt, block_size):
    """k, v [L, Hkv, D] and cis [L, Hkv] as block pools, head-major, padded to whole blocks:
    [Hkv * NB, B * D] and [Hkv * NB, B]. Row h * NB + b is block b of KV head h, contiguous, so a
    group gathers whole blocks (kilobytes per index) rather than one token's row at a time."""
    length = k.shape[0]
    pad = -length % block_size

    def pool(x):
        x = x.to(dt).transpose(0, 1)  # [Hkv, L, ...]
        if pad:
            x = F.pad(x, (0, 0) * (x.dim() - 2) + (0, pad))
        return x.reshape(x.shape[0] * ((length + pad) // block_size), -1)

    return pool(k), pool(v), pool(cis)


def _group_queries(x, hkv):
    """[n, Hq, D] -> [Hkv, n * G, D]: a KV head's query heads of every row, row-major."""
    n, hq, d = x.shape
    return x.reshape(n, hkv, hq // hkv, d).transpose(0, 1).reshape(hkv, -1, d)


def _ungroup(x, n, hq):
    """[Hkv, n * G, D] -> [n, Hq, D]."""
    hkv = x.shape[0]
    return x.view(hkv, n, hq // hkv, -1).transpose(0, 1).reshape(n, hq, -1)


def _logits(qx, k_x, bias, scale, group):
    """scale * qx @ k_x^T + bias: qx [b, m, D], k_x [b, W, D], bias [b, m / group, W] (one bias
    row for each ``group`` consecutive query rows, the query heads of one KV head)."""
    logits = torch.bmm(qx, k_x.transpose(1, 2))  # no autograd here: in place is safe
    b, m, width = logits.shape
    logits.mul_(scale).view(b, m // group, group, width).add_(bias[:, :, None, :])
    return logits


def _gather(pools, rows, batch):
    """Blocks ``rows`` [batch, W] of the pools -> K, V [batch, W * B, D] and cis [batch, W * B]."""
    flat = rows.flatten()
    return tuple(p.index_select(0, flat).view(batch, -1, *((p.shape[1] // pools[2].shape[1],) if i < 2 else ()))
                 for i, p in enumerate(pools))


def _group_probs(q, pools, shared, rest, scale, lse=None) -> dict:
    """Probabilities of one group's rows q [n, Hq, D] over its shared keys (``p_s`` [Hkv, n*G, S*B])
    and their own (``p_r`` [n*Hkv, G, R*B], None when R = 0), with one softmax over both; the lse
    [n, Hq] (recomputed from when given, in backward) and the gathered q/K/V of both parts."""
    n, hq, d = q.shape
    rows_s, allowed_s = shared
    rows_r, valid_r = rest
    hkv = rows_s.shape[0]
    group = hq // hkv
    dt = pools[0].dtype
    out = {"q_s": _group_queries(q.to(dt), hkv)}
    out["k_s"], out["v_s"], c_s = _gather(pools, rows_s, hkv)
    bias = torch.where(allowed_s.transpose(0, 1), c_s[:, None, :], NEG_INF)  # [Hkv, n, S*B]
    logit_s = _logits(out["q_s"], out["k_s"], bias, scale, group)
    logit_r = None
    if rows_r.shape[1]:
        out["q_r"] = q.to(dt).reshape(n * hkv, group, d)
        out["k_r"], out["v_r"], c_r = _gather(pools, rows_r, n * hkv)
        bias_r = torch.where(valid_r, c_r, NEG_INF)
        logit_r = _logits(out["q_r"], out["k_r"], bias_r[:, None, :], scale, group)
    if lse is None:
        lse = _ungroup(torch.logsumexp(logit_s, dim=-1, keepdim=True), n, hq)[..., 0]  # [n, Hq]
        if logit_r is not None:
            lse = torch.logaddexp(lse, torch.logsumexp(logit_r, dim=-1).view(n, hq))
    safe = lse.masked_fill(lse == NEG_INF, 0.0)  # a row with no key at all: probabilities 0
    out["lse"] = lse
    out["p_s"] = logit_s.sub_(_group_queries(safe[..., None], hkv)).exp_()
    out["p_r"] = None if logit_r is None else logit_r.sub_(safe.view(n * hkv, group, 1)).exp_()
    return out


def _group_output(parts: dict, n: int, hq: int) -> torch.Tensor:
    """[n, Hq, Dv]: probabilities times values of both parts."""
    out = _ungroup(torch.bmm(parts["p_s"], parts["v_s"]), n, hq)
    if parts["p_r"] is not None:
        out += torch.bmm(parts["p_r"], parts["v_r"]).view(n, hq, -1)
    return out


def attend_gathered(
    q: torch.Tensor, k_rows: torch.Tensor, v_rows: torch.Tensor, rows: torch.Tensor, bias: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each query row over its own keys, gathered from a pool of (token, KV head) rows.

    q [n, Hq, D]; k_rows, v_rows [N, D] (e.g. a [L, Hkv, D] cache viewed as [L * Hkv, D], or a
    device block cache [S, B, D] viewed as [S * B, D]); rows [n, Hkv, T] long, the pool rows of row
    i's keys for each KV head; bias [n, Hkv, T] added to the logits (cis, -inf for keys to skip).
    Returns (out [n, Hq, Dv] in q's dtype, lse [n, Hq] in the softmax dtype (float32, float64 for
    float64 inputs)): lse is the natural log of the sum
    of exp(scale * q.k + bias) over the row's keys, so results over disjoint key sets merge exactly
    (``merge_attention``); a row with no key gets out 0 and lse -inf.
    One row at a time, so its gathered K/V stay in cache between gather and matmul: gathering every
    row first measured about 3x slower on CPU. Inference prefill rows with many keys of their own
    (``_attend_rows``) and decode (``nosa.decode``) use it.
    """
    n, hq, d = q.shape
    hkv = rows.shape[1]
    dt = compute_dtype(q)
    outs, lses = [], []
    for i in range(n):
        index = rows[i].flatten()
        k_i = k_rows.index_select(0, index).to(dt).view(hkv, -1, d)
        qg = q[i].to(dt).view(hkv, hq // hkv, d)
        logits = torch.baddbmm(bias[i, :, None, :].to(dt), qg, k_i.transpose(1, 2), alpha=scale)
        lse = torch.logsumexp(logits, dim=-1, keepdim=True)  # [Hkv, G, 1]
        probs = torch.exp(logits - lse.masked_fill(lse == NEG_INF, 0.0))  # no key: all 0, not NaN
        v_i = v_rows.index_select(0, index).to(dt).view(hkv, -1, v_rows.shape[-1])
        outs.append(torch.bmm(probs, v_i).view(hq, -1))
        lses.append(lse.view(hq))
    return torch.stack(outs).to(q.dtype), torch.stack(lses)


def merge_attention(outs: list[torch.Tensor], lses: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge attention over disjoint key sets into attention over their union, exactly.

    outs: tensors [..., Dv]; lses: the matching [...] float32 log-sum-exps (-inf for an empty part).
    Returns (out [..., Dv] in the dtype of outs[0], lse [...]): out = sum_p exp(lse_p - lse) out_p.
    """
    lse = torch.logsumexp(torch.stack(lses), dim=0)
    safe = lse.masked_fill(lse == NEG_INF, 0.0)
    dt = torch.promote_types(compute_dtype(outs[0]), lse.dtype)
    out = sum(torch.exp(part - safe).to(dt)[..., None] * o.to(dt) for o, part in zip(outs, lses))
    return out.to(outs[0].dtype), lse


def selected_tokens(sel: torch.Tensor, lengths: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The tokens of the selected blocks: sel [n, Hkv, K] (-1 = none), lengths [n] (tokens each row
    may see) -> (tokens [n, Hkv, K * block_size], valid [n, Hkv, K * block_size]). Invalid entries
    (missing blocks, tokens at or past the length) are clamped to a real token and must be masked."""
    lengths = lengths[:, None, None]
    blocks = torch.where(sel >= 0, sel, lengths)  # missing blocks land past the end
    tokens = (blocks[..., None] * block_size + torch.arange(block_size, device=sel.device)).flatten(-2)
    valid = tokens < lengths
    return torch.minimum(tokens, lengths - 1), valid


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """Softmax in at least fp32 (bf16/fp16 inputs are upcast; fp64 stays fp64 for gradcheck)."""
    return torch.promote_types(x.dtype, torch.float32)
