"""Sliding-window layers of a hybrid model (Gemma 3) in the nosa backend: dense attention over the
last ``window`` tokens, never offloaded and never selected.

A query at position p attends to positions [p - window + 1, p] (SGLang's ``sliding_window_size``
is window - 1, transformers' ``sliding_window`` is window). Two homes for the window's K and V:

- ``PoolWindows`` (offloading off): SGLang's device KV pool, which holds every layer's tokens (SGLang
  disables its hybrid SWA pool for Gemma 3), read at the request's last ``window`` slots.
- ``RingWindows`` (offloading on): a device ring of ``window`` tokens per (request row, sliding
  layer), position p at ring slot p % window. The host pool then holds the full-attention layers
  only, so a request's sliding layers cost window tokens of device memory, whatever its length.
  Its rows are filled by the request's own extends, so a prefix-cache hit (KV the request did not
  compute) cannot be served: the backend refuses the radix cache with a hybrid model and offloading.

Decode runs all requests at once on fixed shapes (a graph runner can capture it); an extend runs
per request in query tiles of ``window`` rows, each over at most 2 x window keys.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def window_attention(q, k, v, q_start: int, k_start: int, window: int, scale: float) -> torch.Tensor:
    """q [n, Hq, D] at positions [q_start, q_start + n); k, v [m, Hkv, D] at contiguous positions
    [k_start, k_start + m) that cover every query's window. Returns [n, Hq, Dv]: each row's causal
    sliding-window attention, in query tiles of ``window`` rows."""
    n, hq, _ = q.shape
    out = q.new_empty(n, hq, v.shape[-1])
    for t0 in range(0, n, window):
        t1 = min(n, t0 + window)
        first = max(k_start, q_start + t0 - window + 1)  # the oldest key any row of the tile sees
        k_pos = torch.arange(first, q_start + t1, device=q.device)
        q_pos = torch.arange(q_start + t0, q_start + t1, device=q.device)
        keep = (k_pos[None] <= q_pos[:, None]) & (k_pos[None] > q_pos[:, None] - window)
        ks, vs = k[first - k_start : q_start + t1 - k_start], v[first - k_start : q_start + t1 - k_start]
        out[t0:t1] = _sdpa(q[t0:t1].transpose(0, 1)[None], ks.transpose(0, 1)[None], vs.transpose(0, 1)[None],
                           keep[None, None], scale)[0].transpose(0, 1)
    return out


def _sdpa(q, k, v, mask, scale: float) -> torch.Tensor:
    """[B, Hq, n, D] over [B, Hkv, m, D] (grouped-query heads), boolean mask [B, 1, n, m]."""
    return F.scaled_dot_product_attention(q, k.to(q.dtype), v.to(q.dtype), attn_mask=mask, scale=scale,
                                          enable_gqa=q.shape[1] != k.shape[1])


def _decode(q, k, v, valid, scale: float) -> torch.Tensor:
    """q [R, Hq, D] over each row's keys k, v [R, W, Hkv, D] where valid [R, W]. Returns [R, Hq, Dv]."""
    return _sdpa(q[:, :, None], k.transpose(1, 2), v.transpose(1, 2), valid[:, None, None], scale)[:, :, 0]


class PoolWindows:
    """Windows read from SGLang's device KV pool (offloading off)."""

    def __init__(self, pool, req_to_token: torch.Tensor, window: int):
        self.pool, self.req_to_token, self.window = pool, req_to_token, window

    def extend(self, layer_id: int, row: int, slots, q, k_new, v_new, scale: float) -> torch.Tensor:
        """A request's n new rows q [n, Hq, D] (their K, V already written to the pool) over its
        window; ``slots`` [L]: its context's slots, the new tokens last."""
        length, n = slots.shape[0], q.shape[0]
        first = max(0, length - n - self.window + 1)
        keys = slots[first:].long()
        k = self.pool.get_key_buffer(layer_id)[keys]
        v = self.pool.get_value_buffer(layer_id)[keys]
        return window_attention(q, k, v, length - n, first, self.window, scale)

    def decode(self, layer_id: int, rows, seq_lens, q, k_new, v_new, scale: float) -> torch.Tensor:
        """q [R, Hq, D] of requests ``rows`` [R] with contexts ``seq_lens`` [R] (the new token's
        included, already in the pool) over their last ``window`` tokens. Fixed shapes."""
        pos = seq_lens.long()[:, None] - self.window + torch.arange(self.window, device=q.device)[None]  # [R, W]
        valid = pos >= 0
        slots = self.req_to_token[rows.long()[:, None], pos.clamp(min=0)].long()
        k = self.pool.get_key_buffer(layer_id)[slots]
        v = self.pool.get_value_buffer(layer_id)[slots]
        return _decode(q, k, v, valid, scale)


class RingWindows:
    """Windows in a device ring per (request row, sliding layer) (offloading on)."""

    def __init__(self, layer_ids: list[int], rows: int, window: int, num_kv_heads: int, head_dim: int,
                 v_head_dim: int, dtype, device):
        self.window = window
        self.index = {layer_id: i for i, layer_id in enumerate(layer_ids)}
        shape = (rows, window, num_kv_heads)
        self.k = [torch.zeros(*shape, head_dim, dtype=dtype, device=device) for _ in layer_ids]
        self.v = [torch.zeros(*shape, v_head_dim, dtype=dtype, device=device) for _ in layer_ids]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.k, *self.v))

    def extend(self, layer_id: int, row: int, slots, q, k_new, v_new, scale: float) -> torch.Tensor:
        """A request's n new rows q [n, Hq, D] with their K, V [n, Hkv, D] over its window: the ring's
        older tokens (in position order) then the new ones; the new tokens then enter the ring.
        ``slots`` [L]: its context's slots (only their number is read)."""
        i, length, n = self.index[layer_id], slots.shape[0], q.shape[0]
        start = length - n  # position of the first new token
        first = max(0, start - self.window + 1)
        old = torch.arange(first, start, device=q.device) % self.window
        k = torch.cat([self.k[i][row, old], k_new.to(self.k[i].dtype)])
        v = torch.cat([self.v[i][row, old], v_new.to(self.v[i].dtype)])
        out = window_attention(q, k, v, start, first, self.window, scale)
        keep = min(n, self.window)  # only the last window tokens can be seen again
        at = torch.arange(length - keep, length, device=q.device) % self.window
        self.k[i][row, at] = k_new[n - keep:].to(self.k[i].dtype)
        self.v[i][row, at] = v_new[n - keep:].to(self.v[i].dtype)
        return out

    def decode(self, layer_id: int, rows, seq_lens, q, k_new, v_new, scale: float) -> torch.Tensor:
        """q [R, Hq, D] and the new tokens' K, V [R, Hkv, D] of requests ``rows`` [R] with contexts
        ``seq_lens`` [R] (the new token's included): the new token enters the ring, then every row
        attends over its ring's valid slots. Fixed shapes."""
        i, rows, seq_lens = self.index[layer_id], rows.long(), seq_lens.long()
        self.k[i][rows, (seq_lens - 1) % self.window] = k_new.to(self.k[i].dtype)
        self.v[i][rows, (seq_lens - 1) % self.window] = v_new.to(self.v[i].dtype)
        slot = torch.arange(self.window, device=q.device)[None]
        last = (seq_lens - 1)[:, None]
        valid = last - (last - slot) % self.window >= 0  # the position ring slot s holds: <= last, == s mod W
        return _decode(q, self.k[i][rows], self.v[i][rows], valid, scale)
