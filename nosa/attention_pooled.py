"""``_SelectedAttention``: the autograd Function of the gathered path (nosa.attention_gathered).

Attention of groups of rows over whole blocks of block pools (k, v, cis laid out head-major,
one pool row per block), forward and a written-out backward that recomputes or reuses each
group's probabilities and accumulates dK, dV, dcis with one index_add per group, plus the
pool / gather / softmax helpers it shares with the inference path of ``_attend_selected``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from nosa.attention_math import NEG_INF, compute_dtype

# a training call keeps its groups' probabilities and gathered keys for backward up to this many
# elements (then recomputes the rest from the log-sum-exp): memory for about 1.5x less work
SAVE_ELEMENTS = 1 << 25


class _SelectedAttention(torch.autograd.Function):
    """out = softmax(scale * q.k + cis over each row's allowed keys) @ v, group by group; each group
    in two parts with one softmax over both: the shared keys ([Hkv, n * G] query rows against
    [Hkv, S * B] keys) and each row's own ([n * Hkv, G] against [n * Hkv, R * B]).
    Inputs q [n, Hq, D], k/v [L, Hkv, D], cis [L, Hkv], the plan of ``_row_groups``, scale, B,
    and whether a backward will follow (then intermediates are kept, up to SAVE_ELEMENTS)."""

    @staticmethod
    def forward(ctx, q, k, v, cis, groups, scale, block_size, keep):
        n, hq, d = q.shape
        dt = compute_dtype(q)
        pools = _pools(k, v, cis, dt, block_size)
        out = q.new_empty(n, hq, v.shape[-1], dtype=dt)
        # keep each group's probabilities and gathered keys for backward while they are small
        # enough (no recomputation), else only the log-sum-exp to recompute them from
        kept, budget = [], SAVE_ELEMENTS if keep else 0
        for start, stop, shared, rest in groups:
            parts = _group_probs(q[start:stop], pools, shared, rest, scale)
            out[start:stop] = _group_output(parts, stop - start, hq)
            size = sum(t.numel() for t in parts.values() if t is not None)
            if size <= budget:
                budget -= size
                kept.append(parts)
            else:
                kept.append({"lse": parts["lse"]})
        ctx.save_for_backward(q, k, v, cis, out)
        ctx.groups, ctx.kept, ctx.scale, ctx.block_size = groups, kept, scale, block_size
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, cis, out = ctx.saved_tensors
        n, hq, d = q.shape
        length, hkv, _ = k.shape
        dt = out.dtype
        scale = ctx.scale
        pools = _pools(k, v, cis, dt, ctx.block_size)
        dq = torch.empty(n, hq, d, dtype=dt, device=q.device)
        dk, dv, dc = (torch.zeros_like(p) for p in pools)
        grad_out = grad_out.to(dt)
        for (start, stop, shared, rest), p in zip(ctx.groups, ctx.kept):
            rows_n = stop - start
            if "p_s" not in p:
                p = _group_probs(q[start:stop], pools, shared, rest, scale, lse=p["lse"])
            go = grad_out[start:stop]
            delta = (go * out[start:stop]).sum(-1, keepdim=True)  # [n, Hq, 1]
            # shared part, [Hkv, n*G, .] layout
            go_s, delta_s = _group_queries(go, hkv), _group_queries(delta, hkv)
            ds_s = p["p_s"] * (torch.bmm(go_s, p["v_s"].transpose(1, 2)) - delta_s)
            dq_g = _ungroup(torch.bmm(ds_s, p["k_s"]), rows_n, hq)
            _accumulate(dk, dv, dc, shared[0], torch.bmm(ds_s.transpose(1, 2), p["q_s"]),
                        torch.bmm(p["p_s"].transpose(1, 2), go_s), ds_s.sum(dim=1), scale)
            if p["p_r"] is not None:  # each row's own part, [n*Hkv, G, .] layout
                go_r = go.reshape(rows_n * hkv, -1, go.shape[-1])
                ds_r = p["p_r"] * (torch.bmm(go_r, p["v_r"].transpose(1, 2)) - delta.reshape(rows_n * hkv, -1, 1))
                dq_g += torch.bmm(ds_r, p["k_r"]).view(rows_n, hq, d)
                _accumulate(dk, dv, dc, rest[0], torch.bmm(ds_r.transpose(1, 2), p["q_r"]),
                            torch.bmm(p["p_r"].transpose(1, 2), go_r), ds_r.sum(dim=1), scale)
            dq[start:stop] = dq_g * scale

        def unpool(x, like):  # [Hkv * NB, B * D'] -> like's [L, Hkv, D'] layout
            return x.view(hkv, -1, *like.shape[2:])[:, :length].transpose(0, 1).to(like.dtype)

        grads = (dq.to(q.dtype), unpool(dk, k), unpool(dv, v), unpool(dc, cis))
        needed = ctx.needs_input_grad
        return tuple(g if needed[i] else None for i, g in enumerate(grads)) + (None, None, None, None)


def _accumulate(dk, dv, dc, rows, dk_x, dv_x, dc_x, scale):
    """Add one part's gradients (per gathered key: dk_x [b, W * B, D] before ``scale``, dv_x, dc_x
    [b, W * B]) into the block pools' gradients at its blocks ``rows`` [b, W]."""
    flat = rows.flatten()
    dk.index_add_(0, flat, dk_x.reshape(-1, dk.shape[1]), alpha=scale)
    dv.index_add_(0, flat, dv_x.reshape(-1, dv.shape[1]))
    dc.index_add_(0, flat, dc_x.reshape(-1, dc.shape[1]))


