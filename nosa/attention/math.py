"""The small attention math that prefill, decode and the serving engine share (layout: nosa.layout).

The softmax dtype (``compute_dtype``), causal dense attention (``dense_attention``), attention of
each query row over its own gathered keys with its log-sum-exp (``attend_gathered``) and the exact
merge of such results over disjoint key sets (``merge_attention``). It imports only nosa.layout,
so importing it loads neither the prefill paths nor nosa.ops and the kernels.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from nosa.layout import NEG_INF


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal dense attention for the last n tokens (the dense_len path and a test yardstick).
    q [n, Hq, D], k/v [L, Hkv, D] -> [n, Hq, D].

    SDPA's causal mode skips the keys after each row's block (half the work of a whole prefill),
    but it aligns row 0 with key 0. So rows that are most of the context (n >= L / 2) run as a
    whole causal prefill whose first L - n rows are zero queries, dropped after (L^2 / 2 work
    instead of n * L); fewer rows, the new rows of a chunked prefill, take an explicit mask."""
    n, length = q.shape[0], k.shape[0]
    dt = compute_dtype(q)

    def heads_first(x):  # [T, H, D] -> [1, H, T, D]
        return x.to(dt).transpose(0, 1)[None]

    if 2 * n >= length:
        rows = q if n == length else torch.cat([q.new_zeros(length - n, *q.shape[1:]), q])
        out = F.scaled_dot_product_attention(heads_first(rows), heads_first(k), heads_first(v), is_causal=True,
                                             scale=scale, enable_gqa=True)[..., length - n :, :]
    else:
        positions = torch.arange(length - n, length, device=q.device)
        causal = torch.arange(length, device=q.device)[None, :] <= positions[:, None]  # [n, L]
        out = F.scaled_dot_product_attention(heads_first(q), heads_first(k), heads_first(v), attn_mask=causal,
                                             scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1).to(q.dtype)


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
    row first measured about 3x slower on CPU. Decode (``nosa.decode``) uses it; prefill, many rows
    per block, goes block by block instead (nosa.attention.paired).
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


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """Softmax in at least fp32 (bf16/fp16 inputs are upcast; fp64 stays fp64 for gradcheck)."""
    return torch.promote_types(x.dtype, torch.float32)
