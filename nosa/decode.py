"""NOSA decode: one query per step with incremental state, the path serving and generate() use.

Layout: q [Hq, D]; the sequence's keys/values [L, Hkv, D], or a paged pool [N, Hkv, D] plus a slot
table ``slots`` [L] (token i lives at pool row slots[i], SGLang's req_to_token row).
"""

from __future__ import annotations

import torch

from nosa.attention import NEG_INF, compute_dtype, dense_attention, gather_heads
from nosa.compress import compress_windows, pool_to_blocks
from nosa.config import NosaConfig
from nosa.eviction import block_means
from nosa.select import blocks_entering, query_block_scores, select_blocks


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
        dt = compute_dtype(q)
        qg = q.to(dt).reshape(hkv, group, -1)
        logits = torch.einsum("hgd,htd->hgt", qg, k_sel.to(dt)) * scale + cis.to(dt)[:, None, :]
        probs = torch.softmax(logits, dim=-1)
        out = torch.einsum("hgt,htd->hgd", probs, v_sel.to(dt))
        return out.reshape(q.shape).to(q.dtype)


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
