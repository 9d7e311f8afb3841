"""NOSA block-sparse prefill attention, forward and backward: Triton kernels + torch reference.

Layout (one sequence, token-major as nosa.layout): q [n, Hq, D]; k [L, Hkv, D], v [L, Hkv, Dv];
cis [L, Hkv]; sel [n, Hkv, K] selected block ids of each query row (-1 = none, as
nosa.select.select_blocks returns); positions [n] (token position of each row). G = Hq // Hkv.

out[i, h] = softmax_j(scale * q[i, h] . k_j + cis_j) v_j over the tokens j <= positions[i] of the
blocks sel[i, h // G] (causal inside the current block); lse[i, h] = log sum_j exp(logit_j) (fp32;
-inf and out = 0 for a row with nothing to attend). This is nosa.attention.prefill.attend_selected's
selected-block attention (the rows past dense_len); tests/test_kernels_prefill.py checks both.
Kernels: one program per (tile of TQ query rows, KV head) over the union of the tile's blocks;
the backward recomputes probabilities from lse, with no per-step atomics (``block_work``).
Launch options (num_warps, num_stages) per kernel: ``LAUNCH``, overridable per call (``launch``;
scripts/tune_sparse_prefill.py sweeps them).
"""

from __future__ import annotations

import functools

import torch

from nosa.layout import NEG_INF, selected_tokens

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def _check(q, k, v, cis, sel, positions):
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3 or cis.dim() != 2 or sel.dim() != 3 or positions.dim() != 1:
        raise ValueError(f"sparse_prefill: expected q [n, Hq, D], k/v [L, Hkv, D], cis [L, Hkv], sel [n, Hkv, K], "
                         f"positions [n]; got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}, "
                         f"{tuple(cis.shape)}, {tuple(sel.shape)}, {tuple(positions.shape)}")
    n, hq, d = q.shape
    length, hkv, _ = k.shape
    if hq % hkv:
        raise ValueError(f"sparse_prefill: Hq={hq} is not a multiple of Hkv={hkv}")
    if k.shape[2] != d or v.shape[:2] != k.shape[:2] or cis.shape != k.shape[:2]:
        raise ValueError(f"sparse_prefill: k {tuple(k.shape)}, v {tuple(v.shape)}, cis {tuple(cis.shape)} disagree "
                         f"(expected [L, Hkv={hkv}, D={d}] and [L, Hkv])")
    if sel.shape[:2] != (n, hkv) or positions.shape[0] != n:
        raise ValueError(f"sparse_prefill: sel {tuple(sel.shape)} must be [n={n}, Hkv={hkv}, K] and positions "
                         f"{tuple(positions.shape)} [n={n}]")
    if sel.dtype not in (torch.int32, torch.int64) or positions.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"sparse_prefill: sel and positions must be integers, got {sel.dtype}, {positions.dtype}")


