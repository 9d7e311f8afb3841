"""The gathered path of selected-block attention (``attend_grouped``): the CPU path for long
contexts, where gathering each row's selected blocks costs less than scoring every key.

Keys are read as whole blocks of block pools (``block_pools``). Training: rows go in groups of
one row chunk (``default_row_chunk``, ``chunk_end``); a group's rows share the blocks all of them
selected (their sinks and forced window, with eviction heads on most of their static blocks),
attended by all its rows in one matmul, and each row gathers its other blocks (``_row_groups``),
in the autograd Function ``_SelectedAttention`` (forward and a written-out backward). Inference
attends block by block (nosa.attention.paired), whose matmuls stay wide however little the rows
share.
nosa.attention.prefill.attend_selected picks this path or the masked one (nosa.attention.masked).
Layout as in nosa.layout: q [n, Hq, D]; k, v [L, Hkv, D]; cis [L, Hkv]; sel [n, Hkv, K].
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from nosa.attention.math import compute_dtype
from nosa.attention.paired import attend_pairs
from nosa.config import NosaConfig
from nosa.layout import NEG_INF
from nosa.select import selection_mask

# A group of rows gathers at most about this many (row, KV head, key) entries for the keys its rows
# do not share; a group above it is split in halves (down to single rows). Bounds the gathered
# memory of a group (x head_dim), so it stays in cache between gather and matmul.
REST_TOKENS = 1 << 16
# rows per group (rounded to whole blocks): larger groups share fewer blocks, so each row gathers
# more keys of its own; smaller ones pay the per-group overhead more often (measured on CPU)
ROW_CHUNK_ROWS = 64
# a training call keeps its groups' probabilities and gathered keys for backward up to this many
# elements (then recomputes the rest from the log-sum-exp): memory for about 1.5x less work
SAVE_ELEMENTS = 1 << 25


def default_row_chunk(cfg: NosaConfig) -> int:
    """Rows per chunk of a prefill: the whole blocks nearest ROW_CHUNK_ROWS rows. The groups of
    ``attend_grouped`` and the block unions that ``NosaDecodeState.prefill`` gathers use it."""
    return max(1, round(ROW_CHUNK_ROWS / cfg.block_size)) * cfg.block_size


def chunk_end(position: int, row_chunk: int) -> int:
    """The end (exclusive) of the chunk of positions holding ``position``: chunks are aligned to
    multiples of ``row_chunk`` in absolute position, so a prefill split into pieces (a server's
    chunked prefill) groups its rows as one call over the whole context would."""
    return position // row_chunk * row_chunk + row_chunk


def attend_grouped(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cis: torch.Tensor,
    sel: torch.Tensor,
    positions: torch.Tensor,
    cfg: NosaConfig,
    scale: float,
    row_chunk: int | None = None,
) -> torch.Tensor:
    """Each row attends over its own selected blocks, at or before its position, token j weighted by
    exp(cis_j): the selected-block attention of prefill and training (one call for all sparse rows).

    q [n, Hq, D]; k/v [L, Hkv, D]; cis [L, Hkv]; sel [n, Hkv, K] (-1 = none); positions [n]
    ascending, < L. Returns out [n, Hq, Dv] in q's dtype; differentiable in q, k, v and cis.
    Training: rows go in groups of one chunk of ``row_chunk`` positions (``default_row_chunk``), the
    blocks every row of a group selected gathered once, the others per row, with a written-out
    backward (``_SelectedAttention``). Inference: block by block (nosa.attention.paired.attend_pairs).
    Either way no key a row did not select is computed: the work follows the budget, not the context.
    """
    if row_chunk is None:
        row_chunk = default_row_chunk(cfg)
    training = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, cis))
    if training:
        with torch.no_grad():
            groups = _row_groups(sel, positions, cfg, row_chunk, k.shape[0])
        # outside no_grad: the autograd node must be recorded
        return _SelectedAttention.apply(q, k, v, cis, groups, scale, cfg.block_size, True)
    with torch.no_grad():
        pools = block_pools(k, v, cis, compute_dtype(q), cfg.block_size)
        return attend_pairs(q, pools, sel, positions, cfg.block_size, scale, cfg.window_blocks)[0].to(q.dtype)


def _chunks(positions, row_chunk: int) -> list[tuple[int, int]]:
    """(start, stop) of the rows in each chunk of ``row_chunk`` positions (``chunk_end``)."""
    pos = positions.tolist()
    bounds, start = [], 0
    while start < len(pos):
        stop = start + min(len(pos) - start, chunk_end(pos[start], row_chunk) - pos[start])
        bounds.append((start, stop))
        start = stop
    return bounds


def _shared_blocks(sel, positions, cfg: NosaConfig, length: int):
    """The blocks every row of a group selected, and each row's others.

    sel [n, Hkv, K] (-1 = none), positions [n] of one group. Returns (shared, own): shared =
    (pool rows [Hkv, S] long of ``block_pools`` for L = ``length`` tokens, allowed [n, Hkv, S * B]
    bool: whether each row may see each of their tokens, causality inside the current block and
    padding entries); own [n, Hkv, K], the row's other blocks, -1 elsewhere."""
    hkv, device, bsz = sel.shape[1], sel.device, cfg.block_size
    rows_pos = positions[:, None, None]
    row_blocks = selection_mask(sel, cfg.num_blocks(int(positions[-1]) + 1))  # [n, Hkv, NB']
    in_all = row_blocks.all(dim=0)  # [Hkv, NB']
    count = int(in_all.sum(dim=-1).max())
    blocks = torch.sort(in_all.to(torch.int8), dim=-1, descending=True, stable=True).indices[..., :count]
    real = in_all.gather(-1, blocks)  # [Hkv, S]
    offsets = torch.arange(bsz, device=device)
    allowed = (real[..., None] & ((blocks * bsz)[..., None] + offsets <= rows_pos[..., None])).flatten(-2)
    pool_base = (torch.arange(hkv, device=device) * cfg.num_blocks(length))[:, None]
    in_shared = in_all[None].expand(sel.shape[0], -1, -1).gather(-1, sel.clamp(min=0))
    own = torch.where((sel >= 0) & ~in_shared, sel, -1)
    return (blocks + pool_base, allowed), own


