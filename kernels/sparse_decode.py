"""Batched NOSA decode attention over selected blocks of a paged KV pool: Triton kernel + torch reference.

Layout (SGLang's token pool): k_pool, v_pool [N, Hkv, D], cis_pool [N, Hkv] by token slot;
token_table [B, T] int32 (a sequence's positions -> slots, SGLang's req_to_token rows); q [B, Hq, D];
selection [B, Hkv, K] (-1 = none, as nosa.select.select_blocks returns); seq_lens [B] -> [B, Hq, D].
out[b, h] = softmax_j(q[b, h] . k_j * scale + cis_j) v_j over the tokens j < seq_lens[b] of the
selected blocks of KV head h // G: exactly nosa.NosaDecodeState.attend above dense_len
(tests/test_kernels.py). With ``return_lse=True`` also lse [B, Hq] float32 = log sum_j exp(logit_j)
(-inf, out 0, when no token is valid), as nosa.kernels.slot_decode. One program per (sequence, KV
head), an online softmax over the K blocks; on CPU only under TRITON_INTERPRET=1 (tests).
"""

from __future__ import annotations

import functools

import torch

from nosa.layout import NEG_INF, gather_heads, selected_tokens


def sparse_decode_reference(q, k_pool, v_pool, cis_pool, token_table, selection, seq_lens, block_size, scale,
                            return_lse: bool = False):
    """Pure-torch spec of the kernel (fp32 math). Shapes as in the module docstring."""
    bsz, hq, d = q.shape
    hkv = selection.shape[1]
    group = hq // hkv
    tokens, valid = selected_tokens(selection, seq_lens.long(), block_size)  # [B, Hkv, K*B]
    out = torch.empty(bsz, hq, v_pool.shape[-1], dtype=q.dtype, device=q.device)
    lse = torch.empty(bsz, hq, dtype=torch.float32, device=q.device)
    for b in range(bsz):
        slots = token_table[b, tokens[b]].long()  # [Hkv, K*B]
        k = gather_heads(k_pool, slots).float()
        v = gather_heads(v_pool, slots).float()
        bias = gather_heads(cis_pool, slots).float().masked_fill(~valid[b], NEG_INF)
        qg = q[b].float().reshape(hkv, group, d)
        logits = torch.einsum("hgd,htd->hgt", qg, k) * scale + bias[:, None, :]
        row_lse = torch.logsumexp(logits, -1)  # [Hkv, G]
        p = torch.exp(logits - torch.where(torch.isfinite(row_lse), row_lse, 0.0)[..., None])
        out[b] = torch.einsum("hgt,htd->hgd", p, v).reshape(hq, -1).to(q.dtype)
        lse[b] = row_lse.reshape(hq)
    return (out, lse) if return_lse else out


def sparse_decode(q, k_pool, v_pool, cis_pool, token_table, selection, seq_lens, block_size, scale,
                  return_lse: bool = False):
    """Triton kernel launch (CUDA tensors, or CPU tensors under TRITON_INTERPRET=1)."""
    grid, args, consts = sparse_decode_plan(q, k_pool, v_pool, cis_pool, token_table, selection, seq_lens,
                                            block_size, scale)
    kernels()["decode"][grid](*args, **consts)
    out, lse = args[7], args[8]
    return (out, lse) if return_lse else out


