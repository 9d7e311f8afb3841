"""A decode layer's resolve through the device block cache as one CPU kernel (resolve_cpu.cpp).

The torch code of nosa.serve.offload.block_cache.DeviceBlockCache.resolve_step is the spec (it is
what a GPU and a captured step run); this is the same step for a CPU server, where that code's ~190
small ops per layer cost more in dispatch than the copy itself. The C++ file is compiled on first use
with the system's C++ compiler (``$CXX``, else ``c++``; about a second) into
``$NOSA_KERNEL_CACHE`` (default ``~/.cache/nosa/kernels``), named by the source's hash, and loaded
with ctypes: no torch headers, no build step at install. Without a compiler the torch path runs and
one warning says why. ``NOSA_KERNELS=reference`` (or ``triton``) keeps the torch path.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import NamedTuple

import torch

log = logging.getLogger(__name__)
SOURCE = Path(__file__).with_name("resolve_cpu.cpp")
_LOCK = threading.Lock()
_STATE: dict = {}  # "lib": the loaded library, or "error": why it could not be built


class Resolved(NamedTuple):
    """What the kernel returns besides its in-place updates: item [R, Hkv, W] (-1 where nothing is
    wanted), rows [R, Hkv, W*B], valid [R, Hkv, W*B], fill [R, Hkv, W] int32, and the demand
    misses' device / host items miss_dst, miss_src [M] (already copied unless asked not to)."""

    item: torch.Tensor
    rows: torch.Tensor
    valid: torch.Tensor
    fill: torch.Tensor
    miss_dst: torch.Tensor
    miss_src: torch.Tensor


def cache_dir() -> Path:
    return Path(os.environ.get("NOSA_KERNEL_CACHE") or Path.home() / ".cache" / "nosa" / "kernels")


def build(force: bool = False) -> Path:
    """Compile resolve_cpu.cpp (if its build for this source is not there yet, or ``force``); returns
    the shared library's path. Raises RuntimeError with the compiler's output on failure."""
    source = SOURCE.read_bytes()
    out = cache_dir() / f"resolve_cpu-{hashlib.sha256(source).hexdigest()[:16]}.so"
    if out.exists() and not force:
        return out
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if not compiler:
        raise RuntimeError("no C++ compiler found (set $CXX or install g++)")
    out.parent.mkdir(parents=True, exist_ok=True)
    # build beside the target, then rename: another process loading it never sees half a file
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        cmd = [compiler, "-O3", "-std=c++17", "-shared", "-fPIC", "-o", tmp, str(SOURCE)]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr.strip()}")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


def library():
    """The loaded kernel, or None (no compiler, or a failed build: warned once)."""
    if "lib" in _STATE or "error" in _STATE:
        return _STATE.get("lib")
    with _LOCK:
        if "lib" not in _STATE and "error" not in _STATE:
            try:
                lib = ctypes.CDLL(str(build()))
                fn = lib.nosa_resolve_layer
                fn.restype = ctypes.c_int64
                fn.argtypes = [ctypes.c_int64] * 6 + [ctypes.c_void_p] * 8 + [ctypes.c_int64] + [ctypes.c_void_p] * 4 \
                    + [ctypes.c_int64] + [ctypes.c_void_p] * 3 + [ctypes.c_int64] + [ctypes.c_void_p] * 6
                lib.nosa_write_tokens.restype = None
                lib.nosa_write_tokens.argtypes = [ctypes.c_int64] * 4 + [ctypes.c_void_p] * 3 + [ctypes.c_int64] \
                    + [ctypes.c_void_p] * 3 + [ctypes.c_int64]
                _STATE["lib"] = lib
            except (OSError, RuntimeError) as exc:
                _STATE["error"] = str(exc)
                log.warning("nosa: the CPU resolve kernel is unavailable, the torch path runs instead: %s", exc)
    return _STATE.get("lib")


def wanted_here(*tensors: torch.Tensor) -> bool:
    """Whether a resolve over ``tensors`` runs this kernel: all on the CPU, ``NOSA_KERNELS`` unset or
    ``auto``, not inside torch.compile, and the kernel built."""
    if (os.environ.get("NOSA_KERNELS") or "auto") != "auto" or torch.compiler.is_compiling():
        return False
    return all(t.device.type == "cpu" for t in tensors) and library() is not None


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _pointers(tensors) -> ctypes.Array:
    return (ctypes.c_void_p * len(tensors))(*(t.data_ptr() for t in tensors))


