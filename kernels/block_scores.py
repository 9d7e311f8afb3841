"""Query-aware block scores of the NOSA selection, fused: Triton kernel; the spec is nosa.select.

Computes exactly ``nosa.select.query_block_scores`` (the one selection implementation, which stays
the reference and the CPU path): per query row r and KV head h, the softmax of the scaled
q . compressed-key logits over the windows visible to the row (window j covers tokens
[s*j, s*j + c) and is visible when s*j + c <= positions[r] + 1), summed over the G query heads of
the group, then max-pooled onto blocks (block b takes the max over the windows overlapping it;
-inf where none is visible). Shapes: q [R, Hq, D]; compressed_k [C, Hkv, D]; positions [R]
-> [R, Hkv, NB] float32. The top-k that follows stays in nosa.select. Why a kernel: the torch path
materialises [rows, Hkv, G, C] logits; one program per (row, KV head) keeps them in registers.
"""

from __future__ import annotations

import functools

import torch


def block_scores_plan(q, compressed_k, positions, num_blocks: int, block_size: int, compress_kernel: int,
                      compress_stride: int, scale: float):
    """(grid, args, constexprs, out) of the launch (shared with the ahead-of-time compile test)."""
    import triton  # optional: triton (CUDA, or TRITON_INTERPRET=1 for tests)

    rows, hq, d = q.shape
    windows, hkv, _ = compressed_k.shape
    if compressed_k.shape[2] != d or hq % hkv:
        raise ValueError(f"block_scores: q {tuple(q.shape)} and compressed_k {tuple(compressed_k.shape)} disagree "
                         "(expected [R, Hq, D] and [C, Hkv, D] with Hq a multiple of Hkv)")
    if positions.shape != (rows,):
        raise ValueError(f"block_scores: positions must be [R={rows}], got {tuple(positions.shape)}")
    if block_size % compress_stride or compress_kernel % compress_stride:
        raise ValueError(f"block_scores: block_size={block_size} and compress_kernel={compress_kernel} must be "
                         f"multiples of compress_stride={compress_stride} (NosaConfig's rule)")
    for name, t in (("q", q), ("compressed_k", compressed_k)):
        if t.stride(-1) != 1:
            raise ValueError(f"block_scores: {name} must be contiguous in its last dimension, strides {t.stride()}")
    positions = positions.to(torch.int32).contiguous()
    out = torch.empty(rows, hkv, num_blocks, dtype=torch.float32, device=q.device)
    ratio, before = block_size // compress_stride, (compress_kernel - 1) // compress_stride
    width = before + (block_size - 1) // compress_stride + 1  # windows overlapping one block
    p2 = triton.next_power_of_2
    group = hq // hkv
    consts = dict(GROUP=group, GROUP_P=max(16, p2(group)), HEAD_DIM=d, HEAD_DIM_P=max(16, p2(d)),
                  WIN_TILE=64, BLK_TILE=16, WIDTH=width, WIDTH_P=p2(width), RATIO=ratio, BEFORE=before,
                  KERNEL=compress_kernel, STRIDE=compress_stride)
    args = [q, compressed_k, positions, out, q.stride(0), q.stride(1), compressed_k.stride(0),
            compressed_k.stride(1), out.stride(0), out.stride(1), windows, num_blocks, scale]
    return (rows, hkv), args, consts, out


def query_block_scores_triton(q, compressed_k, positions, num_blocks: int, cfg, scale: float) -> torch.Tensor:
    """Triton version of ``nosa.select.query_block_scores`` (same arguments, same result)."""
    grid, args, consts, out = block_scores_plan(q, compressed_k, positions, num_blocks, cfg.block_size,
                                                cfg.compress_kernel, cfg.compress_stride, scale)
    if out.numel():
        kernels()["scores"][grid](*args, **consts, num_warps=4)
    return out


