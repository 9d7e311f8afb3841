"""A decode layer's resolve through the device block cache as one CPU kernel (resolve_cpu.cpp).

The torch code of nosa.serve.offload.block_cache.DeviceBlockCache.resolve_layer is the spec (it is
what a GPU and a captured step run); this is the same step for a CPU server, where that code's ~190
small ops per layer cost more in dispatch than the copy itself. The C++ file is compiled on first use
and loaded with ctypes (nosa.kernels.cpu_build). Without a compiler the torch path runs and one
warning says why. ``NOSA_KERNELS=reference`` (or ``triton``) keeps the torch path.
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import NamedTuple, Optional

import torch

from nosa.kernels.cpu_build import CppLibrary
from nosa.kernels.cpu_build import build as build_cpp
from nosa.kernels.recall import check_dequant, check_indices

SOURCE = Path(__file__).with_name("resolve_cpu.cpp")


class _Table(NamedTuple):  # the fields of nosa.serve.offload.resolve.PageTable
    req_to_token: torch.Tensor
    rows: torch.Tensor


class Resolved(NamedTuple):
    """What the kernel returns besides its in-place updates: item [R, Hkv, W] (-1 where nothing is
    wanted), rows [R, Hkv, W*B], valid [R, Hkv, W*B], fill [R, Hkv, W] int32, and the demand
    misses' device / host items miss_dst, miss_src [M] (already copied unless asked not to); empty:
    slots with a column but no block in the counted rows' groups, after the call."""

    item: torch.Tensor
    rows: torch.Tensor
    valid: torch.Tensor
    fill: torch.Tensor
    miss_dst: torch.Tensor
    miss_src: torch.Tensor
    empty: int


