"""Compressed windows and the pooling of window scores onto blocks.

Window ``j`` covers tokens ``[s*j, s*j + c)`` (``s = compress_stride``, ``c = compress_kernel``);
only complete windows exist, so ``L`` tokens hold ``NosaConfig.num_compressed(L)`` windows.
Block ``b`` covers tokens ``[B*b, B*b + B)`` (``B = block_size``). A block's pooled score is the
max over the windows that overlap it.
"""

from __future__ import annotations

import torch

from nosa.config import NosaConfig


def compress_windows(x: torch.Tensor, cfg: NosaConfig, first: int = 0, count: int | None = None) -> torch.Tensor:
    """Mean of ``x`` over compressed windows ``first .. first+count-1``.

    x: [L, ...] token-major (keys [L, Hkv, D] or eviction scores [L, Hkv]).
    Returns [count, ...]; ``count`` defaults to every complete window from ``first`` on.
    """
    c, s = cfg.compress_kernel, cfg.compress_stride
    if count is None:
        count = max(cfg.num_compressed(x.shape[0]) - first, 0)
    if count == 0:
        return x.new_zeros((0, *x.shape[1:]))
    span = x[s * first : s * (first + count - 1) + c]
    # unfold puts the window dimension last: [count, ..., c]
    return span.unfold(0, c, s).mean(dim=-1)


def window_block_index(
    num_windows: int, cfg: NosaConfig, device: torch.device | None = None, first_window: int = 0
):
    """For windows ``first_window .. first_window + num_windows - 1``, the blocks each overlaps.

    Returns (index [C, O] long, valid [C, O] bool): window ``j`` overlaps blocks ``index[j, o]`` for
    the ``o`` where ``valid[j, o]``. ``O`` is the most blocks one window can touch.
    """
    c, s, bsz = cfg.compress_kernel, cfg.compress_stride, cfg.block_size
    overlap = (c - 1) // bsz + 2
    j = torch.arange(first_window, first_window + num_windows, device=device)
    first_block = (s * j) // bsz
    last_block = (s * j + c - 1) // bsz
    index = first_block[:, None] + torch.arange(overlap, device=device)[None, :]
    valid = index <= last_block[:, None]
    return index, valid


def pool_to_blocks(
    window_scores: torch.Tensor, num_blocks: int, cfg: NosaConfig, first_window: int = 0
) -> torch.Tensor:
    """Max-pool window scores onto blocks.

    window_scores: [..., C], scores of windows ``first_window ..``; returns [..., num_blocks],
    ``-inf`` where none of these windows overlaps a block.
    ``-inf`` window scores (invisible windows) never raise a block's score.
    """
    num_windows = window_scores.shape[-1]
    lead = window_scores.shape[:-1]
    if num_windows and first_window == 0:
        return _pool_aligned(window_scores, num_blocks, cfg)
    out = window_scores.new_full((*lead, num_blocks + 1), float("-inf"))
    if num_windows == 0:
        return out[..., :num_blocks]
    index, valid = window_block_index(num_windows, cfg, window_scores.device, first_window)
    # Overlaps that fall off the end or are invalid go to the spare column `num_blocks`.
    index = torch.where(valid & (index < num_blocks), index, num_blocks)
    overlap = index.shape[1]
    src = window_scores.unsqueeze(-1).expand(*lead, num_windows, overlap).reshape(*lead, -1)
    idx = index.reshape(-1).expand(*lead, num_windows * overlap)
    out = out.scatter_reduce(-1, idx, src, reduce="amax", include_self=True)
    return out[..., :num_blocks]


def _pool_aligned(window_scores: torch.Tensor, num_blocks: int, cfg: NosaConfig) -> torch.Tensor:
    """``pool_to_blocks`` from window 0 (NosaConfig guarantees block_size % compress_stride == 0):
    block b overlaps windows ``r*b - p .. r*b + (B-1)//s`` (r = B/s, p = (c-1)//s), so the pooling is
    a sliding max of fixed width and stride over the window scores padded with -inf."""
    c, s, bsz = cfg.compress_kernel, cfg.compress_stride, cfg.block_size
    ratio, before = bsz // s, (c - 1) // s
    width = before + (bsz - 1) // s + 1
    total = ratio * (num_blocks - 1) + width  # padded length the last block's window needs
    after = max(total - before - window_scores.shape[-1], 0)
    padded = torch.nn.functional.pad(window_scores, (before, after), value=float("-inf"))
    return padded.unfold(-1, width, ratio)[..., :num_blocks, :].amax(dim=-1)
