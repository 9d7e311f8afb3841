"""Recall: copy (block, KV head) items between the host KV pool and the device block cache.

An *item* is one (block, KV head) of one layer, contiguous. Host pool: k_host, v_host [P, Hkv, B,
D], cis_host [P, Hkv, B] viewed as [P*Hkv, B, D] / [P*Hkv, B] (item id = page * Hkv + head).
Device cache: k_dev, v_dev [S, B, D], cis_dev [S, B] (one item per slot). Any tensor whose dim 0
indexes contiguous items works. ``copy_items(dst, src, dst_idx, src_idx)`` copies item
src_idx[m] of src[i] to item dst_idx[m] of dst[i] for every pair i and every m with src_idx[m] >=
0 (index lists [M], padded with -1, so a CUDA launch has static shapes); the same call writes
completed blocks back host-ward. CUDA: one Triton launch for all pairs, pinned host tensors read
directly (UVA). CPU: ``ItemCopier`` (the recall engine of a CPU server and the reference), through
cache-resident staging.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import torch

from nosa import env
from nosa.kvquant import dequantize

# (dtype, bytes), widest first: item rows are read in the widest element dividing their bytes
_WIDE = tuple((wide, wide.itemsize) for wide in (torch.int64, torch.int32, torch.int16, torch.uint8))
CHUNK_BYTES = 1 << 19  # staging per pair and chunk: stays in L2 between gather and scatter


def check_indices(dst_idx: torch.Tensor, src_idx: torch.Tensor) -> None:
    """copy_items' index lists: 1-D int64 and of one length (every path checks these per call)."""
    for name, idx in (("dst_idx", dst_idx), ("src_idx", src_idx)):
        if idx.dim() != 1 or idx.dtype != torch.int64:
            raise ValueError(f"copy_items: {name} must be a 1-D int64 tensor, got {idx.dtype} {tuple(idx.shape)}")
    if dst_idx.shape != src_idx.shape:
        raise ValueError(f"copy_items: dst_idx {tuple(dst_idx.shape)} and src_idx {tuple(src_idx.shape)} differ")


def _check(dst: Sequence[torch.Tensor], src: Sequence[torch.Tensor], dst_idx: torch.Tensor, src_idx: torch.Tensor):
    if len(dst) != len(src) or not dst:
        raise ValueError(f"copy_items: need as many dst as src tensors (>= 1), got {len(dst)} and {len(src)}")
    check_indices(dst_idx, src_idx)
    for i, (d, s) in enumerate(zip(dst, src)):
        if d.dtype != s.dtype:
            raise ValueError(f"copy_items: pair {i}: dst dtype {d.dtype} != src dtype {s.dtype}")
        if d.shape[1:] != s.shape[1:]:
            raise ValueError(
                f"copy_items: pair {i}: item shapes differ: dst {tuple(d.shape[1:])}, src {tuple(s.shape[1:])}"
            )
        for name, t in (("dst", d), ("src", s)):
            if not t.is_contiguous():
                raise ValueError(f"copy_items: pair {i}: {name} must be contiguous (items along dim 0), "
                                 f"got strides {t.stride()} for shape {tuple(t.shape)}")


def debug_checks() -> bool:
    """$NOSA_DEBUG_CHECKS=1: check index bounds on every copy. Off by default: the check reads the
    indices on the host, a synchronisation per call on CUDA that a captured step cannot make, and
    on CPU it cost more than copying a few items (the offloading profile)."""
    return env.flag("NOSA_DEBUG_CHECKS")


def check_bounds(dst, src, dst_idx: torch.Tensor, src_idx: torch.Tensor) -> None:
    """ValueError naming the pair and side whose index (-1 entries of src_idx left out) is outside
    its tensor's items."""
    keep = src_idx >= 0
    for i, (d, s) in enumerate(zip(dst, src)):
        for name, t, idx in (("dst", d, dst_idx[keep]), ("src", s, src_idx[keep])):
            if idx.numel() == 0:
                continue
            lo, hi = int(idx.min()), int(idx.max())
            if lo < 0 or hi >= t.shape[0]:
                raise ValueError(f"copy_items: pair {i}: {name} index {lo if lo < 0 else hi} outside "
                                 f"[0, {t.shape[0]}) (items of {name})")