def resolve_layer(blocks: torch.Tensor, col_of: torch.Tensor, groups: torch.Tensor, wanted: torch.Tensor,
                  pages: torch.Tensor, lengths: torch.Tensor, warm: torch.Tensor, real: torch.Tensor | None,
                  dev: list[torch.Tensor], host: list[torch.Tensor], new_tokens: list[torch.Tensor] | None,
                  dump_row: int, counts: torch.Tensor, max_warm_misses: torch.Tensor, group_misses: torch.Tensor,
                  home: int, copy: bool = True) -> Resolved:
    """Run the kernel (see resolve_cpu.cpp) on one layer. Updated in place: blocks [G+1, Hkv, NS],
    the device item buffers ``dev`` (k [S, B, D], v, cis [S, B]: the recall and the write-through of
    ``new_tokens``, [R, Hkv, ...] each in its buffer's dtype; with ``copy`` False, neither: the caller
    copies ``miss_dst`` / ``miss_src``, then calls ``write_tokens``), counts [7],
    max_warm_misses [] and group_misses [G+1]. Index tensors are int64, warm / real bool."""
    lib = library()
    if lib is None:
        raise RuntimeError(f"nosa: the CPU resolve kernel is unavailable: {_STATE.get('error')}")
    r, hkv, w = wanted.shape
    ns, block = blocks.shape[-1], dev[0].shape[1]
    if w > ns:
        raise ValueError(f"resolve_layer: {w} wanted blocks per KV head but {ns} slots")
    mutated = [blocks, counts, max_warm_misses, group_misses, *dev, *host]
    if not all(t.is_contiguous() for t in mutated):
        raise ValueError("resolve_layer: the slot map, counters and item buffers must be contiguous")
    if any(d.dtype != h.dtype or d.shape[1:] != h.shape[1:] for d, h in zip(dev, host)):
        raise ValueError("resolve_layer: device and host item buffers differ in dtype or item shape")
    wanted, pages = wanted.contiguous(), pages.contiguous()
    groups, lengths, col_of = groups.contiguous(), lengths.contiguous(), col_of.contiguous()
    warm = warm.contiguous()
    real = None if real is None else real.contiguous()
    item = torch.empty(r, hkv, w, dtype=torch.long)
    rows = torch.empty(r, hkv, w * block, dtype=torch.long)
    valid = torch.empty(r, hkv, w * block, dtype=torch.bool)
    fill = torch.empty(r, hkv, w, dtype=torch.int32)
    miss_dst = torch.empty(r * hkv * w, dtype=torch.long)
    miss_src = torch.empty(r * hkv * w, dtype=torch.long)
    item_bytes = torch.tensor([t[0].numel() * t.element_size() for t in dev], dtype=torch.long)
    if new_tokens is not None:
        new_tokens = [t.contiguous() for t in new_tokens]
    m = lib.nosa_resolve_layer(
        r, hkv, ns, w, block, home,
        blocks.data_ptr(), col_of.data_ptr(), groups.data_ptr(), wanted.data_ptr(), pages.data_ptr(),
        lengths.data_ptr(), warm.data_ptr(), _ptr(real),
        len(dev), _pointers(dev), _pointers(host), item_bytes.data_ptr(),
        None if new_tokens is None or not copy else _pointers(new_tokens),
        dump_row, counts.data_ptr(), max_warm_misses.data_ptr(), group_misses.data_ptr(), int(copy),
        item.data_ptr(), rows.data_ptr(), valid.data_ptr(), fill.data_ptr(), miss_dst.data_ptr(), miss_src.data_ptr())
    return Resolved(item, rows, valid, fill, miss_dst[:m], miss_src[:m])


def write_tokens(wanted: torch.Tensor, lengths: torch.Tensor, item: torch.Tensor, dev: list[torch.Tensor],
                 new_tokens: list[torch.Tensor], dump_row: int) -> None:
    """Each request's new token into its tail block's slot (``item``: Resolved.item of the same
    call; the write-through ``resolve_layer`` does itself when it copies)."""
    r, hkv, w = wanted.shape
    new_tokens = [t.contiguous() for t in new_tokens]
    item_bytes = torch.tensor([t[0].numel() * t.element_size() for t in dev], dtype=torch.long)
    library().nosa_write_tokens(r, hkv, w, dev[0].shape[1], wanted.contiguous().data_ptr(),
                                lengths.contiguous().data_ptr(), item.data_ptr(), len(dev), _pointers(dev),
                                item_bytes.data_ptr(), _pointers(new_tokens), dump_row)
