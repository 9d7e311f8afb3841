"""The block selection of a decode step's rows as one CPU kernel (select_cpu.cpp).

nosa.select.select_blocks is the spec, shared by training and serving; this is the same function for
a CPU server's eager decode step, where its hundred small torch ops, each over every block of the
context, made the step grow with the context. Its keys are integers built from the same float32
scores, so it selects exactly the same blocks (tests/test_select_kernel.py). nosa.ops.select_blocks
picks it; ``NOSA_KERNELS=reference`` (or ``triton``) keeps the torch code, as does a step that
torch.compile traces (SGLang's CPU graph runner), where inductor fuses those ops itself.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from nosa.kernels.cpu_build import CppLibrary

SOURCE = Path(__file__).with_name("select_cpu.cpp")


def _declare(lib: ctypes.CDLL) -> None:
    lib.nosa_select_blocks.restype = ctypes.c_int64
    lib.nosa_select_blocks.argtypes = [ctypes.c_int64] * 3 + [ctypes.c_void_p] * 2 + [ctypes.c_int64] \
        + [ctypes.c_void_p] + [ctypes.c_int64] * 5 + [ctypes.c_void_p]


_LIBRARY = CppLibrary(SOURCE, _declare, "CPU selection kernel")


def library():
    """The loaded kernel, or None (no compiler, or a failed build: warned once)."""
    return _LIBRARY.get()


def wanted_here(*tensors: torch.Tensor) -> bool:
    """Whether a selection over ``tensors`` runs this kernel: all on the CPU, ``NOSA_KERNELS`` unset
    or ``auto``, not traced by torch.compile, and the kernel built."""
    return (not torch.compiler.is_compiling() and all(t.device.type == "cpu" for t in tensors)
            and _LIBRARY.ready())


def select_blocks(query_scores: torch.Tensor, evict_scores: torch.Tensor, positions: torch.Tensor,
                  cfg) -> torch.Tensor:
    """nosa.select.select_blocks (same arguments, ``cfg`` a NosaConfig, and result: [R, Hkv, topk_blocks]
    long, ascending, -1 padded) in C++."""
    lib = library()
    if lib is None:
        raise RuntimeError(f"nosa: the CPU selection kernel is unavailable: {_LIBRARY.error}")
    rows, hkv, nb = query_scores.shape
    qs = query_scores.detach().float().contiguous()
    evict = evict_scores.detach().float()
    if evict.dim() != 4 or evict.shape[1:] != (hkv, nb, 2) or evict.shape[0] not in (1, rows):
        evict = evict.expand(rows, hkv, nb, 2)
    evict = evict.contiguous()
    positions = positions.long().contiguous()
    if positions.shape != (rows,):
        raise ValueError(f"select_blocks: positions {tuple(positions.shape)} for {rows} rows")
    out = torch.empty(rows, hkv, cfg.topk_blocks, dtype=torch.long)
    done = lib.nosa_select_blocks(rows, hkv, nb, qs.data_ptr(), evict.data_ptr(), evict.shape[0],
                                  positions.data_ptr(), cfg.block_size, cfg.sink_blocks, cfg.window_blocks,
                                  cfg.query_blocks, cfg.topk_blocks, out.data_ptr())
    if done < 0:
        raise ValueError(f"select_blocks: bad arguments for the kernel (rows {rows}, heads {hkv}, blocks {nb}, "
                         f"{cfg})")
    return out