@functools.cache
def kernels() -> dict:
    """{"scores"}: the @triton.jit kernel, built on first use (importing needs no triton)."""
    import triton  # optional: triton (CUDA, or TRITON_INTERPRET=1 for tests)
    import triton.language as tl  # optional: triton

    @triton.jit
    def scores_kernel(Q, CK, POS, OUT, sqr, sqh, sck, sch, sor, soh, C, NB, scale,
                      GROUP: tl.constexpr, GROUP_P: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr,
                      WIN_TILE: tl.constexpr, BLK_TILE: tl.constexpr, WIDTH: tl.constexpr, WIDTH_P: tl.constexpr,
                      RATIO: tl.constexpr, BEFORE: tl.constexpr, KERNEL: tl.constexpr, STRIDE: tl.constexpr):
        r = tl.program_id(0)
        h = tl.program_id(1)
        g = tl.arange(0, GROUP_P)
        d = tl.arange(0, HEAD_DIM_P)
        g_ok = g < GROUP
        d_ok = d < HEAD_DIM
        q = tl.load(Q + r * sqr + (h * GROUP + g)[:, None] * sqh + d[None, :], mask=g_ok[:, None] & d_ok[None, :],
                    other=0.0).to(tl.float32)
        pos = tl.load(POS + r)
        # windows 0 .. visible-1 end at or before the row (Triton's // truncates: no negative operand)
        visible = tl.minimum(tl.where(pos + 1 >= KERNEL, (pos + 1 - KERNEL) // STRIDE + 1, 0), C)
        # pass 1: softmax max and denominator of each query head over the visible windows
        m = tl.full([GROUP_P], float("-inf"), tl.float32)
        denom = tl.zeros([GROUP_P], tl.float32)
        w = tl.arange(0, WIN_TILE)
        for w0 in range(0, visible, WIN_TILE):
            win = w0 + w
            ok = win < visible
            ck = tl.load(CK + win.to(tl.int64)[:, None] * sck + h * sch + d[None, :], mask=ok[:, None] & d_ok[None, :],
                         other=0.0).to(tl.float32)
            # fp32 products as the spec computes them (tf32 would perturb the block ranking)
            s = tl.dot(q, tl.trans(ck), input_precision="ieee") * scale
            s = tl.where(ok[None, :], s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            denom = denom * tl.exp(m - m_safe) + tl.sum(tl.exp(s - m_safe[:, None]), 1)
            m = m_new
        m_safe = tl.where(m == float("-inf"), 0.0, m)
        inv = tl.where(g_ok & (denom > 0), 1.0 / tl.where(denom > 0, denom, 1.0), 0.0)
        # pass 2: per block, the windows r*b - p .. r*b - p + WIDTH - 1, as a [BLK_TILE, WIDTH_P] grid
        bi = tl.arange(0, BLK_TILE * WIDTH_P)
        blk_of = bi // WIDTH_P
        slot = bi % WIDTH_P
        bt = tl.arange(0, BLK_TILE)
        for b0 in range(0, NB, BLK_TILE):
            win = (b0 + blk_of) * RATIO - BEFORE + slot
            ok = (slot < WIDTH) & (win >= 0) & (win < visible)
            ck = tl.load(CK + tl.where(ok, win, 0).to(tl.int64)[:, None] * sck + h * sch + d[None, :],
                         mask=ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
            s = tl.dot(q, tl.trans(ck), input_precision="ieee") * scale
            p = tl.exp(s - m_safe[:, None]) * inv[:, None]  # [GROUP_P, BLK_TILE * WIDTH_P]
            score = tl.where(ok, tl.sum(p, 0), float("-inf"))  # group sum; invisible windows never count
            pooled = tl.max(tl.reshape(score, [BLK_TILE, WIDTH_P]), 1)
            b = b0 + bt
            tl.store(OUT + r * sor + h * soh + b, pooled, mask=b < NB)

    return {"scores": scores_kernel}
