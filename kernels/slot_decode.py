"""NOSA decode attention over the device block cache (offloading on): Triton kernel + torch reference.

Layout: the device cache of one layer holds items (one block of one KV head each): k_dev [S, B, D],
v_dev [S, B, Dv], cis_dev [S, B] float32. Each (request, KV head) owns NS slots: slots [R, Hkv, NS]
int64 (-1 = unused), fill [R, Hkv, NS] int32 (valid tokens of the slot's block from its start: B
for a complete block, fewer for the tail block, 0 = skip). q [R, Hq, D], G = Hq // Hkv.

out[r, h] = softmax_j(scale * q[r, h] . k_j + cis_j) v_j over the valid tokens j of the slots of
KV head h // G (slot order is irrelevant); lse[r, h] = log sum_j exp(logit_j) in fp32, -inf (and
out = 0) when no token is valid, so results over disjoint slot sets merge exactly. One program
per (request, KV head, split); with several splits a second kernel merges them by their lse.
"""

from __future__ import annotations

import functools

import torch

from nosa.layout import NEG_INF

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def check_inputs(q, k_dev, v_dev, cis_dev, slots, fill) -> None:
    """ValueError naming the argument whose shape or dtype breaks the layout above (the FlashInfer
    path, nosa.kernels.flashinfer_decode, takes the same inputs and checks them here too)."""
    if q.dim() != 3 or k_dev.dim() != 3 or v_dev.dim() != 3 or cis_dev.dim() != 2:
        raise ValueError(f"slot_decode: expected q [R, Hq, D], k_dev/v_dev [S, B, D], cis_dev [S, B]; got q "
                         f"{tuple(q.shape)}, k_dev {tuple(k_dev.shape)}, v_dev {tuple(v_dev.shape)}, "
                         f"cis_dev {tuple(cis_dev.shape)}")
    rows, hq, d = q.shape
    if slots.dim() != 3 or slots.shape[0] != rows or fill.shape != slots.shape:
        raise ValueError(f"slot_decode: slots {tuple(slots.shape)} and fill {tuple(fill.shape)} must both be "
                         f"[R={rows}, Hkv, NS]")
    if slots.dtype != torch.int64 or fill.dtype != torch.int32:
        raise ValueError(f"slot_decode: slots must be int64 and fill int32, got {slots.dtype} and {fill.dtype}")
    hkv = slots.shape[1]
    if hq % hkv:
        raise ValueError(f"slot_decode: Hq={hq} is not a multiple of Hkv={hkv}")
    if k_dev.shape[2] != d or v_dev.shape[:2] != k_dev.shape[:2] or cis_dev.shape != k_dev.shape[:2]:
        raise ValueError(f"slot_decode: caches disagree: k_dev {tuple(k_dev.shape)}, v_dev {tuple(v_dev.shape)}, "
                         f"cis_dev {tuple(cis_dev.shape)} for D={d}")
    if q.dtype not in _FLOATS or k_dev.dtype != q.dtype or v_dev.dtype != q.dtype:
        raise ValueError(f"slot_decode: q, k_dev, v_dev must share one of {_FLOATS}, got {q.dtype}, "
                         f"{k_dev.dtype}, {v_dev.dtype}")
    if cis_dev.dtype != torch.float32:
        raise ValueError(f"slot_decode: cis_dev must be float32, got {cis_dev.dtype}")