def item_rows(t: torch.Tensor) -> torch.Tensor:
    """[N, *item] contiguous -> [N, W] view in the widest integer type dividing the item's bytes."""
    rows = t.reshape(t.shape[0], -1)
    nbytes = math.prod(t.shape[1:]) * t.element_size()
    for wide, size in _WIDE:
        if nbytes % size == 0 and t.data_ptr() % size == 0:
            return rows if t.dtype == wide else rows.view(torch.uint8).view(wide)
    raise AssertionError("unreachable: uint8 divides everything")


def copy_rows(t: torch.Tensor) -> torch.Tensor:
    """[N, *item] contiguous -> [N, W] rows for the CPU gather-scatter: items of 4- or 8-byte
    elements as they are (index_copy_ of float32 rows measured faster than of the same bytes as
    int64), narrower ones widened (``item_rows``)."""
    return t.reshape(t.shape[0], -1) if t.element_size() >= 4 else item_rows(t)


class ItemCopier:
    """The CPU gather-scatter with preallocated staging buffers.

    ItemCopier(like=(k_dev, v_dev, cis_dev)) sizes one cache-resident staging buffer per pair from
    the item shapes of ``like`` (dim 0 ignored); ``.copy(dst, src, dst_idx, src_idx)`` then
    allocates nothing but the compacted index lists when some entries are padding.
    """

    def __init__(self, like: Sequence[torch.Tensor], chunk_bytes: int = CHUNK_BYTES):
        self._rows = [copy_rows(t[:1]) for t in like]
        item_bytes = max(r.shape[1] * r.element_size() for r in self._rows)
        self.chunk = max(1, chunk_bytes // item_bytes)
        self._staging = [torch.empty(self.chunk, r.shape[1], dtype=r.dtype) for r in self._rows]

    def copy(self, dst: Sequence[torch.Tensor], src: Sequence[torch.Tensor], dst_idx: torch.Tensor,
             src_idx: torch.Tensor) -> None:
        _check(dst, src, dst_idx, src_idx)
        if any(t.is_cuda for t in (*dst, *src)):
            raise ValueError("ItemCopier is the CPU path; use nosa.ops.copy_items for CUDA tensors")
        if len(dst) != len(self._staging):
            raise ValueError(f"ItemCopier: built for {len(self._staging)} pairs, got {len(dst)}")
        keep = src_idx >= 0
        if not bool(keep.all()):  # one nonzero for both lists (a boolean index runs one each)
            which = keep.nonzero().squeeze(1)
            dst_idx, src_idx = dst_idx.index_select(0, which), src_idx.index_select(0, which)
        count = src_idx.numel()
        if count == 0:
            return
        if debug_checks():
            check_bounds(dst, src, dst_idx, src_idx)
        for i, (d, s) in enumerate(zip(dst, src)):
            d_rows, s_rows, staging = copy_rows(d), copy_rows(s), self._staging[i]
            if d_rows.shape[1:] != staging.shape[1:] or d_rows.dtype != staging.dtype:
                raise ValueError(f"ItemCopier: pair {i}: items of {tuple(d.shape[1:])} {d.dtype} do not match "
                                 f"the staging it was built for ({staging.shape[1]} x {staging.dtype})")
            if count <= self.chunk:  # the usual case: one chunk, no slicing
                d_rows.index_copy_(0, dst_idx, torch.index_select(s_rows, 0, src_idx, out=staging[:count]))
                continue
            for lo in range(0, count, self.chunk):
                hi = min(lo + self.chunk, count)
                buf = staging[: hi - lo]
                torch.index_select(s_rows, 0, src_idx[lo:hi], out=buf)
                d_rows.index_copy_(0, dst_idx[lo:hi], buf)


def copy_items_reference(dst, src, dst_idx, src_idx) -> None:
    """The spec as one call, on any devices. Shapes as in the module docstring. CPU tensors: the
    ItemCopier path (staging sized for this call); with CUDA tensors (e.g. NOSA_KERNELS=reference on
    a GPU): a plain gather + scatter per pair, which allocates and synchronises (a reference only)."""
    if not any(t.is_cuda for t in (*dst, *src, dst_idx, src_idx)):
        _check(dst, src, dst_idx, src_idx)
        check_bounds(dst, src, dst_idx, src_idx)  # the reference always checks: it synchronises anyway
        ItemCopier(dst).copy(dst, src, dst_idx, src_idx)
        return
    _check(dst, src, dst_idx, src_idx)
    keep = src_idx >= 0
    dst_idx, src_idx = dst_idx[keep], src_idx[keep]
    for d, s in zip(dst, src):
        rows = item_rows(s).index_select(0, src_idx.to(s.device))
        item_rows(d).index_copy_(0, dst_idx.to(d.device), rows.to(d.device))


# ---- Triton (CUDA; CPU tensors under TRITON_INTERPRET=1) ------------------------------------------
MAX_PAIRS = 3  # one launch carries up to three pairs (K, V, cis); more pairs take more launches
CHUNK_ELEMS = 1024  # wide elements per program and pair (8 KiB of int64)


def copy_items_plan(dst, src, dst_idx, src_idx):
    """(grid, positional args, constexprs) of one launch for up to MAX_PAIRS pairs (also used by the
    ahead-of-time compile test, so the two cannot drift apart)."""
    pairs = [(item_rows(d), item_rows(s)) for d, s in zip(dst, src)]
    widths = [d.shape[1] for d, _ in pairs]
    while len(pairs) < MAX_PAIRS:  # unused slots: any tensors, never touched (NPAIRS guards them)
        pairs.append(pairs[0])
        widths.append(0)
    args = [dst_idx, src_idx]
    for d, s in pairs:
        args += [d, s]
    chunks = max(1, -(-max(widths) // CHUNK_ELEMS))
    grid = (dst_idx.numel(), chunks)
    constexprs = dict(NPAIRS=len(dst), W0=widths[0], W1=widths[1], W2=widths[2], CHUNK=CHUNK_ELEMS)
    return grid, args, constexprs


def launch_indices(dst, src, dst_idx, src_idx):
    """(dst_idx, src_idx) as a Triton launch reads them: on the GPU when any tensor is (pinned host
    tensors allowed, pageable ones refused: the kernel reads host memory through UVA), contiguous,
    bounds-checked with NOSA_DEBUG_CHECKS; None when there is nothing to copy. ``src`` items may be
    nosa.kvquant.QuantizedItems."""
    cuda = next((t.device for t in (*dst, *src) if t.is_cuda), None)
    if cuda is not None:
        for i, (d, s) in enumerate(zip(dst, src)):
            for name, t in (("dst", d), ("src", s)):
                if not t.is_cuda and not t.is_pinned():
                    raise ValueError(f"copy_items: pair {i}: {name} is pageable host memory; the kernel reads "
                                     "host memory through UVA, which needs pinned (or cudaHostRegister-ed) memory")
        # index lists made next to a host pool: the kernel reads them on the device
        dst_idx, src_idx = dst_idx.to(cuda, non_blocking=True), src_idx.to(cuda, non_blocking=True)
    dst_idx, src_idx = dst_idx.contiguous(), src_idx.contiguous()
    if src_idx.numel() == 0:
        return None
    if debug_checks():
        check_bounds(dst, [getattr(s, "data", s) for s in src], dst_idx, src_idx)
    return dst_idx, src_idx


def copy_items_triton(dst, src, dst_idx, src_idx) -> None:
    """One launch per MAX_PAIRS pairs. CUDA tensors (src or dst may be pinned host memory), or CPU
    tensors under TRITON_INTERPRET=1."""
    _check(dst, src, dst_idx, src_idx)
    launch(copy_items_plan, kernels()["copy"], dst, src, dst_idx, src_idx)


def launch(plan, kernel, dst, src, dst_idx, src_idx) -> None:
    """``kernel`` over every MAX_PAIRS pairs, with the launch arguments ``plan`` makes of them
    (indices through ``launch_indices``; nothing launched when nothing is to be copied)."""
    indices = launch_indices(dst, src, dst_idx, src_idx)
    if indices is None:
        return
    for lo in range(0, len(dst), MAX_PAIRS):
        grid, args, constexprs = plan(dst[lo : lo + MAX_PAIRS], src[lo : lo + MAX_PAIRS], *indices)
        kernel[grid](*args, **constexprs, num_warps=4)


@functools.cache
def kernels() -> dict:
    """{"copy"}: the @triton.jit kernel, built on first use (importing needs no triton)."""
    import triton  # optional: triton (CUDA, or TRITON_INTERPRET=1 for tests)
    import triton.language as tl  # optional: triton

    @triton.jit
    def copy_kernel(DST_IDX, SRC_IDX, D0, S0, D1, S1, D2, S2,
                    NPAIRS: tl.constexpr, W0: tl.constexpr, W1: tl.constexpr, W2: tl.constexpr, CHUNK: tl.constexpr):
        m = tl.program_id(0)
        offs = tl.program_id(1) * CHUNK + tl.arange(0, CHUNK)
        s = tl.load(SRC_IDX + m)
        ok = s >= 0
        d = tl.where(ok, tl.load(DST_IDX + m), 0)  # a padded entry's dst may be anything: never use it
        s = tl.where(ok, s, 0)
        # .cg: each byte is read once, keep it out of L1
        x = tl.load(S0 + s * W0 + offs, mask=ok & (offs < W0), cache_modifier=".cg")
        tl.store(D0 + d * W0 + offs, x, mask=ok & (offs < W0))
        if NPAIRS > 1:
            x = tl.load(S1 + s * W1 + offs, mask=ok & (offs < W1), cache_modifier=".cg")
            tl.store(D1 + d * W1 + offs, x, mask=ok & (offs < W1))
        if NPAIRS > 2:
            x = tl.load(S2 + s * W2 + offs, mask=ok & (offs < W2), cache_modifier=".cg")
            tl.store(D2 + d * W2 + offs, x, mask=ok & (offs < W2))

    return {"copy": copy_kernel}


# ---- recall from a quantized host pool (NOSA_HOST_KV_DTYPE; the format is nosa.kvquant) ------------
# A source may be a nosa.kvquant.QuantizedItems (data [N, B, D] int8 / fp8, scale [N, B] float32):
# its items are dequantized into the destination's dtype on the way, float32(q) * scale rounded once,
# exactly nosa.kvquant.dequantize. Other pairs (cis) are copied as they are, in the same launch.
PLAIN, INT8, FP8 = 0, 1, 2  # the kind of a pair


def _kind(src) -> int:
    scale = getattr(src, "scale", None)
    if scale is None:
        return PLAIN
    return INT8 if src.data.dtype == torch.int8 else FP8


def check_dequant(dst, src, dst_idx, src_idx) -> None:
    """The checks of ``_check`` for pairs whose source may be quantized: dst [N, *item] in the
    dtype the source dequantizes to, data [N, *item] int8 / float8_e4m3fn, scale [N, *item[:-1]]."""
    if len(dst) != len(src) or not dst:
        raise ValueError(f"copy_items: need as many dst as src tensors (>= 1), got {len(dst)} and {len(src)}")
    check_indices(dst_idx, src_idx)
    for i, (d, s) in enumerate(zip(dst, src)):
        if _kind(s) == PLAIN:
            _check([d], [s], dst_idx, src_idx)
            continue
        if s.data.dtype not in (torch.int8, torch.float8_e4m3fn):
            raise ValueError(f"copy_items: pair {i}: quantized data must be int8 or float8_e4m3fn, got {s.data.dtype}")
        if d.dtype != s.dtype:
            raise ValueError(f"copy_items: pair {i}: dst dtype {d.dtype} != the dtype the source dequantizes to "
                             f"({s.dtype})")
        if d.shape[1:] != s.data.shape[1:] or s.scale.shape != s.data.shape[:-1]:
            raise ValueError(f"copy_items: pair {i}: item shapes differ: dst {tuple(d.shape[1:])}, quantized "
                             f"{tuple(s.data.shape[1:])} with scales {tuple(s.scale.shape[1:])}")
        if s.scale.dtype != torch.float32:
            raise ValueError(f"copy_items: pair {i}: scales must be float32, got {s.scale.dtype}")
        factor = getattr(s, "factor", None)
        if factor is not None and (factor.dim() != 2 or factor.shape[1] != s.data.shape[-1] or s.data.dim() != 3
                                   or factor.dtype != torch.float32 or not factor.is_contiguous()):
            raise ValueError(f"copy_items: pair {i}: key factors must be contiguous float32 [Hkv, D] for items "
                             f"[B, D]; got {tuple(factor.shape)} {factor.dtype} for items {tuple(s.data.shape[1:])}")
        for name, t in (("dst", d), ("src data", s.data), ("src scale", s.scale)):
            if not t.is_contiguous():
                raise ValueError(f"copy_items: pair {i}: {name} must be contiguous, strides {t.stride()}")


def copy_items_dequant_reference(dst, src, dst_idx, src_idx) -> None:
    """The spec of a recall from a quantized pool, on any devices: gather, dequantize, scatter."""
    check_dequant(dst, src, dst_idx, src_idx)
    keep = src_idx >= 0
    if not any(t.is_cuda for t in (*dst, dst_idx, src_idx)):
        check_bounds(dst, [getattr(s, "data", s) for s in src], dst_idx, src_idx)
    dst_idx, src_idx = dst_idx[keep], src_idx[keep]
    for d, s in zip(dst, src):
        where = src_idx.to(s.device)
        if _kind(s) == PLAIN:
            rows = s.index_select(0, where)
        else:
            factor = None if s.factor is None else s.factor.to(s.device)[where % s.factor.shape[0], None]
            rows = dequantize(s.data.index_select(0, where), s.scale.index_select(0, where), d.dtype, factor)
        d.index_copy_(0, dst_idx.to(d.device), rows.to(d.device))


DEQUANT_CHUNK = 1024  # elements per program and pair


def copy_items_dequant_plan(dst, src, dst_idx, src_idx):
    """(grid, positional args, constexprs) of one launch of up to MAX_PAIRS pairs, any of them
    quantized (shared with the ahead-of-time compile test)."""
    args, consts, widths = [dst_idx, src_idx], {"NPAIRS": len(dst)}, []
    for i in range(MAX_PAIRS):
        d, s = (dst[i], src[i]) if i < len(dst) else (dst[0], src[0])
        kind = _kind(s)
        factor = getattr(s, "factor", None)
        if kind == PLAIN:
            data, scale, row = s, s, 1  # the scale pointer is never read
        else:
            # fp8 bytes are decoded in the kernel from their bits (uint8): no fp8 type needed
            data = s.data.view(torch.uint8) if kind == FP8 else s.data
            scale, row = s.scale, s.data.shape[-1]
        width = d[0].numel() if i < len(dst) else 0
        bf16 = kind != PLAIN and d.dtype == torch.bfloat16  # stored as rounded bits (int16)
        # the factor pointer is read only when H{i} > 0 (item s is KV head s % H{i})
        args += [d.view(torch.int16) if bf16 else d, data, scale, scale if factor is None else factor]
        consts.update({f"K{i}": kind, f"W{i}": width, f"R{i}": row, f"B{i}": int(bf16),
                       f"H{i}": 0 if factor is None else factor.shape[0]})
        widths.append(width)
    consts["CHUNK"] = DEQUANT_CHUNK
    grid = (dst_idx.numel(), max(1, -(-max(widths) // DEQUANT_CHUNK)))
    return grid, args, consts


def copy_items_dequant_triton(dst, src, dst_idx, src_idx) -> None:
    """The recall of a quantized pool in one launch per MAX_PAIRS pairs (CUDA: the host pool's data
    and scales pinned; or CPU tensors under TRITON_INTERPRET=1)."""
    check_dequant(dst, src, dst_idx, src_idx)
    launch(copy_items_dequant_plan, dequant_kernels()["copy_dequant"], dst, src, dst_idx, src_idx)


@functools.cache
def dequant_kernels() -> dict:
    """{"copy_dequant"}: the @triton.jit kernel (nosa.kernels.recall_dequant_jit, which imports triton:
    loaded on first use)."""
    from nosa.kernels.recall_dequant_jit import copy_dequant_kernel  # optional: triton (the module imports it)

    return {"copy_dequant": copy_dequant_kernel}
