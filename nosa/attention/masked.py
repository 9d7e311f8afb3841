"""Selected-block attention as masked dense attention: the short-context path of
``nosa.attention.prefill.attend_selected`` (training at 512-1024 tokens, short prefills).

Same math as ``nosa.attention.gathered.attend_grouped``; here every row scores all keys up to its
chunk's last position and a boolean mask (the selection expanded to tokens, and causality) removes
the others inside torch's fused SDPA, forward and backward: faster on CPU below a few budgets of
keys per row. The eviction bias rides in one extra head dimension so that SDPA's own backward
gives its gradient: q' = [q, 1 / scale], k' = [k, cis], v' = [v, 0] (scale * q'.k' = scale * q.k
+ cis; a float mask would get no gradient).

Layout as in nosa.layout: q [n, Hq, D]; k, v [L, Hkv, D]; cis [L, Hkv]; sel [n, Hkv, K].
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from nosa.attention.math import compute_dtype
from nosa.config import NosaConfig
from nosa.layout import NEG_INF
from nosa.select import selection_mask

# Masked attention is used while a row's keys up to its position (on average) are at most this
# many times its budget in tokens (topk_blocks * block_size). Measured on CPU, one thread, one layer
# (``scripts/bench_train.py --crossover``, results/train.json): with gradients, block 16 / budget 8
# (the tiny training config, GQA 4/2), the gathered path took 3.3x the masked one's time at 2
# budgets of keys per row, 2.1x at 4, 1.2x at 8 and 0.6x at 16.
MASKED_KEYS_PER_BUDGET_TRAIN = 8.0
# Without gradients (prefill past dense_len; released NosaConfig, GQA 8/2), against the gathered
# path's block-by-block attention (nosa.attention.paired): gathered / masked was 1.0-1.1x at 1.1
# budgets (5K tokens), 0.7-0.9x at 1.5 (8K), with A = 0 and A != 0.
MASKED_KEYS_PER_BUDGET_INFER = 1.25
# With gradients SDPA keeps each chunk's float mask for its backward, (KV heads x rows x keys)
# elements in all: at most this many (128 MiB in float32, as the gathered path's SAVE_ELEMENTS),
# else the gathered path, whose memory follows the budget rather than the context.
MASKED_SAVE_ELEMENTS = 1 << 25
# Rows go to SDPA in chunks of MASK_ROWS, each over the keys up to its last row, which skips most
# of the causal upper triangle (measured best at 512 and 1024 tokens against 64-1024 rows), and
# at most MASK_ELEMENTS (KV head, row, key) mask entries per call (64 MiB of float32).
MASK_ROWS = 128
MASK_ELEMENTS = 1 << 24


def use_masked(positions: torch.Tensor, num_kv_heads: int, cfg: NosaConfig, training: bool) -> bool:
    """Whether ``attend_masked`` is the faster path for query rows at ``positions`` [n] (ascending):
    their mean context against the budget (thresholds above, measured on CPU), and with gradients
    the masks SDPA keeps for backward within MASKED_SAVE_ELEMENTS."""
    if positions.numel() == 0:
        return False
    mean_keys = float(positions[0] + positions[-1]) / 2 + 1
    if training:
        return (mean_keys <= MASKED_KEYS_PER_BUDGET_TRAIN * cfg.budget_tokens
                and num_kv_heads * positions.numel() * mean_keys <= MASKED_SAVE_ELEMENTS)
    return mean_keys <= MASKED_KEYS_PER_BUDGET_INFER * cfg.budget_tokens


def attend_masked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cis: torch.Tensor,
    sel: torch.Tensor,
    positions: torch.Tensor,
    cfg: NosaConfig,
    scale: float,
) -> torch.Tensor:
    """Each row over its own selected blocks at or before its position, token j weighted by exp(cis_j).

    q [n, Hq, D]; k/v [L, Hkv, D]; cis [L, Hkv]; sel [n, Hkv, K] block indices (-1 = none);
    positions [n] ascending, < L. Returns out [n, Hq, D] in q's dtype (a row with no key: 0);
    differentiable in q, k, v and cis through autograd (SDPA's fused backward).
    """
    n, hq, d = q.shape
    length, hkv, dv = v.shape
    if dv != d:
        raise ValueError(f"attend_masked: v's head dim {dv} must equal q's {d}")
    group = hq // hkv
    dt = compute_dtype(q)
    if n == 0:
        return q.new_zeros(0, hq, d)
    bsz, last = cfg.block_size, int(positions[-1]) + 1
    with torch.no_grad():
        # a row with no key at all (its selection all -1, or only blocks after it) gets output 0 and
        # no gradient, as in the gathered path: it attends to token 0 here and is zeroed below, so no
        # NaN from an empty softmax reaches the backward
        has_key = ((sel >= 0) & (sel * bsz <= positions[:, None, None])).any(dim=-1)  # [n, Hkv]
        empty = None if bool(has_key.all()) else ~has_key.transpose(0, 1)  # [Hkv, n]
        blocks = selection_mask(sel.transpose(0, 1), cfg.num_blocks(last))  # [Hkv, n, NB]
        if empty is not None:
            blocks[..., 0] |= empty
        # additive float mask at block level (SDPA would convert a bool mask to this form itself)
        block_bias = torch.zeros(blocks.shape, dtype=dt, device=q.device).masked_fill_(~blocks, NEG_INF)
    # [Hkv, G, n, D+1] queries and [Hkv, 1, L', D+1] keys / values: one SDPA batch per KV head
    qa = torch.cat([q.to(dt), q.new_full((n, hq, 1), 1.0 / scale, dtype=dt)], dim=-1)
    qa = qa.view(n, hkv, group, d + 1).permute(1, 2, 0, 3)
    ka = torch.cat([k[:last].to(dt), cis[:last, :, None].to(dt)], dim=-1).transpose(0, 1)[:, None]
    va = F.pad(v[:last].to(dt), (0, 1)).transpose(0, 1)[:, None]
    rows = max(1, min(MASK_ROWS, MASK_ELEMENTS // (hkv * last)))
    outs = []
    for start in range(0, n, rows):
        stop = min(n, start + rows)
        first, keys = int(positions[start]), int(positions[stop - 1]) + 1
        with torch.no_grad():  # the chunk's mask: its rows' blocks as tokens, then causality
            nbk = -(-keys // bsz)
            # a fresh tensor (reshaping the expanded view can alias: one element for a whole block)
            mask = block_bias.new_empty(hkv, stop - start, nbk, bsz)
            mask.copy_(block_bias[:, start:stop, :nbk, None])
            mask = mask.view(hkv, stop - start, -1)[..., :keys]
            # keys before the chunk's first position are causal for all of its rows
            future = torch.arange(first, keys, device=q.device) > positions[start:stop, None]
            mask[..., first:keys].masked_fill_(future, NEG_INF)
        outs.append(F.scaled_dot_product_attention(
            qa[:, :, start:stop], ka[:, :, :keys], va[:, :, :keys], attn_mask=mask[:, None], scale=scale,
            enable_gqa=True))
    out = torch.cat(outs, dim=2)[..., :d]  # [Hkv, G, n, D]
    if empty is not None:
        out = out.masked_fill(empty[:, None, :, None], 0.0)
    return out.permute(2, 0, 1, 3).reshape(n, hq, d).to(q.dtype)
