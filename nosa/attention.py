"""NOSA attention, the reference implementation (pure PyTorch, any device, autograd).

Layout (one sequence, token-major as in SGLang): q [n, Hq, D]; k, v [L, Hkv, D]; cis [L, Hkv];
the n query rows are the last n tokens of the L-token context (n == L for a plain prefill, n == 1
for decode). G = Hq // Hkv query heads share one KV head and one selection.

Two paths, one selection (nosa.select):
- ``nosa_prefill``: token-level queries; every row gets its own selection from the blocks up to
  its position (causal inside the current block). Used for training and prefill.
- ``NosaDecodeState``: one query per step with incremental state (compressed keys, eviction scores,
  previous selection); memory linear in the context, nothing of size L x L.
Rows whose context has at most ``dense_len`` tokens attend densely (plain causal softmax, no
eviction weighting), so short prompts behave exactly like the dense model.
"""

from __future__ import annotations

import torch

from nosa.compress import compress_windows, pool_to_blocks
from nosa.config import NosaConfig
from nosa.eviction import block_eviction_scores, block_means
from nosa.select import blocks_entering, query_block_scores, select_blocks, selection_mask

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
    Returns (out [n, Hq, D], selection [n, Hkv, K] long, -1 padded). Rows are processed
    ``row_chunk`` at a time; each chunk attends over the union of its rows' selected blocks, so work
    and memory follow the budget rather than the context (the default chunk keeps the logits of a
    chunk near 2**25 elements, between 16 and 512 rows).
    """
    n, hq, d = q.shape
    length, hkv, _ = k.shape
    if row_chunk is None:  # block-aligned chunks keep the union of the rows' blocks tight
        span = min(length, 4 * cfg.topk_blocks * cfg.block_size)
        row_chunk = max(16, min(512, 2**25 // max(1, span * hq)))
        row_chunk = max(cfg.block_size, row_chunk // cfg.block_size * cfg.block_size)
    if n > length:
        raise ValueError(f"nosa_prefill: {n} query rows but only {length} key tokens")
    if hq % hkv:
        raise ValueError(f"nosa_prefill: Hq={hq} is not a multiple of Hkv={hkv}")
    num_blocks = cfg.num_blocks(length)
    with torch.no_grad():
        compressed_k = compress_windows(k.detach(), cfg)  # [C, Hkv, D]
        evict = block_eviction_scores(cis, cfg, num_blocks)[None]  # [1, Hkv, NB, 2]
    outs, sels = [], []
    for start in range(0, n, row_chunk):
        stop = min(start + row_chunk, n)
        positions = torch.arange(length - n + start, length - n + stop, device=q.device)
        with torch.no_grad():
            qs = query_block_scores(q[start:stop].detach(), compressed_k, positions, num_blocks, cfg, scale)
            sel = select_blocks(qs, evict, positions, cfg)
        outs.append(_attend_selected(q[start:stop], k, v, cis, sel, positions, cfg, scale))
        sels.append(sel)
    return torch.cat(outs), torch.cat(sels)


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
    positions = torch.arange(length - n, length, device=q.device)
    causal = torch.arange(length, device=q.device)[None, :] <= positions[:, None]  # [n, L]
    bias = torch.zeros(n, k.shape[1], length, device=q.device).masked_fill(~causal[:, None, :], NEG_INF)
    return _attend(q, k, v, bias, scale)


class NosaDecodeState:
    """Incremental NOSA state of one sequence in one layer.

    Holds what the decode path needs beyond the KV itself: compressed keys [C, Hkv, D], token
    eviction scores cis [L, Hkv], static block eviction scores [Hkv, NB], and the previous
    selection [Hkv, K]. Everything grows linearly with the context (amortised doubling buffers).
    The KV itself stays wherever the caller keeps it (HF cache, SGLang pool, host memory).
    """

    def __init__(self, cfg: NosaConfig, num_kv_heads: int, head_dim: int, device=None):
        self.cfg = cfg
        self.length = 0
        self._ck = _Growable((num_kv_heads, head_dim), torch.float32, device)
        self._cis = _Growable((num_kv_heads,), torch.float32, device)
        self._evict = _Growable((num_kv_heads,), torch.float32, device, fill=NEG_INF)  # [NB, Hkv]
        self.selection: torch.Tensor | None = None  # [Hkv, K]
        self.entering: torch.Tensor | None = None  # [Hkv] blocks new in the last selection

    @property
    def num_windows(self) -> int:
        return self._ck.size

    def append(self, k_all: torch.Tensor, cis_new: torch.Tensor, slots: torch.Tensor | None = None) -> None:
        """Account for m new tokens; cis_new: [m, Hkv].

        k_all: the sequence's keys including the new ones, [L, Hkv, D]; or, with ``slots`` [L]
        (long), a paged pool [N, Hkv, D] in which token i lives at row slots[i] (SGLang's
        req_to_token row). Only the rows of the new compressed windows are read."""
        cfg = self.cfg
        new_length = self.length + cis_new.shape[0]
        have = k_all.shape[0] if slots is None else slots.shape[0]
        if have != new_length:
            raise ValueError(f"NosaDecodeState.append: expected keys for {new_length} tokens, got {have}")
        self._cis.extend(cis_new.detach().float())
        first, total = self.num_windows, cfg.num_compressed(new_length)
        if total > first:
            lo = cfg.compress_stride * first
            hi = cfg.compress_stride * (total - 1) + cfg.compress_kernel
            rows = k_all[lo:hi] if slots is None else k_all.index_select(0, slots[lo:hi])
            self._ck.extend(compress_windows(rows.detach().float(), cfg, 0, total - first))
            window_cis = compress_windows(self._cis.view(), cfg, first, total - first)  # [c, Hkv]
            num_blocks = cfg.num_blocks(new_length)
            self._evict.grow_to(num_blocks)
            pooled = pool_to_blocks(window_cis.transpose(0, 1), num_blocks, cfg, first_window=first)
            evict = self._evict.view()
            evict.copy_(torch.maximum(evict, pooled.transpose(0, 1)))
        self.length = new_length

    def select(self, q: torch.Tensor, scale: float) -> torch.Tensor:
        """Selection for the query of the last token. q: [Hq, D] -> [Hkv, K]."""
        cfg = self.cfg
        num_blocks = cfg.num_blocks(self.length)
        positions = torch.tensor([self.length - 1], device=q.device)
        qs = query_block_scores(q[None].detach(), self._ck.view(), positions, num_blocks, cfg, scale)
        pooled = self._evict.view()[:num_blocks].transpose(0, 1)  # [Hkv, <=NB]
        if pooled.shape[-1] < num_blocks:  # blocks without a complete window yet
            pad = pooled.new_full((pooled.shape[0], num_blocks - pooled.shape[-1]), NEG_INF)
            pooled = torch.cat([pooled, pad], dim=-1)
        means = block_means(self._cis.view(), num_blocks, cfg.block_size)
        evict = torch.stack([pooled, means], dim=-1)[None]  # [1, Hkv, NB, 2]
        sel = select_blocks(qs, evict, positions, cfg)[0]
        if self.selection is not None:
            self.entering = blocks_entering(self.selection, sel)
        self.selection = sel
        return sel

    def attend(
        self, q: torch.Tensor, k_all: torch.Tensor, v_all: torch.Tensor, scale: float,
        slots: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Decode attention for the last token: q [Hq, D] -> [Hq, D]. k_all/v_all: [L, Hkv, D], or
        paged pools [N, Hkv, D] with ``slots`` [L] as in ``append``.

        Reads only the selected blocks (O(K * block_size) work), except below dense_len."""
        cfg = self.cfg
        sel = self.select(q, scale)
        if self.length <= cfg.dense_len:
            if slots is not None:
                k_all, v_all = k_all.index_select(0, slots), v_all.index_select(0, slots)
            return dense_attention(q[None], k_all, v_all, scale)[0]
        hkv = k_all.shape[1]
        offsets = torch.arange(cfg.block_size, device=q.device)
        tokens = (sel.clamp(min=0)[..., None] * cfg.block_size + offsets).reshape(hkv, -1)  # [Hkv, K*B]
        valid = ((sel >= 0)[..., None].expand(-1, -1, cfg.block_size).reshape(hkv, -1)) & (tokens < self.length)
        tokens = tokens.clamp(max=self.length - 1)
        rows = tokens if slots is None else slots[tokens]
        k_sel = gather_heads(k_all, rows)  # [Hkv, K*B, D]
        v_sel = gather_heads(v_all, rows)
        cis = gather_heads(self._cis.view(), tokens).masked_fill(~valid, NEG_INF)  # [Hkv, K*B]
        group = q.shape[0] // hkv
        dt = _compute_dtype(q)
        qg = q.to(dt).reshape(hkv, group, -1)
        logits = torch.einsum("hgd,htd->hgt", qg, k_sel.to(dt)) * scale + cis.to(dt)[:, None, :]
        probs = torch.softmax(logits, dim=-1)
        out = torch.einsum("hgt,htd->hgd", probs, v_sel.to(dt))
        return out.reshape(q.shape).to(q.dtype)


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
    exp(cis_j); rows within dense_len attend densely without weights.

    q [n, Hq, D]; k/v [L, Hkv, D]; cis [L, Hkv]; sel [n, Hkv, K]; positions [n] -> [n, Hq, D].
    Keys are gathered once for the union of the rows' blocks (per KV head) and masked per row.
    """
    n, hq, d = q.shape
    hkv, bsz = k.shape[1], cfg.block_size
    last = int(positions[-1])
    nb = cfg.num_blocks(last + 1)
    dense_row = positions + 1 <= cfg.dense_len  # [n]
    row_blocks = selection_mask(sel, nb)  # [n, Hkv, NB]
    exists = torch.arange(nb, device=q.device)[None, :] <= (positions // bsz)[:, None]  # [n, NB]
    row_blocks = row_blocks | (dense_row[:, None, None] & exists[:, None, :])
    union = row_blocks.any(dim=0)  # [Hkv, NB]
    width = int(union.sum(dim=-1).max())
    # the union's blocks first (in block order), padding after them
    ublocks = torch.sort(union.to(torch.int8), dim=-1, descending=True, stable=True).indices[:, :width]
    offsets = torch.arange(bsz, device=q.device)
    tokens = (ublocks[..., None] * bsz + offsets).reshape(hkv, width * bsz)  # [Hkv, T]
    token_ok = union.gather(-1, ublocks).repeat_interleave(bsz, dim=-1) & (tokens <= last)
    tokens = tokens.clamp(max=last)
    k_sel, v_sel, cis_sel = (gather_heads(x, tokens) for x in (k, v, cis))  # [Hkv, T, D], [Hkv, T]
    # masks and bias in [Hkv, n, T]: the layout of the batched matmuls below (no permuted copies)
    allowed = row_blocks.transpose(0, 1).gather(-1, ublocks[:, None, :].expand(-1, n, -1))
    allowed = allowed.repeat_interleave(bsz, dim=-1) & token_ok[:, None, :]
    allowed = allowed & (tokens[:, None, :] <= positions[None, :, None])
    weight = torch.where(dense_row[None, :, None], torch.zeros_like(cis_sel)[:, None, :], cis_sel[:, None, :])
    bias = weight.masked_fill(~allowed, NEG_INF)
    dt = _compute_dtype(q)
    group = hq // hkv
    qh = q.to(dt).reshape(n, hkv, group, d).permute(1, 0, 2, 3).reshape(hkv, n * group, d)
    logits = torch.bmm(qh, k_sel.to(dt).transpose(1, 2)).view(hkv, n, group, -1) * scale
    probs = torch.softmax(logits + bias.to(dt)[:, :, None, :], dim=-1)
    out = torch.bmm(probs.view(hkv, n * group, -1), v_sel.to(dt))  # [Hkv, n*G, Dv]
    return out.view(hkv, n, group, -1).permute(1, 0, 2, 3).reshape(n, hq, -1).to(q.dtype)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor, scale: float) -> torch.Tensor:
    """softmax(q k^T * scale + bias) v with GQA. q [n, Hq, D], k/v [L, Hkv, D], bias [n, Hkv, L]."""
    n, hq, d = q.shape
    hkv = k.shape[1]
    dt = _compute_dtype(q)
    qg = q.to(dt).reshape(n, hkv, hq // hkv, d)
    logits = torch.einsum("nhgd,lhd->nhgl", qg, k.to(dt)) * scale + bias.to(dt)[:, :, None, :]
    probs = torch.softmax(logits, dim=-1)
    out = torch.einsum("nhgl,lhd->nhgd", probs, v.to(dt))
    return out.reshape(n, hq, v.shape[-1]).to(q.dtype)


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    """Softmax in at least fp32 (bf16/fp16 inputs are upcast; fp64 stays fp64 for gradcheck)."""
    return torch.promote_types(x.dtype, torch.float32)


class _Growable:
    """A [size, *row_shape] tensor with amortised O(1) appends (capacity doubling)."""

    def __init__(self, row_shape: tuple[int, ...], dtype: torch.dtype, device, fill: float = 0.0):
        self._buf = torch.full((16, *row_shape), fill, dtype=dtype, device=device)
        self._fill = fill
        self.size = 0

    def _reserve(self, size: int) -> None:
        if size > self._buf.shape[0]:
            cap = max(size, 2 * self._buf.shape[0])
            new = self._buf.new_full((cap, *self._buf.shape[1:]), self._fill)
            new[: self.size] = self._buf[: self.size]
            self._buf = new

    def extend(self, rows: torch.Tensor) -> None:
        self._reserve(self.size + rows.shape[0])
        self._buf[self.size : self.size + rows.shape[0]] = rows
        self.size += rows.shape[0]

    def grow_to(self, size: int) -> None:
        """Extend with fill rows up to ``size`` rows."""
        if size > self.size:
            self._reserve(size)
            self.size = size

    def view(self) -> torch.Tensor:
        return self._buf[: self.size]