def slot_decode_reference(q, k_dev, v_dev, cis_dev, slots, fill, scale: float):
    """Pure-torch spec (fp32 math, or fp64 for fp64 inputs). Shapes as in the module docstring.
    Returns (out [R, Hq, Dv] in q.dtype, lse [R, Hq] float32). Also the CPU decode path: one
    request at a time, so its gathered K/V stay in cache."""
    if q.dtype != torch.float64:
        check_inputs(q, k_dev, v_dev, cis_dev, slots, fill)
    rows, hq, d = q.shape
    hkv, ns = slots.shape[1:]
    block, dv = k_dev.shape[1], v_dev.shape[2]
    dt = torch.promote_types(q.dtype, torch.float32)
    valid = (slots[..., None] >= 0) & (torch.arange(block, device=q.device) < fill[..., None])  # [R, Hkv, NS, B]
    index = slots.clamp(min=0)
    outs, lses = [], []
    for i in range(rows):
        items = index[i].flatten()
        k = k_dev.index_select(0, items).to(dt).view(hkv, ns * block, d)
        v = v_dev.index_select(0, items).to(dt).view(hkv, ns * block, dv)
        c = cis_dev.index_select(0, items).to(dt).view(hkv, ns * block)
        bias = torch.where(valid[i].view(hkv, ns * block), c, NEG_INF)
        qg = q[i].to(dt).view(hkv, hq // hkv, d)
        logits = torch.baddbmm(bias[:, None, :], qg, k.transpose(1, 2), alpha=scale)  # [Hkv, G, T]
        top = logits.amax(dim=-1, keepdim=True)
        top = torch.where(torch.isfinite(top), top, 0.0)
        p = torch.exp_(logits.sub_(top))  # in place: one pass over the logits; 0 where nothing is valid
        total = p.sum(dim=-1, keepdim=True)
        safe = torch.where(total > 0, total, 1.0)
        outs.append((torch.bmm(p, v) / safe).view(hq, dv))
        lses.append(torch.where(total > 0, top + torch.log(safe), NEG_INF).view(hq))
    return torch.stack(outs).to(q.dtype), torch.stack(lses).float()


def default_splits(rows: int, hkv: int, ns: int) -> int:
    """Splits over slots so that about 256 programs run (an H100/H200 has 132 SMs), each with at
    least 8 slots (fewer make the merge pass cost more than it saves)."""
    return max(1, min(-(-256 // (rows * hkv)), ns // 8))


def slot_decode_plan(q, k_dev, v_dev, cis_dev, slots, fill, scale: float, num_splits: int | None = None):
    """(launches, out, lse): the kernel launches as (kernel name, grid, args, constexprs), shared by
    the launcher and the ahead-of-time compile test."""
    import triton  # optional: triton (CUDA, or TRITON_INTERPRET=1 for tests)

    from nosa.kernels.tile import exact_products  # optional: triton (via tile)

    check_inputs(q, k_dev, v_dev, cis_dev, slots, fill)
    for name, t in (("q", q), ("k_dev", k_dev), ("v_dev", v_dev), ("cis_dev", cis_dev), ("slots", slots),
                    ("fill", fill)):
        if t.stride(-1) != 1:
            raise ValueError(f"slot_decode: {name} must be contiguous in its last dimension, strides {t.stride()}")
    if k_dev.stride(1) != k_dev.shape[2] or v_dev.stride(1) != v_dev.shape[2]:
        raise ValueError("slot_decode: each k_dev / v_dev item must be contiguous [B, D]")
    rows, hq, d = q.shape
    hkv, ns = slots.shape[1:]
    block, dv = k_dev.shape[1], v_dev.shape[2]
    group = hq // hkv
    splits = default_splits(rows, hkv, ns) if num_splits is None else num_splits
    if splits < 1:
        raise ValueError(f"slot_decode: num_splits must be >= 1, got {splits}")
    per_split = -(-ns // splits)
    splits = -(-ns // per_split)
    out = torch.empty(rows, hq, dv, dtype=q.dtype, device=q.device)
    lse = torch.empty(rows, hq, dtype=torch.float32, device=q.device)
    if splits == 1:
        part_out, part_lse, sos, sls = out, lse, 0, 0
    else:
        part_out = torch.empty(rows, hq, splits, dv, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(rows, hq, splits, dtype=torch.float32, device=q.device)
        sos, sls = part_out.stride(2), part_lse.stride(2)
    p2 = triton.next_power_of_2
    consts = dict(BLOCK=block, BLOCK_P=max(16, p2(block)), GROUP=group, GROUP_P=max(16, p2(group)),
                  HEAD_DIM=d, HEAD_DIM_P=max(16, p2(d)), DV=dv, DV_P=max(16, p2(dv)),
                  IEEE=exact_products(q.dtype))
    args = [q, k_dev, v_dev, cis_dev, slots, fill, part_out, part_lse,
            q.stride(0), q.stride(1), k_dev.stride(0), k_dev.stride(1), v_dev.stride(0), v_dev.stride(1),
            cis_dev.stride(0), slots.stride(0), slots.stride(1), fill.stride(0), fill.stride(1),
            part_out.stride(0), part_out.stride(1), sos, part_lse.stride(0), part_lse.stride(1), sls,
            scale, ns, per_split]
    launches = [("split", (rows, hkv, splits), args, consts)]
    if splits > 1:
        margs = [part_out, part_lse, out, lse, part_out.stride(0), part_out.stride(1), part_out.stride(2),
                 part_lse.stride(0), part_lse.stride(1), out.stride(0), out.stride(1), lse.stride(0)]
        launches.append(("merge", (rows, hq), margs, dict(SPLITS=splits, SPLITS_P=p2(splits), DV=dv,
                                                          DV_P=max(16, p2(dv)))))
    return launches, out, lse


def slot_decode(q, k_dev, v_dev, cis_dev, slots, fill, scale: float, num_splits: int | None = None):
    """Triton launch (CUDA tensors, or CPU tensors under TRITON_INTERPRET=1): (out, lse) as the reference."""
    launches, out, lse = slot_decode_plan(q, k_dev, v_dev, cis_dev, slots, fill, scale, num_splits)
    for name, grid, args, consts in launches:
        kernels()[name][grid](*args, **consts, num_warps=4)
    return out, lse


@functools.cache
def kernels() -> dict:
    """{"split", "merge"}: the @triton.jit kernels, built on first use (importing needs no triton)."""
    # module globals, not closure names: under TRITON_INTERPRET=1 a kernel's names resolve in its module
    global dot, softmax_result, softmax_step
    import triton  # optional: triton (CUDA, or TRITON_INTERPRET=1 for tests)
    import triton.language as tl  # optional: triton

    from nosa.kernels.tile import dot, softmax_result, softmax_step  # optional: triton (via tile)

    @triton.jit
    def split_kernel(Q, K, V, CIS, SLOTS, FILL, OUT, LSE,
                     sqr, sqh, skn, skt, svn, svt, scn, ssr, ssh, sfr, sfh, sor, soh, sos, slr, slh, sls,
                     scale, NS, PER_SPLIT,
                     BLOCK: tl.constexpr, BLOCK_P: tl.constexpr, GROUP: tl.constexpr, GROUP_P: tl.constexpr,
                     HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr, DV: tl.constexpr, DV_P: tl.constexpr,
                     IEEE: tl.constexpr):
        r = tl.program_id(0)
        h = tl.program_id(1)
        sp = tl.program_id(2)
        g = tl.arange(0, GROUP_P)
        d = tl.arange(0, HEAD_DIM_P)
        e = tl.arange(0, DV_P)
        t = tl.arange(0, BLOCK_P)
        g_ok = g < GROUP
        d_ok = d < HEAD_DIM
        e_ok = e < DV
        q = tl.load(Q + r * sqr + (h * GROUP + g)[:, None] * sqh + d[None, :], mask=g_ok[:, None] & d_ok[None, :],
                    other=0.0)
        m = tl.full([GROUP_P], float("-inf"), tl.float32)
        denom = tl.zeros([GROUP_P], tl.float32)
        acc = tl.zeros([GROUP_P, DV_P], tl.float32)
        lo = sp * PER_SPLIT
        hi = tl.minimum(lo + PER_SPLIT, NS)
        for i in range(lo, hi):
            slot = tl.load(SLOTS + r * ssr + h * ssh + i)
            n = tl.load(FILL + r * sfr + h * sfh + i)
            ok = (t < n) & (t < BLOCK) & (slot >= 0)
            slot = tl.where(slot >= 0, slot, 0).to(tl.int64)
            k = tl.load(K + slot * skn + t[:, None] * skt + d[None, :], mask=ok[:, None] & d_ok[None, :], other=0.0)
            v = tl.load(V + slot * svn + t[:, None] * svt + e[None, :], mask=ok[:, None] & e_ok[None, :], other=0.0)
            c = tl.load(CIS + slot * scn + t, mask=ok, other=0.0)
            s = dot(q, tl.trans(k), IEEE)
            s = tl.where(ok[None, :], s * scale + c[None, :], float("-inf"))  # [GROUP_P, BLOCK_P]
            m, denom, acc = softmax_step(s, v, m, denom, acc, IEEE)
        out, lse = softmax_result(m, denom, acc)
        heads = h * GROUP + g
        tl.store(OUT + r * sor + heads[:, None] * soh + sp * sos + e[None, :], out.to(OUT.dtype.element_ty),
                 mask=g_ok[:, None] & e_ok[None, :])
        tl.store(LSE + r * slr + heads * slh + sp * sls, lse, mask=g_ok)

    @triton.jit
    def merge_kernel(PO, PL, OUT, LSE, spr, sph, sps, slr, slh, sor, soh, sr,
                     SPLITS: tl.constexpr, SPLITS_P: tl.constexpr, DV: tl.constexpr, DV_P: tl.constexpr):
        r = tl.program_id(0)
        h = tl.program_id(1)
        s = tl.arange(0, SPLITS_P)
        e = tl.arange(0, DV_P)
        s_ok = s < SPLITS
        lse = tl.load(PL + r * slr + h * slh + s, mask=s_ok, other=float("-inf"))
        top = tl.max(lse, 0)
        top_safe = tl.where(top == float("-inf"), 0.0, top)
        w = tl.exp(lse - top_safe)  # 0 for empty splits
        total = tl.sum(w, 0)
        po = tl.load(PO + r * spr + h * sph + s[:, None] * sps + e[None, :], mask=s_ok[:, None] & (e < DV)[None, :],
                     other=0.0)
        safe = tl.where(total > 0, total, 1.0)  # all splits empty: out 0, lse -inf
        out = tl.sum(w[:, None] * po, 0) / safe
        tl.store(OUT + r * sor + h * soh + e, out.to(OUT.dtype.element_ty), mask=e < DV)
        tl.store(LSE + r * sr + h, tl.where(total > 0, top_safe + tl.log(safe), float("-inf")))

    return {"split": split_kernel, "merge": merge_kernel}
