"""NOSA attention for token-level queries, the reference implementation (pure PyTorch, autograd).

Layout (one sequence, token-major as in SGLang): q [n, Hq, D]; k, v [L, Hkv, D]; cis [L, Hkv];
the n query rows are the last n tokens of the L-token context (n == L for a plain prefill).
G = Hq // Hkv query heads share one KV head and one selection.

Two paths, one selection (nosa.select):
- ``nosa_prefill`` (here): training and prefill; every row gets its own selection from the blocks
  up to its position (causal inside the current block).
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
# prefill chunks whose rows together select more than UNION_LIMIT * topk_blocks blocks (per KV head)
# attend row by row rather than over the union (measured crossover on CPU, see _attend_selected)
UNION_LIMIT = 2


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

    Rows go in chunks aligned to ``row_chunk`` positions (default: the multiple of block_size
    nearest 64). Within a chunk, the blocks every row selected are attended to once for all rows,
    and each row gathers only its other selected blocks, so the work per row follows the budget,
    not the context.
    """
    n, hq, d = q.shape
    length, hkv, _ = k.shape
    if n > length:
        raise ValueError(f"nosa_prefill: {n} query rows but only {length} key tokens")
    if hq % hkv:
        raise ValueError(f"nosa_prefill: Hq={hq} is not a multiple of Hkv={hkv}")
    if row_chunk is None:
        row_chunk = max(1, round(64 / cfg.block_size)) * cfg.block_size
    first = length - n
    num_blocks = cfg.num_blocks(length)
    dense_rows = min(n, max(0, cfg.dense_len - first))  # rows whose context fits in dense_len
    outs, sels = [], []
    if dense_rows:
        outs.append(dense_attention(q[:dense_rows], k[: first + dense_rows], v[: first + dense_rows], scale))
    with torch.no_grad():
        compressed_k = compress_windows(k.detach(), cfg)  # [C, Hkv, D]
        evict = block_eviction_scores(cis, cfg, num_blocks)[None]  # [1, Hkv, NB, 2]
        # selections of every row (the dense rows' too: callers track churn from them)
        for start in range(0, n, row_chunk):
            positions = torch.arange(first + start, first + min(start + row_chunk, n), device=q.device)
            qs = query_block_scores(q[start : start + row_chunk].detach(), compressed_k, positions,
                                    num_blocks, cfg, scale)
            sels.append(select_blocks(qs, evict, positions, cfg))
    selection = torch.cat(sels)
    start = dense_rows
    from nosa import ops  # CUDA (or NOSA_KERNELS=triton): the Triton block-sparse kernel, fwd + bwd

    if start < n and ops.use_kernels(q, k):
        positions = torch.arange(first + start, length, device=q.device)
        outs.append(ops.sparse_prefill_attention(q[start:], k, v, cis, selection[start:], positions,
                                                 cfg.block_size, scale)[0])
        start = n
    while start < n:  # chunk boundaries at multiples of row_chunk in absolute position
        stop = min(n, (first + start) // row_chunk * row_chunk + row_chunk - first)
        positions = torch.arange(first + start, first + stop, device=q.device)
        outs.append(_attend_selected(q[start:stop], k, v, cis, selection[start:stop], positions, cfg, scale))
        start = stop
    return torch.cat(outs), selection


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
    bounds = cu_seqlens.tolist()
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
) -> torch.Tensor:
    """Each row attends over its own selected blocks, at or before its position, token j weighted by
    exp(cis_j). q [n, Hq, D]; k/v [L, Hkv, D]; cis [L, Hkv]; sel [n, Hkv, K]; positions [n].

    While the rows mostly agree (short contexts, static selections), they share one gather: the
    union of the blocks any row selected (per KV head, [Hkv, U]) is gathered once and each row masks
    out the union's blocks it did not select, two matmuls for the chunk. When the union grows past
    ``UNION_LIMIT`` budgets (long contexts, query-aware picks that differ row to row) each row
    gathers its own K * block_size tokens instead (``_attend_each_row``).
    """
    n, hq, d = q.shape
    hkv, group = k.shape[1], hq // k.shape[1]
    last = int(positions[-1])
    row_blocks = selection_mask(sel, cfg.num_blocks(last + 1))  # [n, Hkv, NB]
    in_union = row_blocks.any(dim=0)  # [Hkv, NB]
    if int(in_union.sum(dim=-1).max()) > UNION_LIMIT * cfg.topk_blocks:
        return _attend_each_row(q, k, v, cis, sel, positions, cfg, scale)
    union, ok = _block_tokens(in_union, cfg.block_size, last)  # [Hkv, U]
    union_blocks = union // cfg.block_size
    mine = row_blocks.gather(-1, union_blocks[None].expand(n, -1, -1))  # [n, Hkv, U]
    mine = mine & ok[None] & (union[None] <= positions[:, None, None])

    dt = compute_dtype(q)
    qg = q.to(dt).reshape(n, hkv, group, d).permute(1, 0, 2, 3).reshape(hkv, n * group, d)
    k_u, v_u, c_u = (gather_heads(x, union).to(dt) for x in (k, v, cis))  # [Hkv, U, D], [Hkv, U]
    bias = torch.where(mine.transpose(0, 1), c_u[:, None, :], NEG_INF)  # [Hkv, n, U]
    bias = bias[:, :, None, :].expand(hkv, n, group, -1).reshape(hkv, n * group, -1)
    logits = torch.baddbmm(bias, qg, k_u.transpose(1, 2), alpha=scale)  # [Hkv, n*G, U]
    out = torch.bmm(torch.softmax(logits, dim=-1), v_u)  # [Hkv, n*G, D]
    return out.view(hkv, n, group, -1).permute(1, 0, 2, 3).reshape(n, hq, -1).to(q.dtype)