def _row_groups(sel, positions, cfg: NosaConfig, row_chunk: int, length: int) -> list:
    """The plan of a training call of ``attend_grouped``: a list of (start, stop, shared, rest), one
    per group of rows.

    Keys are addressed as whole blocks of the block pools of ``block_pools`` (pool row h * NB + b
    holds block b of KV head h, NB blocks of the L tokens). ``shared`` = (rows [Hkv, S] long,
    allowed [n, Hkv, S * B] bool): the blocks every row of the group selected, and whether each
    row may see each of their tokens (causality inside the current block; padding entries).
    ``rest`` = (rows [n * Hkv, R] long, valid [n * Hkv, R * B] bool): each row's other selected
    blocks (R may be 0). Groups are chunks of ``row_chunk`` positions, halved while their ``rest``
    holds more than REST_TOKENS (row, KV head, token) entries."""
    hkv, device, bsz = sel.shape[1], sel.device, cfg.block_size
    pool_base = (torch.arange(hkv, device=device) * cfg.num_blocks(length))[:, None]
    offsets = torch.arange(bsz, device=device)
    groups, todo = [], _chunks(positions, row_chunk)
    while todo:
        start, stop = todo.pop(0)
        n = stop - start
        sel_g = sel[start:stop]
        rows_pos = positions[start:stop, None, None]
        shared, rest_sel = _shared_blocks(sel_g, positions[start:stop], cfg, length)
        width = int((rest_sel >= 0).sum(dim=-1).max())
        if n > 1 and n * hkv * width * bsz > REST_TOKENS:
            mid = (start + stop) // 2
            todo[:0] = [(start, mid), (mid, stop)]
            continue
        rest_sel = rest_sel.sort(dim=-1, descending=True).values[..., :width]  # [n, Hkv, R]
        blocks_r = rest_sel.clamp(min=0)
        valid_r = ((rest_sel >= 0)[..., None] & ((blocks_r * bsz)[..., None] + offsets <= rows_pos[..., None]))
        rest = ((blocks_r + pool_base).flatten(0, 1), valid_r.flatten(-2).flatten(0, 1))
        groups.append((start, stop, shared, rest))
    return groups


# ---- attention of row groups over block pools (k, v, cis head-major, one pool row per block): the
# autograd Function of training and the helpers it shares with the inference path -------------------
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
        pools = block_pools(k, v, cis, dt, block_size)
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
        pools = block_pools(k, v, cis, dt, ctx.block_size)
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


def block_pools(k, v, cis, dt, block_size):
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
