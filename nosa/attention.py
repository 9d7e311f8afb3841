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

This module holds the prefill entry points; the gathered path lives in nosa.attention_gathered
(its autograd Function in nosa.attention_pooled) and the shared math (dense_attention,
attend_gathered, merge_attention, selected_tokens, compute_dtype) in nosa.attention_math.
"""

from __future__ import annotations

import torch

# the gathered path and the shared math live in their own modules (one noun each); their names
# that other modules, scripts and tests import from here are re-exported
from nosa.attention_gathered import _attend_selected, default_row_chunk
from nosa.attention_math import (
    NEG_INF,
    attend_gathered,
    compute_dtype,
    dense_attention,
    gather_heads,
    merge_attention,
    selected_tokens,
)
from nosa.compress import compress_windows
from nosa.config import NosaConfig
from nosa.eviction import block_eviction_scores
from nosa.select import query_block_scores, select_blocks

__all__ = [
    "NEG_INF", "attend_gathered", "attend_selected", "compute_dtype", "default_row_chunk", "dense_attention",
    "gather_heads", "merge_attention", "nosa_prefill", "nosa_prefill_varlen", "selected_tokens",
]

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
