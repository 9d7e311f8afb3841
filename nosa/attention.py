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

    One softmax over two key sets: the blocks shared by every row of the chunk (gathered once per
    KV head, [Hkv, Ts]) and each row's remaining blocks (gathered per row, [n, Hkv, Te]).
    """
    n, hq, d = q.shape
    hkv, group = k.shape[1], hq // k.shape[1]
    last = int(positions[-1])
    row_blocks = selection_mask(sel, cfg.num_blocks(last + 1))  # [n, Hkv, NB]
    shared = row_blocks.all(dim=0)  # [Hkv, NB]
    tok_s, ok_s = _block_tokens(shared, cfg.block_size, last)  # [Hkv, Ts]
    tok_e, ok_e = _block_tokens(row_blocks & ~shared, cfg.block_size, last)  # [n, Hkv, Te]
    ok_s = ok_s[:, None, :] & (tok_s[:, None, :] <= positions[None, :, None])  # [Hkv, n, Ts]
    ok_e = ok_e & (tok_e <= positions[:, None, None])  # [n, Hkv, Te]

    dt = compute_dtype(q)
    qg = q.to(dt).reshape(n, hkv, group, d)
    k_s, v_s, c_s = (gather_heads(x, tok_s).to(dt) for x in (k, v, cis))  # [Hkv, Ts, D], [Hkv, Ts]
    logit_s = torch.einsum("nhgd,htd->nhgt", qg, k_s) * scale
    logit_s = logit_s + c_s[None, :, None, :].masked_fill(~ok_s.transpose(0, 1)[:, :, None, :], NEG_INF)
    flat_e = tok_e.transpose(0, 1).reshape(hkv, -1)  # [Hkv, n*Te]
    k_e, v_e, c_e = (gather_heads(x, flat_e).to(dt) for x in (k, v, cis))
    k_e = k_e.view(hkv, n, -1, d).transpose(0, 1)  # [n, Hkv, Te, D]
    v_e = v_e.view(hkv, n, -1, v.shape[-1]).transpose(0, 1)
    c_e = c_e.view(hkv, n, -1).transpose(0, 1)  # [n, Hkv, Te]
    logit_e = torch.einsum("nhgd,nhtd->nhgt", qg, k_e) * scale + c_e.masked_fill(~ok_e, NEG_INF)[:, :, None, :]
    probs = torch.softmax(torch.cat([logit_s, logit_e], dim=-1), dim=-1)
    p_s, p_e = probs.split([logit_s.shape[-1], logit_e.shape[-1]], dim=-1)
    out = torch.einsum("nhgt,htd->nhgd", p_s, v_s) + torch.einsum("nhgt,nhtd->nhgd", p_e, v_e)
    return out.reshape(n, hq, -1).to(q.dtype)


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