def sparse_prefill_reference(q, k, v, cis, sel, positions, block_size: int, scale: float):
    """Pure-torch spec, differentiable in q, k, v, cis (fp32 math, fp64 for fp64 inputs).
    Shapes as in the module docstring. Returns (out [n, Hq, Dv] in q.dtype, lse [n, Hq] fp32 or fp64)."""
    _check(q, k, v, cis, sel, positions)
    n, hq, d = q.shape
    hkv, dv = k.shape[1], v.shape[2]
    dt = torch.promote_types(q.dtype, torch.float32)
    tokens, valid = selected_tokens(sel.long(), positions.long() + 1, block_size)  # [n, Hkv, T]
    rows = (tokens * hkv + torch.arange(hkv, device=q.device)[:, None]).flatten()
    kk = k.reshape(-1, d).index_select(0, rows).to(dt).view(n, hkv, -1, d)
    vv = v.reshape(-1, dv).index_select(0, rows).to(dt).view(n, hkv, -1, dv)
    bias = torch.where(valid, cis.reshape(-1).index_select(0, rows).to(dt).view_as(valid), NEG_INF)
    qg = q.to(dt).view(n, hkv, hq // hkv, d)
    logits = torch.einsum("nhgd,nhtd->nhgt", qg, kk) * scale + bias[:, :, None, :]
    top = logits.detach().amax(dim=-1, keepdim=True)
    top = torch.where(torch.isfinite(top), top, 0.0)
    p = torch.exp(logits - top)
    total = p.sum(dim=-1, keepdim=True)
    has = total > 0
    safe = torch.where(has, total, 1.0)  # rows with nothing to attend: out 0, lse -inf, finite gradients
    out = torch.einsum("nhgt,nhtd->nhgd", p / safe, vv).reshape(n, hq, dv)
    lse = torch.where(has, top + torch.log(safe), NEG_INF).reshape(n, hq)
    return out.to(q.dtype), lse  # lse in fp32 (fp64 for fp64 inputs, so gradcheck sees no rounding)


# ---- Triton -----------------------------------------------------------------------------------------
def default_tile(group: int) -> int:
    """The largest tile: TQ * G about 64 matrix rows (G = 4 -> 16 tokens)."""
    return max(1, 64 // group)


def tile_candidates(group: int) -> list[int]:
    """The tiles ``choose_tile`` weighs, largest first: ``default_tile`` and its halves down to 16
    matrix rows (TQ * G; G = 4 -> [16, 8, 4])."""
    tiles = [default_tile(group)]
    while tiles[-1] * group > 16 and tiles[-1] > 1:
        tiles.append(tiles[-1] // 2)
    return tiles


def _tile_mask(sel: torch.Tensor, num_blocks: int, tile: int) -> torch.Tensor:
    """[T, Hkv, NB] bool: the blocks any row of each tile of ``tile`` consecutive rows selected."""
    n, hkv, topk = sel.shape
    tiles = -(-n // tile)
    padded = sel.new_full((tiles * tile, hkv, topk), -1)
    padded[:n] = sel
    index = padded.view(tiles, tile, hkv, topk).permute(0, 2, 1, 3).reshape(tiles, hkv, tile * topk).long()
    mask = torch.zeros(tiles, hkv, num_blocks + 1, dtype=torch.bool, device=sel.device)
    mask.scatter_(-1, torch.where(index >= 0, index, num_blocks), True)
    return mask[..., :num_blocks]


def tile_unions(sel: torch.Tensor, num_blocks: int, tile: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per (tile of ``tile`` consecutive rows, KV head): the blocks any row selected, ascending.
    sel [n, Hkv, K] -> (union [T, Hkv, U] int32 (entries past count are arbitrary), count [T, Hkv] int32)."""
    mask = _tile_mask(sel, num_blocks, tile)
    count = mask.sum(dim=-1)
    width = max(1, int(count.max()) if count.numel() else 1)
    union = torch.sort(mask.to(torch.int8), dim=-1, descending=True, stable=True).indices[..., :width]
    return union.to(torch.int32).contiguous(), count.to(torch.int32).contiguous()


def choose_tile(sel: torch.Tensor, num_blocks: int, group: int) -> int:
    """The tile (query rows per program) with the least work per row: a tile computes every block of
    its union for all of its TQ x G matrix rows (padded to 16), so rows that agree on their blocks
    (sink, window, static picks) want large tiles and rows whose picks differ want small ones.
    Work per row ~ mean union size * padded matrix rows / TQ, tried for the largest tile and its
    halves down to 16 matrix rows; a smaller tile must save 25% of it, as it loads every block of
    its union for fewer rows (more memory traffic per row)."""
    best, best_cost = 1, float("inf")
    for tile in tile_candidates(group):
        rows = max(16, 1 << max(0, tile * group - 1).bit_length())
        cost = float(_tile_mask(sel, num_blocks, tile).sum(dim=-1, dtype=torch.float32).mean()) * rows / tile
        if cost < 0.75 * best_cost:  # a smaller tile reloads each block for fewer rows: worth it only
            best, best_cost = tile, cost  # when it saves a good part of the wasted rows
    return best


def _consts(q, k, v, topk, block_size, tile):
    import triton  # optional: triton (CUDA, or TRITON_INTERPRET=1 for tests)

    from nosa.kernels.tile import exact_products  # optional: triton (via tile)

    p2 = triton.next_power_of_2
    group = q.shape[1] // k.shape[1]
    return dict(BLOCK=block_size, BLOCK_P=max(16, p2(block_size)), GROUP=group, TQ=tile,
                M_P=max(16, p2(tile * group)), TOPK=topk, TOPK_P=max(2, p2(topk)),
                HEAD_DIM=q.shape[2], HEAD_DIM_P=max(16, p2(q.shape[2])), DV=v.shape[2], DV_P=max(16, p2(v.shape[2])),
                IEEE=exact_products(q.dtype))


def _prepare(q, k, v, cis, sel, positions, block_size, tile):
    _check(q, k, v, cis, sel, positions)
    if q.dtype not in _FLOATS or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"sparse_prefill: q, k, v must share one of {_FLOATS}, got {q.dtype}, {k.dtype}, {v.dtype}")
    if block_size < 1:
        raise ValueError(f"sparse_prefill: block_size must be >= 1, got {block_size}")
    for name, t in (("q", q), ("k", k), ("v", v), ("cis", cis)):
        if t.stride(-1) != 1:
            raise ValueError(f"sparse_prefill: {name} must be contiguous in its last dimension, strides {t.stride()}")
    num_blocks = -(-k.shape[0] // block_size)
    sel = sel.to(torch.int32).contiguous()
    if sel.numel() and int(sel.max()) >= num_blocks:
        raise ValueError(f"sparse_prefill: sel holds block {int(sel.max())} but L={k.shape[0]} tokens have "
                         f"{num_blocks} blocks of {block_size}")
    tile = choose_tile(sel, num_blocks, q.shape[1] // k.shape[1]) if tile is None else tile
    union, count = tile_unions(sel, num_blocks, tile)
    return sel, positions.to(torch.int32).contiguous(), union, count, tile


def forward_plan(q, k, v, cis, sel, positions, union, count, block_size, scale, tile):
    """(grid, args, constexprs, out, lse) of the forward launch (shared with the AOT compile test)."""
    n, hq, _ = q.shape
    length, hkv, _ = k.shape
    out = torch.empty(n, hq, v.shape[2], dtype=q.dtype, device=q.device)
    lse = torch.empty(n, hq, dtype=torch.float32, device=q.device)
    args = [q, k, v, cis, sel, positions, union, count, out, lse,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cis.stride(0),
            cis.stride(1), sel.stride(0), sel.stride(1), union.stride(0), union.stride(1),
            out.stride(0), out.stride(1), lse.stride(0), n, length, scale]
    grid = (union.shape[0], hkv)
    return grid, args, _consts(q, k, v, sel.shape[2], block_size, tile), out, lse


CHUNK_TILES = 32  # query tiles per dk/dv program: a block selected by every tile (the sink) is split


def block_work(union, count, num_blocks: int, chunk: int = CHUNK_TILES):
    """Invert the tiles' unions for the key-major pass: which tiles read each (KV head, block).
    Returns (work [W, 4] int32 rows (head, block, start, end) over ``tiles`` [E] int32, tiles listed
    per (head, block) in ascending order, each row covering at most ``chunk`` of them)."""
    tiles, hkv, width = union.shape
    valid = torch.arange(width, device=union.device) < count[..., None].long()  # [T, Hkv, U]
    t_idx, h_idx, u_idx = valid.nonzero(as_tuple=True)  # tile-major, so tiles ascend within a key
    key = h_idx * num_blocks + union[t_idx, h_idx, u_idx].long()
    order = torch.sort(key, stable=True).indices
    key, tile_list = key[order], t_idx[order].to(torch.int32)
    per_key = torch.bincount(key, minlength=hkv * num_blocks)
    first = torch.cumsum(per_key, 0) - per_key
    chunks = -(-per_key // chunk)
    owner = torch.repeat_interleave(torch.arange(hkv * num_blocks, device=union.device), chunks)  # key of each row
    nth = torch.arange(owner.numel(), device=union.device) - (torch.cumsum(chunks, 0) - chunks)[owner]
    lo = first[owner] + nth * chunk
    hi = torch.minimum(lo + chunk, first[owner] + per_key[owner])
    work = torch.stack([owner // num_blocks, owner % num_blocks, lo, hi], 1).to(torch.int32).contiguous()
    return work, tile_list.contiguous()


# Chosen on an H200 by scripts/tune_sparse_prefill.py at the benchmark's 32K shape (results/gpu_h200.json,
# "tune_prefill"): two stages for the forward, one for the backward (whose loads the pipeline only delays),
# four warps everywhere; 1.22x the forward and 1.66x the forward + backward of the earlier 4 / 8 / 8 warps.
LAUNCH = {"forward": {"num_warps": 4, "num_stages": 2}, "dq": {"num_warps": 4, "num_stages": 1},
          "dkdv": {"num_warps": 4, "num_stages": 1}}


def launch_options(name: str, launch: dict | None = None) -> dict:
    """The Triton launch options of kernel ``name`` ("forward", "dq" or "dkdv"): ``LAUNCH[name]``
    updated by ``launch[name]`` (e.g. ``{"dq": {"num_warps": 4, "num_stages": 2}}``; kernels it
    does not name keep their defaults)."""
    launch = launch or {}
    unknown = set(launch) - set(LAUNCH)
    bad = {key for opts in launch.values() for key in opts} - {"num_warps", "num_stages"}
    if unknown or bad:
        raise ValueError(f"sparse_prefill: launch {launch} names unknown kernels {sorted(unknown)} or options "
                         f"{sorted(bad)} (kernels {sorted(LAUNCH)}; options num_warps, num_stages)")
    return {**LAUNCH[name], **launch.get(name, {})}


def backward_plan(q, k, v, cis, sel, positions, union, count, dout, lse, delta, block_size, scale, tile,
                  launch: dict | None = None):
    """Launches of the backward as [(kernel name, grid, args, constexprs, launch options)] and (dq, dk, dv,
    dcis): "dq" walks each tile's union (query-major, no atomics); "dkdv" walks, per (KV head, block),
    the tiles that read the block (key-major), in chunks of CHUNK_TILES tiles whose partial sums go
    into fp32 dk, dv, dcis with one atomic add per element and chunk."""
    n, hq, _ = q.shape
    length, hkv, _ = k.shape
    dq = torch.empty_like(q)
    dk = torch.zeros(k.shape, dtype=torch.float32, device=q.device)
    dv = torch.zeros(v.shape, dtype=torch.float32, device=q.device)
    dcis = torch.zeros(cis.shape, dtype=torch.float32, device=q.device)
    common = [q, k, v, cis, sel, positions, dout, lse, delta,
              q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cis.stride(0),
              cis.stride(1), sel.stride(0), sel.stride(1), dout.stride(0), dout.stride(1), lse.stride(0), n, length,
              scale]
    consts = _consts(q, k, v, sel.shape[2], block_size, tile)
    dq_args = common + [union, count, dq, union.stride(0), union.stride(1)]
    work, tiles = block_work(union, count, -(-length // block_size))
    dkdv_args = common + [work, tiles, dk, dv, dcis, dk.stride(0), dk.stride(1), dv.stride(0), dv.stride(1),
                          dcis.stride(0)]
    launches = [("dq", (union.shape[0], hkv), dq_args, consts, launch_options("dq", launch)),
                ("dkdv", (max(1, work.shape[0]),), dkdv_args + [work.shape[0]], consts, launch_options("dkdv", launch))]
    return launches, (dq, dk, dv, dcis)


class _SparsePrefill(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cis, sel, positions, block_size, scale, tile, launch):
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        ctx.cis_dtype = cis.dtype
        cis = cis.float().contiguous()
        sel, positions, union, count, tile = _prepare(q, k, v, cis, sel, positions, block_size, tile)
        grid, args, consts, out, lse = forward_plan(q, k, v, cis, sel, positions, union, count, block_size, scale,
                                                    tile)
        kernels()["forward"][grid](*args, **consts, **launch_options("forward", launch))
        ctx.save_for_backward(q, k, v, cis, sel, positions, union, count, out, lse)
        ctx.meta = (block_size, scale, tile, launch)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, cis, sel, positions, union, count, out, lse = ctx.saved_tensors
        block_size, scale, tile, launch = ctx.meta
        if dout is None:
            dout = torch.zeros_like(out)
        dout = dout.contiguous()
        # d lse / d logit = p, so an lse gradient only shifts the softmax's delta term
        delta = (dout.float() * out.float()).sum(-1)
        if dlse is not None:
            delta = delta - dlse.float()
        launches, (dq, dk, dv, dcis) = backward_plan(q, k, v, cis, sel, positions, union, count, dout, lse,
                                                     delta.contiguous(), block_size, scale, tile, launch)
        for name, grid, args, consts, options in launches:
            kernels()[name][grid](*args, **consts, **options)
        return dq, dk.to(k.dtype), dv.to(v.dtype), dcis.to(ctx.cis_dtype), None, None, None, None, None, None


def sparse_prefill(q, k, v, cis, sel, positions, block_size: int, scale: float, tile: int | None = None,
                   launch: dict | None = None):
    """Triton forward and backward (autograd): (out [n, Hq, Dv], lse [n, Hq] fp32) as the reference.
    CUDA tensors, or CPU tensors under TRITON_INTERPRET=1. ``tile``: query rows per program
    (default: ``choose_tile``); ``launch``: num_warps / num_stages per kernel over ``LAUNCH``
    (see ``launch_options``)."""
    out, lse = _SparsePrefill.apply(q, k, v, cis, sel, positions, block_size, scale, tile, launch)
    return out, lse


@functools.cache
def kernels() -> dict:
    """{"forward", "dq", "dkdv"}: the @triton.jit kernels, built on first use (importing needs no triton)."""
    # module globals, not closure names: under TRITON_INTERPRET=1 a kernel's names resolve in its module
    global dot, softmax_result, softmax_step, tile_rows
    import triton  # optional: triton (CUDA, or TRITON_INTERPRET=1 for tests)
    import triton.language as tl  # optional: triton

    from nosa.kernels.tile import dot, softmax_result, softmax_step, tile_rows  # optional: triton (via tile)

    @triton.jit
    def forward_kernel(Q, K, V, CIS, SEL, POS, UNION, COUNT, OUT, LSE,
                       sqn, sqh, skl, skh, svl, svh, scl, sch, ssn, ssh, sut, suh, son, soh, sln,
                       N, L, scale,
                       BLOCK: tl.constexpr, BLOCK_P: tl.constexpr, GROUP: tl.constexpr, TQ: tl.constexpr,
                       M_P: tl.constexpr, TOPK: tl.constexpr, TOPK_P: tl.constexpr, HEAD_DIM: tl.constexpr,
                       HEAD_DIM_P: tl.constexpr, DV: tl.constexpr, DV_P: tl.constexpr, IEEE: tl.constexpr):
        tile = tl.program_id(0)
        h = tl.program_id(1)
        row, head, r_ok = tile_rows(tile, h, tl.arange(0, M_P), N, GROUP, TQ)
        d = tl.arange(0, HEAD_DIM_P)
        e = tl.arange(0, DV_P)
        t = tl.arange(0, BLOCK_P)
        kk = tl.arange(0, TOPK_P)
        q = tl.load(Q + row[:, None] * sqn + head[:, None] * sqh + d[None, :],
                    mask=r_ok[:, None] & (d < HEAD_DIM)[None, :], other=0.0)
        pos = tl.load(POS + row, mask=r_ok, other=-1)
        mine = tl.load(SEL + row[:, None] * ssn + h * ssh + kk[None, :], mask=r_ok[:, None] & (kk < TOPK)[None, :],
                       other=-1)  # [M_P, TOPK_P] the blocks each row selected
        m = tl.full([M_P], float("-inf"), tl.float32)
        denom = tl.zeros([M_P], tl.float32)
        acc = tl.zeros([M_P, DV_P], tl.float32)
        count = tl.load(COUNT + tile * tl.num_programs(1) + h)  # count is [T, Hkv] contiguous
        for u in range(0, count):
            blk = tl.load(UNION + tile * sut + h * suh + u)
            member = tl.max((mine == blk).to(tl.int32), 1) > 0
            tok = (blk * BLOCK + t).to(tl.int64)
            t_ok = (t < BLOCK) & (tok < L)
            ok = member[:, None] & (tok[None, :] <= pos[:, None]) & t_ok[None, :]
            k = tl.load(K + tok[:, None] * skl + h * skh + d[None, :], mask=t_ok[:, None] & (d < HEAD_DIM)[None, :],
                        other=0.0)
            v = tl.load(V + tok[:, None] * svl + h * svh + e[None, :], mask=t_ok[:, None] & (e < DV)[None, :],
                        other=0.0)
            c = tl.load(CIS + tok * scl + h * sch, mask=t_ok, other=0.0)
            s = tl.where(ok, dot(q, tl.trans(k), IEEE) * scale + c[None, :], float("-inf"))
            m, denom, acc = softmax_step(s, v, m, denom, acc, IEEE)
        out, lse = softmax_result(m, denom, acc)
        tl.store(OUT + row[:, None] * son + head[:, None] * soh + e[None, :], out.to(OUT.dtype.element_ty),
                 mask=r_ok[:, None] & (e < DV)[None, :])
        tl.store(LSE + row * sln + head, lse, mask=r_ok)

    @triton.jit
    def dq_kernel(Q, K, V, CIS, SEL, POS, DO, LSE, DELTA,
                  sqn, sqh, skl, skh, svl, svh, scl, sch, ssn, ssh, sdn, sdh, sln, N, L, scale,
                  UNION, COUNT, DQ, sut, suh,
                  BLOCK: tl.constexpr, BLOCK_P: tl.constexpr, GROUP: tl.constexpr, TQ: tl.constexpr,
                  M_P: tl.constexpr, TOPK: tl.constexpr, TOPK_P: tl.constexpr, HEAD_DIM: tl.constexpr,
                  HEAD_DIM_P: tl.constexpr, DV: tl.constexpr, DV_P: tl.constexpr, IEEE: tl.constexpr):
        tile = tl.program_id(0)
        h = tl.program_id(1)
        row, head, r_ok = tile_rows(tile, h, tl.arange(0, M_P), N, GROUP, TQ)
        d = tl.arange(0, HEAD_DIM_P)
        e = tl.arange(0, DV_P)
        t = tl.arange(0, BLOCK_P)
        kk = tl.arange(0, TOPK_P)
        d_ok = d < HEAD_DIM
        e_ok = e < DV
        q = tl.load(Q + row[:, None] * sqn + head[:, None] * sqh + d[None, :], mask=r_ok[:, None] & d_ok[None, :],
                    other=0.0)
        do = tl.load(DO + row[:, None] * sdn + head[:, None] * sdh + e[None, :], mask=r_ok[:, None] & e_ok[None, :],
                     other=0.0)
        lse = tl.load(LSE + row * sln + head, mask=r_ok, other=float("-inf"))
        lse = tl.where(lse == float("-inf"), 0.0, lse)  # such rows have no valid key: p stays 0
        delta = tl.load(DELTA + row * sln + head, mask=r_ok, other=0.0)
        pos = tl.load(POS + row, mask=r_ok, other=-1)
        mine = tl.load(SEL + row[:, None] * ssn + h * ssh + kk[None, :], mask=r_ok[:, None] & (kk < TOPK)[None, :],
                       other=-1)
        dq = tl.zeros([M_P, HEAD_DIM_P], tl.float32)
        count = tl.load(COUNT + tile * tl.num_programs(1) + h)
        for u in range(0, count):
            blk = tl.load(UNION + tile * sut + h * suh + u)
            member = tl.max((mine == blk).to(tl.int32), 1) > 0
            tok = (blk * BLOCK + t).to(tl.int64)
            t_ok = (t < BLOCK) & (tok < L)
            ok = member[:, None] & (tok[None, :] <= pos[:, None]) & t_ok[None, :]
            k = tl.load(K + tok[:, None] * skl + h * skh + d[None, :], mask=t_ok[:, None] & d_ok[None, :], other=0.0)
            v = tl.load(V + tok[:, None] * svl + h * svh + e[None, :], mask=t_ok[:, None] & e_ok[None, :], other=0.0)
            c = tl.load(CIS + tok * scl + h * sch, mask=t_ok, other=0.0)
            s = dot(q, tl.trans(k), IEEE)
            dp = dot(do, tl.trans(v), IEEE)
            p = tl.where(ok, tl.exp(s * scale + c[None, :] - lse[:, None]), 0.0)  # [M_P, BLOCK_P]
            ds = p * (dp - delta[:, None])  # d loss / d logit
            dq += dot(ds, k, IEEE) * scale
        tl.store(DQ + row[:, None] * sqn + head[:, None] * sqh + d[None, :], dq.to(DQ.dtype.element_ty),
                 mask=r_ok[:, None] & d_ok[None, :])

    @triton.jit
    def dkdv_kernel(Q, K, V, CIS, SEL, POS, DO, LSE, DELTA,
                    sqn, sqh, skl, skh, svl, svh, scl, sch, ssn, ssh, sdn, sdh, sln, N, L, scale,
                    WORK, TILES, GK, GV, GCIS, sgkl, sgkh, sgvl, sgvh, sgcl, NUM_WORK,
                    BLOCK: tl.constexpr, BLOCK_P: tl.constexpr, GROUP: tl.constexpr, TQ: tl.constexpr,
                    M_P: tl.constexpr, TOPK: tl.constexpr, TOPK_P: tl.constexpr, HEAD_DIM: tl.constexpr,
                    HEAD_DIM_P: tl.constexpr, DV: tl.constexpr, DV_P: tl.constexpr, IEEE: tl.constexpr):
        w = tl.program_id(0)
        h = tl.load(WORK + w * 4, mask=w < NUM_WORK, other=0)
        blk = tl.load(WORK + w * 4 + 1, mask=w < NUM_WORK, other=0)
        lo = tl.load(WORK + w * 4 + 2, mask=w < NUM_WORK, other=0)
        hi = tl.load(WORK + w * 4 + 3, mask=w < NUM_WORK, other=0)
        r = tl.arange(0, M_P)
        d = tl.arange(0, HEAD_DIM_P)
        e = tl.arange(0, DV_P)
        t = tl.arange(0, BLOCK_P)
        kk = tl.arange(0, TOPK_P)
        d_ok = d < HEAD_DIM
        e_ok = e < DV
        tok = (blk * BLOCK + t).to(tl.int64)
        t_ok = (t < BLOCK) & (tok < L)
        k = tl.load(K + tok[:, None] * skl + h * skh + d[None, :], mask=t_ok[:, None] & d_ok[None, :], other=0.0)
        v = tl.load(V + tok[:, None] * svl + h * svh + e[None, :], mask=t_ok[:, None] & e_ok[None, :], other=0.0)
        c = tl.load(CIS + tok * scl + h * sch, mask=t_ok, other=0.0)
        dk = tl.zeros([BLOCK_P, HEAD_DIM_P], tl.float32)
        dv = tl.zeros([BLOCK_P, DV_P], tl.float32)
        dc = tl.zeros([BLOCK_P], tl.float32)
        for i in range(lo, hi):
            row, head, r_ok = tile_rows(tl.load(TILES + i), h, r, N, GROUP, TQ)
            q = tl.load(Q + row[:, None] * sqn + head[:, None] * sqh + d[None, :], mask=r_ok[:, None] & d_ok[None, :],
                        other=0.0)
            do = tl.load(DO + row[:, None] * sdn + head[:, None] * sdh + e[None, :],
                         mask=r_ok[:, None] & e_ok[None, :], other=0.0)
            lse = tl.load(LSE + row * sln + head, mask=r_ok, other=float("-inf"))
            lse = tl.where(lse == float("-inf"), 0.0, lse)
            delta = tl.load(DELTA + row * sln + head, mask=r_ok, other=0.0)
            pos = tl.load(POS + row, mask=r_ok, other=-1)
            mine = tl.load(SEL + row[:, None] * ssn + h * ssh + kk[None, :],
                           mask=r_ok[:, None] & (kk < TOPK)[None, :], other=-1)
            member = tl.max((mine == blk).to(tl.int32), 1) > 0
            ok = member[:, None] & (tok[None, :] <= pos[:, None]) & t_ok[None, :]
            s = dot(q, tl.trans(k), IEEE)
            dp = dot(do, tl.trans(v), IEEE)
            p = tl.where(ok, tl.exp(s * scale + c[None, :] - lse[:, None]), 0.0)  # [M_P, BLOCK_P]
            ds = p * (dp - delta[:, None])
            dv += dot(tl.trans(p), do, IEEE)
            dk += dot(tl.trans(ds), q, IEEE)
            dc += tl.sum(ds, 0)
        w_ok = w < NUM_WORK
        tl.atomic_add(GV + tok[:, None] * sgvl + h * sgvh + e[None, :], dv, mask=w_ok & t_ok[:, None] & e_ok[None, :])
        tl.atomic_add(GK + tok[:, None] * sgkl + h * sgkh + d[None, :], dk * scale,
                      mask=w_ok & t_ok[:, None] & d_ok[None, :])
        tl.atomic_add(GCIS + tok * sgcl + h, dc, mask=w_ok & t_ok)

    return {"forward": forward_kernel, "dq": dq_kernel, "dkdv": dkdv_kernel}