def _pools(k, v, cis, dt, block_size):
    """k, v [L, Hkv, D] and cis [L, Hkv] as block pools, head-major, padded to whole blocks:
    [Hkv * NB, B * D] and [Hkv * NB, B]. Row h * NB + b is block b of KV head h, contiguous, so a
    group gathers whole blocks (kilobytes per index) rather than one token's row at a time."""
    length = k.shape[0]
    pad = -length % block_size

    def pool(x):
        x = x.to(dt).transpose(0, 1)  # [Hkv, L, ...]
        if pad:
            x = F.pad(x, (0, 0) * (x.dim() - 2) + (0, pad))
        return x.reshape(x.shape[0] * ((length + pad) // block_size), -1)

    return pool(k), pool(v), pool(cis)


def _group_queries(x, hkv):
    """[n, Hq, D] -> [Hkv, n * G, D]: a KV head's query heads of every row, row-major."""
    n, hq, d = x.shape
    return x.reshape(n, hkv, hq // hkv, d).transpose(0, 1).reshape(hkv, -1, d)


def _ungroup(x, n, hq):
    """[Hkv, n * G, D] -> [n, Hq, D]."""
    hkv = x.shape[0]
    return x.view(hkv, n, hq // hkv, -1).transpose(0, 1).reshape(n, hq, -1)


def _logits(qx, k_x, bias, scale, group):
    """scale * qx @ k_x^T + bias: qx [b, m, D], k_x [b, W, D], bias [b, m / group, W] (one bias
    row for each ``group`` consecutive query rows, the query heads of one KV head)."""
    logits = torch.bmm(qx, k_x.transpose(1, 2))  # no autograd here: in place is safe
    b, m, width = logits.shape
    logits.mul_(scale).view(b, m // group, group, width).add_(bias[:, :, None, :])
    return logits


def _gather(pools, rows, batch):
    """Blocks ``rows`` [batch, W] of the pools -> K, V [batch, W * B, D] and cis [batch, W * B]."""
    flat = rows.flatten()
    return tuple(p.index_select(0, flat).view(batch, -1, *((p.shape[1] // pools[2].shape[1],) if i < 2 else ()))
                 for i, p in enumerate(pools))


def _group_probs(q, pools, shared, rest, scale, lse=None) -> dict:
    """Probabilities of one group's rows q [n, Hq, D] over its shared keys (``p_s`` [Hkv, n*G, S*B])
    and their own (``p_r`` [n*Hkv, G, R*B], None when R = 0), with one softmax over both; the lse
    [n, Hq] (recomputed from when given, in backward) and the gathered q/K/V of both parts."""
    n, hq, d = q.shape
    rows_s, allowed_s = shared
    rows_r, valid_r = rest
    hkv = rows_s.shape[0]
    group = hq // hkv
    dt = pools[0].dtype
    out = {"q_s": _group_queries(q.to(dt), hkv)}
    out["k_s"], out["v_s"], c_s = _gather(pools, rows_s, hkv)
    bias = torch.where(allowed_s.transpose(0, 1), c_s[:, None, :], NEG_INF)  # [Hkv, n, S*B]
    logit_s = _logits(out["q_s"], out["k_s"], bias, scale, group)
    logit_r = None
    if rows_r.shape[1]:
        out["q_r"] = q.to(dt).reshape(n * hkv, group, d)
        out["k_r"], out["v_r"], c_r = _gather(pools, rows_r, n * hkv)
        bias_r = torch.where(valid_r, c_r, NEG_INF)
        logit_r = _logits(out["q_r"], out["k_r"], bias_r[:, None, :], scale, group)
    if lse is None:
        lse = _ungroup(torch.logsumexp(logit_s, dim=-1, keepdim=True), n, hq)[..., 0]  # [n, Hq]
        if logit_r is not None:
            lse = torch.logaddexp(lse, torch.logsumexp(logit_r, dim=-1).view(n, hq))
    safe = lse.masked_fill(lse == NEG_INF, 0.0)  # a row with no key at all: probabilities 0
    out["lse"] = lse
    out["p_s"] = logit_s.sub_(_group_queries(safe[..., None], hkv)).exp_()
    out["p_r"] = None if logit_r is None else logit_r.sub_(safe.view(n * hkv, group, 1)).exp_()
    return out


def _group_output(parts: dict, n: int, hq: int) -> torch.Tensor:
    """[n, Hq, Dv]: probabilities times values of both parts."""
    out = _ungroup(torch.bmm(parts["p_s"], parts["v_s"]), n, hq)
    if parts["p_r"] is not None:
        out += torch.bmm(parts["p_r"], parts["v_r"]).view(n, hq, -1)
    return out