def _attend_each_row(q, k, v, cis, sel, positions, cfg: NosaConfig, scale: float) -> torch.Tensor:
    """``_attend_selected`` one row at a time: gather the row's selected tokens, attend. Shapes as there."""
    hkv = k.shape[1]
    tokens, valid = selected_tokens(sel, positions + 1, cfg.block_size)  # [n, Hkv, T]
    rows = tokens * hkv + torch.arange(hkv, device=q.device)[:, None]  # row of (token, head) in [L*Hkv]
    bias = torch.where(valid, cis.reshape(-1).index_select(0, rows.flatten()).view_as(rows), NEG_INF)
    return attend_gathered(q, k.reshape(-1, k.shape[-1]), v.reshape(-1, v.shape[-1]), rows, bias, scale)[0]


def attend_gathered(
    q: torch.Tensor, k_rows: torch.Tensor, v_rows: torch.Tensor, rows: torch.Tensor, bias: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each query row over its own keys, gathered from a pool of (token, KV head) rows.

    q [n, Hq, D]; k_rows, v_rows [N, D] (e.g. a [L, Hkv, D] cache viewed as [L * Hkv, D], or a
    device block cache [S, B, D] viewed as [S * B, D]); rows [n, Hkv, T] long, the pool rows of row
    i's keys for each KV head; bias [n, Hkv, T] added to the logits (cis, -inf for keys to skip).
    Returns (out [n, Hq, Dv] in q's dtype, lse [n, Hq] float32): lse is the natural log of the sum
    of exp(scale * q.k + bias) over the row's keys, so results over disjoint key sets merge exactly
    (``merge_attention``); a row with no key gets out 0 and lse -inf.
    One row at a time, so its gathered K/V stay in cache between gather and matmul: gathering every
    row first measured about 3x slower on CPU. Prefill (``_attend_each_row``) and decode
    (``nosa.decode``) use it.
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
    return torch.stack(outs).to(q.dtype), torch.stack(lses).float()


def merge_attention(outs: list[torch.Tensor], lses: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge attention over disjoint key sets into attention over their union, exactly.

    outs: tensors [..., Dv]; lses: the matching [...] float32 log-sum-exps (-inf for an empty part).
    Returns (out [..., Dv] in the dtype of outs[0], lse [...]): out = sum_p exp(lse_p - lse) out_p.
    """
    lse = torch.logsumexp(torch.stack(lses), dim=0)
    safe = lse.masked_fill(lse == NEG_INF, 0.0)
    out = sum(torch.exp(part - safe)[..., None] * o.float() for o, part in zip(outs, lses))
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


def _block_tokens(mask: torch.Tensor, block_size: int, last: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocks marked in mask [..., NB] -> their tokens [..., W * block_size] (W: the most blocks any
    leading index marks) and whether each is real (a marked block, at or before ``last``)."""
    width = int(mask.sum(dim=-1).max()) if mask.numel() else 0
    blocks = torch.sort(mask.to(torch.int8), dim=-1, descending=True, stable=True).indices[..., :width]
    real = mask.gather(-1, blocks).repeat_interleave(block_size, dim=-1)
    tokens = (blocks[..., None] * block_size + torch.arange(block_size, device=mask.device)).flatten(-2)
    real = real & (tokens <= last)
    return tokens.clamp(max=last), real


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """Softmax in at least fp32 (bf16/fp16 inputs are upcast; fp64 stays fp64 for gradcheck)."""
    return torch.promote_types(x.dtype, torch.float32)