def _declare(lib: ctypes.CDLL) -> None:
    fn = lib.nosa_resolve_layer
    fn.restype = ctypes.c_int64
    fn.argtypes = [ctypes.c_int64] * 6 + [ctypes.c_void_p] * 6 + [ctypes.c_int64] \
        + [ctypes.c_void_p] * 4 + [ctypes.c_int64] + [ctypes.c_void_p] * 4 + [ctypes.c_int64] \
        + [ctypes.c_void_p] * 3 + [ctypes.c_int64] + [ctypes.c_void_p] * 7 + [ctypes.c_int64] * 2
    lib.nosa_write_tokens.restype = ctypes.c_int64
    lib.nosa_write_tokens.argtypes = [ctypes.c_int64] * 4 + [ctypes.c_void_p] * 3 + [ctypes.c_int64] \
        + [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 2
    lib.nosa_copy_items.restype = ctypes.c_int64
    lib.nosa_copy_items.argtypes = [ctypes.c_int64] + [ctypes.c_void_p] * 3 + [ctypes.c_int64] \
        + [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 2
    lib.nosa_copy_items_dequant.restype = ctypes.c_int64
    lib.nosa_copy_items_dequant.argtypes = [ctypes.c_int64] + [ctypes.c_void_p] * 10 + [ctypes.c_int64] \
        + [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 2


_LIBRARY = CppLibrary(SOURCE, _declare, "CPU resolve kernel")


def build(force: bool = False) -> Path:
    """Compile resolve_cpu.cpp (nosa.kernels.cpu_build.build); returns the shared library's path."""
    return build_cpp(SOURCE, force)


def library():
    """The loaded kernel, or None (no compiler, or a failed build: warned once)."""
    return _LIBRARY.get()


@torch.compiler.assume_constant_result
def _ready() -> bool:
    """``NOSA_KERNELS`` unset or ``auto`` and the kernel built (a constant to torch.compile)."""
    return _LIBRARY.ready()


def wanted_here(*tensors: torch.Tensor) -> bool:
    """Whether a resolve over ``tensors`` runs this kernel: all on the CPU, ``NOSA_KERNELS`` unset or
    ``auto``, and the kernel built. Inside torch.compile (SGLang's CPU graph runner) it runs as the
    operator ``torch.ops.nosa.resolve_layer``."""
    return all(t.device.type == "cpu" for t in tensors) and _ready()


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _pointers(tensors) -> ctypes.Array:
    return (ctypes.c_void_p * len(tensors))(*(t.data_ptr() for t in tensors))


def _dense(t: torch.Tensor) -> torch.Tensor:
    return t if t.is_contiguous() else t.contiguous()


_BUFFERS: dict[tuple, tuple] = {}


def _buffers(tensors) -> tuple[ctypes.Array, torch.Tensor]:
    """(pointer array, bytes per item [n] int64) of item buffers, kept per set of buffers (a layer's
    device cache and host pool are the same every step)."""
    key = tuple((t.data_ptr(), t.shape, t.dtype) for t in tensors)
    found = _BUFFERS.get(key)
    if found is None:
        if len(_BUFFERS) > 4096:
            _BUFFERS.clear()
        found = _BUFFERS[key] = (_pointers(tensors),
                                 torch.tensor([t[0].numel() * t.element_size() for t in tensors], dtype=torch.long))
    return found


def resolve_layer(blocks: torch.Tensor, col_of: torch.Tensor, groups: torch.Tensor, wanted: torch.Tensor,
                  pages, lengths: torch.Tensor, warm: torch.Tensor, real: torch.Tensor | None,
                  dev: list[torch.Tensor], host: list[torch.Tensor], new_tokens: list[torch.Tensor] | None,
                  dump_row: int, counts: torch.Tensor, max_warm_misses: torch.Tensor, group_misses: torch.Tensor,
                  home: int, copy: bool = True) -> Resolved:
    """Run the kernel (see resolve_cpu.cpp) on one layer. Updated in place: blocks [G+1, Hkv, NS],
    the device item buffers ``dev`` (k [S, B, D], v, cis [S, B]: the recall and the write-through of
    ``new_tokens``, [R, Hkv, ...] each in its buffer's dtype; with ``copy`` False, neither: the caller
    copies ``miss_dst`` / ``miss_src``, then calls ``write_tokens``), counts [7],
    max_warm_misses [] and group_misses [G+1]. Index tensors are int64, warm / real bool. ``pages``:
    the host page of each wanted block [R, Hkv, W], or a table to look them up in
    (nosa.serve.offload.resolve.PageTable: req_to_token int32 [rows, max_ctx], rows [R])."""
    lib = library()
    if lib is None:
        raise RuntimeError(f"nosa: the CPU resolve kernel is unavailable: {_LIBRARY.error}")
    r, hkv, w = wanted.shape
    ns, block = blocks.shape[-1], dev[0].shape[1]
    if w > ns:
        raise ValueError(f"resolve_layer: {w} wanted blocks per KV head but {ns} slots")
    if not (blocks.is_contiguous() and counts.is_contiguous() and max_warm_misses.is_contiguous()
            and group_misses.is_contiguous()):
        raise ValueError("resolve_layer: the slot map and the counters must be contiguous")
    quantized = any(getattr(t, "scale", None) is not None for t in host)
    if quantized and copy:
        raise ValueError("resolve_layer: a quantized host pool (NOSA_HOST_KV_DTYPE) is copied by the caller "
                         "(copy=False, then nosa.ops.copy_items, which dequantizes)")
    if quantized:  # the kernel only diffs and lists the misses: the host pointers are never read
        dev_ptrs, item_bytes = _buffers(dev)
        host_ptrs = dev_ptrs
    else:
        dev_ptrs, host_ptrs, item_bytes = _pair(dev, host)
    wanted = _dense(wanted)
    table = table_rows = None
    if isinstance(pages, torch.Tensor):
        pages = _dense(pages)
    else:
        table, table_rows, pages = pages.req_to_token, _dense(pages.rows), None
        if table.dtype != torch.int32 or not table.is_contiguous():
            raise ValueError(f"resolve_layer: req_to_token must be a contiguous int32 table, got {table.dtype}")
    groups, lengths, col_of, warm = _dense(groups), _dense(lengths), _dense(col_of), _dense(warm)
    real = None if real is None else _dense(real)
    item = torch.empty(r, hkv, w, dtype=torch.long)
    rows = torch.empty(r, hkv, w * block, dtype=torch.long)
    valid = torch.empty(r, hkv, w * block, dtype=torch.bool)
    fill = torch.empty(r, hkv, w, dtype=torch.int32)
    miss_dst = torch.empty(r * hkv * w, dtype=torch.long)
    miss_src = torch.empty(r * hkv * w, dtype=torch.long)
    empty = ctypes.c_int64(0)
    if new_tokens is not None:
        new_tokens = [_dense(t) for t in new_tokens]
    m = lib.nosa_resolve_layer(
        r, hkv, ns, w, block, home,
        blocks.data_ptr(), col_of.data_ptr(), groups.data_ptr(), wanted.data_ptr(), _ptr(pages), _ptr(table),
        0 if table is None else table.shape[1], _ptr(table_rows), lengths.data_ptr(), warm.data_ptr(), _ptr(real),
        len(dev), dev_ptrs, host_ptrs, item_bytes.data_ptr(),
        None if new_tokens is None or not copy else _pointers(new_tokens),
        dump_row, counts.data_ptr(), max_warm_misses.data_ptr(), group_misses.data_ptr(), int(copy),
        item.data_ptr(), rows.data_ptr(), valid.data_ptr(), fill.data_ptr(), miss_dst.data_ptr(), miss_src.data_ptr(),
        ctypes.addressof(empty), dev[0].shape[0], host[0].shape[0])
    if m < 0:
        raise RuntimeError(f"nosa resolve kernel: a recall index fell outside the {dev[0].shape[0]} device or "
                           f"{host[0].shape[0]} host items (a slot without a column, or a page past the host pool); "
                           "nothing was copied")
    return Resolved(item, rows, valid, fill, miss_dst[:m], miss_src[:m], empty.value)


def _pair(dev: list[torch.Tensor], host: list[torch.Tensor]) -> tuple[ctypes.Array, ctypes.Array, torch.Tensor]:
    """(device pointers, host pointers, bytes per item) of matching item buffers, checked the first
    time a pair is seen (contiguous, the same dtype and item shape)."""
    key = (len(dev), *((t.data_ptr(), t.shape, t.stride(), t.dtype) for t in (*dev, *host)))
    found = _PAIRS.get(key)
    if found is None:
        if len(dev) != len(host) or any(d.dtype != h.dtype or d.shape[1:] != h.shape[1:] for d, h in zip(dev, host)):
            raise ValueError("copy_items / resolve_layer: the two sides' item buffers differ in number, dtype or "
                             "item shape")
        if not all(t.is_contiguous() for t in (*dev, *host)):
            raise ValueError("copy_items / resolve_layer: the item buffers must be contiguous (items along dim 0)")
        if len(_PAIRS) > 4096:
            _PAIRS.clear()
        dev_ptrs, item_bytes = _buffers(dev)
        found = _PAIRS[key] = (dev_ptrs, _buffers(host)[0], item_bytes)
    return found


_PAIRS: dict[tuple, tuple] = {}


def copy_items(dst: list[torch.Tensor], src: list[torch.Tensor], dst_idx: torch.Tensor, src_idx: torch.Tensor) -> None:
    """nosa.ops.copy_items for CPU tensors: one memcpy per item and buffer, entries with src_idx < 0
    left out. The buffers are checked the first time a pair is seen (contiguous, matching items)."""
    dst_ptrs, src_ptrs, item_bytes = _pair(dst, src)
    check_indices(dst_idx, src_idx)
    dst_idx, src_idx = _dense(dst_idx), _dense(src_idx)
    done = library().nosa_copy_items(len(dst), dst_ptrs, src_ptrs, item_bytes.data_ptr(), dst_idx.numel(),
                                     dst_idx.data_ptr(), src_idx.data_ptr(), dst[0].shape[0], src[0].shape[0])
    if done < 0:
        raise ValueError(f"copy_items: an index (src_idx >= 0) falls outside the {dst[0].shape[0]} dst or "
                         f"{src[0].shape[0]} src items; nothing was copied")


DEQUANT_OUT = (torch.bfloat16, torch.float32)  # the device dtypes the C++ dequantizing copy writes


def copy_items_dequant(dst: list[torch.Tensor], src: list, dst_idx: torch.Tensor, src_idx: torch.Tensor) -> None:
    """nosa.ops.copy_items for CPU tensors with some sources nosa.kvquant.QuantizedItems (checked as
    nosa.kernels.recall.check_dequant does): one pass per item, dequantized into bf16 / float32
    destinations exactly as nosa.kvquant.dequantize."""
    check_dequant(dst, src, dst_idx, src_idx)
    kinds, out_bf16, item_bytes, elems, rows, heads, datas, scales, factors = [], [], [], [], [], [], [], [], []
    for d, s in zip(dst, src):
        scale = getattr(s, "scale", None)
        data = s if scale is None else s.data
        if scale is not None and d.dtype not in DEQUANT_OUT:
            raise ValueError(f"copy_items_dequant: the CPU kernel writes {DEQUANT_OUT}, not {d.dtype}")
        factor = getattr(s, "factor", None)
        kinds.append(0 if scale is None else (1 if data.dtype == torch.int8 else 2))
        out_bf16.append(int(d.dtype == torch.bfloat16))
        item_bytes.append(d[0].numel() * d.element_size())
        elems.append(d[0].numel())
        rows.append(1 if scale is None else data.shape[-1])
        heads.append(1 if factor is None else factor.shape[0])
        datas.append(data)
        scales.append(data if scale is None else scale)
        factors.append(factor)
    dst_idx, src_idx = _dense(dst_idx), _dense(src_idx)
    ints = torch.tensor([kinds, out_bf16, item_bytes, elems, rows, heads], dtype=torch.long)
    factor_ptrs = (ctypes.c_void_p * len(factors))(*(None if f is None else f.data_ptr() for f in factors))
    done = library().nosa_copy_items_dequant(len(dst), _pointers(dst), _pointers(datas), _pointers(scales),
                                             factor_ptrs, ints[0].data_ptr(), ints[1].data_ptr(),
                                             ints[2].data_ptr(), ints[3].data_ptr(), ints[4].data_ptr(),
                                             ints[5].data_ptr(), dst_idx.numel(),
                                             dst_idx.data_ptr(), src_idx.data_ptr(), dst[0].shape[0],
                                             datas[0].shape[0])
    if done < 0:
        raise ValueError(f"copy_items: an index (src_idx >= 0) falls outside the {dst[0].shape[0]} dst or "
                         f"{datas[0].shape[0]} src items; nothing was copied")


def write_tokens(wanted: torch.Tensor, lengths: torch.Tensor, item: torch.Tensor, dev: list[torch.Tensor],
                 new_tokens: list[torch.Tensor], dump_row: int) -> None:
    """Each request's new token into its tail block's slot (``item``: Resolved.item of the same
    call; the write-through ``resolve_layer`` does itself when it copies)."""
    r, hkv, w = wanted.shape
    new_tokens = [t.contiguous() for t in new_tokens]
    dev_ptrs, item_bytes = _buffers(dev)
    done = library().nosa_write_tokens(r, hkv, w, dev[0].shape[1], _dense(wanted).data_ptr(),
                                       _dense(lengths).data_ptr(), item.data_ptr(), len(dev), dev_ptrs,
                                       item_bytes.data_ptr(), _pointers(new_tokens), dump_row, dev[0].shape[0])
    if done < 0:
        raise RuntimeError(f"nosa resolve kernel: a tail block's item fell outside the {dev[0].shape[0]} device items")


@torch.library.custom_op("nosa::resolve_layer", mutates_args=("blocks", "dev", "counts", "max_warm_misses",
                                                              "group_misses"))
def resolve_layer_op(blocks: torch.Tensor, col_of: torch.Tensor, groups: torch.Tensor, wanted: torch.Tensor,
                     pages: Optional[torch.Tensor], req_to_token: Optional[torch.Tensor],
                     table_rows: Optional[torch.Tensor], lengths: torch.Tensor, warm: torch.Tensor,
                     real: Optional[torch.Tensor],
                     dev: list[torch.Tensor], host: list[torch.Tensor], new_tokens: list[torch.Tensor],
                     dump_row: int, counts: torch.Tensor, max_warm_misses: torch.Tensor, group_misses: torch.Tensor,
                     home: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``resolve_layer`` (copying) as one operator, so that a compiled decode step keeps it whole:
    (item, rows, valid, fill). ``new_tokens``: [] for none; ``pages`` None: looked up in
    ``req_to_token`` at ``table_rows``."""
    if pages is None:
        pages = _Table(req_to_token, table_rows)
    done = resolve_layer(blocks, col_of, groups, wanted, pages, lengths, warm, real, dev, host, new_tokens or None,
                         dump_row, counts, max_warm_misses, group_misses, home)
    return done.item, done.rows, done.valid, done.fill


@resolve_layer_op.register_fake
def _(blocks, col_of, groups, wanted, pages, req_to_token, table_rows, lengths, warm, real, dev, host, new_tokens,
      dump_row, counts, max_warm_misses, group_misses, home):
    r, hkv, w = wanted.shape
    block = dev[0].shape[1]
    return (wanted.new_empty(r, hkv, w), wanted.new_empty(r, hkv, w * block),
            wanted.new_empty(r, hkv, w * block, dtype=torch.bool), wanted.new_empty(r, hkv, w, dtype=torch.int32))