def sparse_decode_plan(q, k_pool, v_pool, cis_pool, token_table, selection, seq_lens, block_size, scale):
    """(grid, args, constexprs) of the launch, shared with the ahead-of-time compile test."""
    import triton  # optional: triton (CUDA, or TRITON_INTERPRET=1 for tests)

    from nosa.kernels.tile import exact_products  # optional: triton (via tile)

    bsz, hq, d = q.shape
    hkv, topk = selection.shape[1], selection.shape[2]
    if hq % hkv:
        raise ValueError(f"sparse_decode: Hq={hq} is not a multiple of Hkv={hkv}")
    if k_pool.shape[1:] != (hkv, d) or v_pool.shape[:2] != k_pool.shape[:2] or cis_pool.shape != k_pool.shape[:2]:
        raise ValueError(
            f"sparse_decode: pools disagree: k {tuple(k_pool.shape)}, v {tuple(v_pool.shape)}, "
            f"cis {tuple(cis_pool.shape)} for Hkv={hkv}, D={d}"
        )
    if block_size & (block_size - 1):
        raise ValueError(f"sparse_decode: block_size={block_size} must be a power of two")
    for name, t in (("k_pool", k_pool), ("v_pool", v_pool), ("q", q), ("token_table", token_table),
                    ("selection", selection)):
        if t.stride(-1) != 1:
            raise ValueError(f"sparse_decode: {name} must be contiguous in its last dimension")
    if k_pool.dtype != q.dtype or v_pool.dtype != q.dtype:
        raise ValueError(f"sparse_decode: q, k_pool, v_pool dtypes differ: {q.dtype}, {k_pool.dtype}, {v_pool.dtype}")
    out = torch.empty(bsz, hq, v_pool.shape[-1], dtype=q.dtype, device=q.device)
    lse = torch.empty(bsz, hq, dtype=torch.float32, device=q.device)
    group = hq // hkv
    args = [q, k_pool, v_pool, cis_pool, token_table, selection, seq_lens, out, lse,
            q.stride(0), q.stride(1), k_pool.stride(0), k_pool.stride(1), v_pool.stride(0), v_pool.stride(1),
            cis_pool.stride(0), cis_pool.stride(1), token_table.stride(0),
            selection.stride(0), selection.stride(1), out.stride(0), out.stride(1), lse.stride(0),
            scale]
    consts = dict(TOPK=topk, BLOCK=block_size, GROUP=group, GROUP_P=max(16, triton.next_power_of_2(group)),
                  HEAD_DIM=d, HEAD_DIM_P=max(16, triton.next_power_of_2(d)),
                  IEEE=exact_products(q.dtype))
    return (bsz, hkv), args, consts


@functools.cache
def kernels() -> dict:
    """{"decode"}: the @triton.jit kernel, built on first use (importing needs no triton)."""
    # module globals, not closure names: under TRITON_INTERPRET=1 a kernel's names resolve in its module
    global dot, softmax_result, softmax_step
    import triton  # optional: triton (CUDA, or TRITON_INTERPRET=1 for tests)
    import triton.language as tl  # optional: triton

    from nosa.kernels.tile import dot, softmax_result, softmax_step  # optional: triton (via tile)

    @triton.jit
    def decode_kernel(Q, K, V, CIS, TOK, SEL, LENS, OUT, LSE,
                      sqb, sqh, skn, skh, svn, svh, scn, sch, stb, ssb, ssh, sob, soh, slb,
                      scale,
                      TOPK: tl.constexpr, BLOCK: tl.constexpr, GROUP: tl.constexpr, GROUP_P: tl.constexpr,
                      HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr, IEEE: tl.constexpr):
        b = tl.program_id(0)
        h = tl.program_id(1)
        length = tl.load(LENS + b)
        g = tl.arange(0, GROUP_P)
        d = tl.arange(0, HEAD_DIM_P)
        t = tl.arange(0, BLOCK)
        g_ok = g < GROUP
        d_ok = d < HEAD_DIM
        q = tl.load(Q + b * sqb + (h * GROUP + g)[:, None] * sqh + d[None, :],
                    mask=g_ok[:, None] & d_ok[None, :], other=0.0)
        m = tl.full([GROUP_P], float("-inf"), tl.float32)
        denom = tl.zeros([GROUP_P], tl.float32)
        acc = tl.zeros([GROUP_P, HEAD_DIM_P], tl.float32)
        for i in range(TOPK):
            blk = tl.load(SEL + b * ssb + h * ssh + i).to(tl.int64)
            pos = blk * BLOCK + t
            ok = (blk >= 0) & (pos < length)
            slot = tl.load(TOK + b * stb + pos, mask=ok, other=0).to(tl.int64)
            k = tl.load(K + slot[:, None] * skn + h * skh + d[None, :], mask=ok[:, None] & d_ok[None, :], other=0.0)
            v = tl.load(V + slot[:, None] * svn + h * svh + d[None, :], mask=ok[:, None] & d_ok[None, :], other=0.0)
            c = tl.load(CIS + slot * scn + h * sch, mask=ok, other=0.0).to(tl.float32)
            s = dot(q, tl.trans(k), IEEE) * scale + c[None, :]  # [GROUP_P, BLOCK]
            s = tl.where(ok[None, :], s, float("-inf"))
            m, denom, acc = softmax_step(s, v, m, denom, acc, IEEE)
        out, lse = softmax_result(m, denom, acc)
        tl.store(OUT + b * sob + (h * GROUP + g)[:, None] * soh + d[None, :], out.to(OUT.dtype.element_ty),
                 mask=g_ok[:, None] & d_ok[None, :])
        tl.store(LSE + b * slb + h * GROUP + g, lse, mask=g_ok)

    return {"decode": decode_kernel}
