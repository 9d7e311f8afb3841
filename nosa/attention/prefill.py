"""NOSA prefill and training attention: token-level queries, the reference implementation (pure
PyTorch, autograd). Layout as in nosa.layout: q [n, Hq, D]; k, v [L, Hkv, D]; cis [L, Hkv];
the n query rows are the last n tokens of the L-token context (n == L for a plain prefill).

Every row gets its own selection (``prefill_selection``, nosa.select) from the blocks up to its
position (causal inside the current block), then attends over its selected blocks
(``attend_selected``): the Triton kernel on CUDA (nosa.ops, imported only on that branch); on CPU
masked dense SDPA (nosa.attention.masked) for short contexts, else the gathered path
(nosa.attention.gathered; without gradients block by block, nosa.attention.paired): the same
math, measured crossover. Rows whose context has at most ``dense_len`` tokens attend densely
(causal SDPA, no eviction weighting), so short prompts behave exactly like the dense model;
``prefill_attention`` (serving) does not select them. Decode (one query per step, incremental
state) is nosa.decode.NosaDecodeState.
"""

from __future__ import annotations

import torch

from nosa.attention import gathered, masked
from nosa.attention.math import dense_attention
from nosa.compress import compress_windows
from nosa.config import NosaConfig
from nosa.eviction import block_eviction_scores
from nosa.select import query_block_scores, select_blocks

# at most this many float32 logits per selection chunk (query-aware scores of a chunk's rows at
# once): small enough that a chunk's logits stay in cache (measured about 25% faster at 1K tokens
# than one chunk for every row) and that later chunks' rows do not score windows they cannot see
SELECT_ELEMENTS = 1 << 18
# on a GPU a chunk is a sequence of small launches and one host sync (the windows every row sees): few
# large chunks. The H200's SmolLM2-shaped training step at 8K tokens spent 6 s of host time in 146
# chunks per layer with the CPU's size; with this one a layer is one chunk up to 8K tokens (Hq 9).
SELECT_ELEMENTS_CUDA = 1 << 26


def nosa_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cis: torch.Tensor,
    cfg: NosaConfig,
    scale: float,
    row_chunk: int | None = None,
    attend_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse attention for the last n tokens of a context.

    q: [n, Hq, D]; k, v: [L, Hkv, D]; cis: [L, Hkv] (eviction-head scores, differentiable).
    Returns (out [n, Hq, D], selection [n, Hkv, K] long, -1 padded). ``attend_kv``: other (k, v)
    for the attention itself, the selection still reading ``k`` (a quantized host pool: attention
    sees K and V as the pool gives them back, nosa.kvquant, the selection the exact keys).

    Every row is selected (``prefill_selection``; the rows within dense_len too, whose selections
    callers track churn from); attention goes through ``attend_selected``, whose gathered path works
    in groups of rows aligned to ``row_chunk`` positions (default:
    nosa.attention.gathered.default_row_chunk), so the work per row follows the budget, not the
    context.
    """
    dense_rows = _dense_rows(q, k, cis, cfg)
    selection = prefill_selection(q, k, cis, cfg, scale, row_chunk)
    k_att, v_att = attend_kv if attend_kv is not None else (k, v)
    return _attend(q, k_att, v_att, cis, selection[dense_rows:], dense_rows, cfg, scale, row_chunk), selection


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cis: torch.Tensor, cfg: NosaConfig,
                      scale: float) -> torch.Tensor:
    """``nosa_prefill``'s output alone, for callers that drop the selection (the serving extend):
    the rows within dense_len attend densely without being selected, so a prompt within dense_len
    costs what dense causal attention costs. q [n, Hq, D]; k, v [L, Hkv, D]; cis [L, Hkv] ->
    out [n, Hq, D], equal to ``nosa_prefill(...)[0]``."""
    dense_rows = _dense_rows(q, k, cis, cfg)
    selection = prefill_selection(q[dense_rows:], k, cis, cfg, scale) if dense_rows < q.shape[0] else None
    return _attend(q, k, v, cis, selection, dense_rows, cfg, scale, None)


def prefill_selection(q: torch.Tensor, k: torch.Tensor, cis: torch.Tensor, cfg: NosaConfig, scale: float,
                      row_chunk: int | None = None) -> torch.Tensor:
    """The selection (nosa.select) of each of the last n tokens of a context: q [n, Hq, D], k [L, Hkv,
    D], cis [L, Hkv] -> [n, Hkv, K] long, -1 padded. No gradient. ``select_rows`` on the context's
    compressed keys and static eviction keys."""
    with torch.no_grad():
        compressed_k = compress_windows(k.detach(), cfg)  # [C, Hkv, D]
        evict = block_eviction_scores(cis, cfg, cfg.num_blocks(k.shape[0]))[None]  # [1, Hkv, NB, 2]
    return select_rows(q, compressed_k, evict, k.shape[0], cfg, scale, row_chunk)


@torch.no_grad()
def select_rows(q: torch.Tensor, compressed_k: torch.Tensor, evict: torch.Tensor, length: int, cfg: NosaConfig,
                scale: float, row_chunk: int | None = None) -> torch.Tensor:
    """The selection of each of the last n tokens of a ``length``-token context from its keys as a
    selection state holds them: q [n, Hq, D]; compressed_k [C, Hkv, D] (at least the windows the
    last row sees); evict [1, Hkv, NB, 2] the static keys of the context's NB blocks -> [n, Hkv, K].
    The one row loop of ``nosa_prefill`` and ``NosaDecodeState.prefill`` (an offloading server).

    Rows go in chunks that each score only the windows their last row can see (the others would be
    masked to probability 0), so the query-aware scores cost about half of rows x windows; a chunk
    holds about SELECT_ELEMENTS logits (SELECT_ELEMENTS_CUDA on a GPU) and at least ``row_chunk`` rows."""
    n, hq, _ = q.shape
    first, num_blocks = length - n, cfg.num_blocks(length)
    if row_chunk is None:
        row_chunk = gathered.default_row_chunk(cfg)
    sels = [torch.empty(0, compressed_k.shape[1], cfg.topk_blocks, dtype=torch.long, device=q.device)]
    elements = SELECT_ELEMENTS_CUDA if q.is_cuda else SELECT_ELEMENTS
    step = max(row_chunk, elements // max(1, hq * compressed_k.shape[0]))
    for start in range(0, n, step):
        stop = min(start + step, n)
        positions = torch.arange(first + start, first + stop, device=q.device)
        visible = compressed_k[: cfg.num_compressed(first + stop)]
        scores = query_block_scores(q[start:stop].detach(), visible, positions, num_blocks, cfg, scale)
        sels.append(select_blocks(scores, evict, positions, cfg))
    return torch.cat(sels)


def _dense_rows(q, k, cis, cfg: NosaConfig) -> int:
    """Check the shapes of a prefill; the number of leading rows whose context fits in dense_len."""
    n, hq, _ = q.shape
    length, hkv, _ = k.shape
    if n > length:
        raise ValueError(f"nosa_prefill: {n} query rows but only {length} key tokens")
    if hq % hkv:
        raise ValueError(f"nosa_prefill: Hq={hq} is not a multiple of Hkv={hkv}")
    if cis.shape != (length, hkv):
        raise ValueError(f"nosa_prefill: cis must be [L, Hkv] = [{length}, {hkv}], got {list(cis.shape)}")
    return min(n, max(0, cfg.dense_len - (length - n)))


def _attend(q, k, v, cis, selection, dense_rows: int, cfg: NosaConfig, scale: float, row_chunk):
    """The rows within dense_len densely, the others over ``selection`` [n - dense_rows, Hkv, K]
    (None when every row is within dense_len)."""
    n, length = q.shape[0], k.shape[0]
    first = length - n
    outs = []
    if dense_rows:
        outs.append(dense_attention(q[:dense_rows], k[: first + dense_rows], v[: first + dense_rows], scale))
    if dense_rows < n:
        positions = torch.arange(first + dense_rows, length, device=q.device)
        outs.append(attend_selected(q[dense_rows:], k, v, cis, selection, positions, cfg, scale, row_chunk=row_chunk))
    if not outs:
        return q.new_zeros(0, q.shape[1], v.shape[-1])
    return torch.cat(outs) if len(outs) > 1 else outs[0]


def attend_selected(q, k, v, cis, sel, positions, cfg: NosaConfig, scale: float, row_chunk: int | None = None):
    """Selected-block attention of query rows: each row over its own selected blocks, at or before
    its position, token j weighted by exp(cis_j). q [n, Hq, D]; k/v [L, Hkv, D]; cis [L, Hkv];
    sel [n, Hkv, K] (-1 = none); positions [n] ascending, < L -> out [n, Hq, Dv] in q's dtype,
    differentiable in q, k, v and cis.

    The Triton block-sparse kernel, forward and backward, on CUDA (or NOSA_KERNELS=triton,
    nosa.ops); on CPU masked dense attention (nosa.attention.masked) while the rows' contexts are
    within a few budgets (training, short prefills), else the gathered torch path
    (nosa.attention.gathered). Both CPU paths compute the same attention and gradients.
    ``nosa_prefill`` and ``NosaDecodeState.prefill`` use it."""
    from nosa import ops  # optional: import nosa loads no kernel code (nosa.ops imports kernels/)

    if ops.use_kernels(q, k):
        return ops.sparse_prefill_attention(q, k, v, cis, sel, positions, cfg.block_size, scale)[0]
    training = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, cis))
    if masked.use_masked(positions, k.shape[1], cfg, training):
        return masked.attend_masked(q, k, v, cis, sel, positions, cfg, scale)
    return gathered.attend_grouped(q, k, v, cis, sel, positions, cfg, scale, row_chunk=row_chunk)


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
