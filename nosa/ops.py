"""One function per NOSA GPU op: the Triton kernel on CUDA tensors, the torch reference on CPU.

Callers (nosa.attention.prefill on CUDA, the offloading engine in nosa.serve) never pick an
implementation themselves; ``NOSA_KERNELS`` (nosa.env) overrides the choice: ``auto`` (Triton
when any tensor argument is on CUDA, else the reference), ``reference``, or ``triton`` (on CPU
tensors only with TRITON_INTERPRET=1 set before triton is imported: tests, ~1 ms per program).
``NOSA_DECODE_IMPL`` picks ``slot_decode``'s implementation where a kernel runs: ``triton`` or
``flashinfer`` (nosa.kernels.flashinfer_decode; CUDA and bf16/fp16 only, a clear error
otherwise); ``NOSA_KERNELS=reference`` still forces the reference. Every op validates shapes and
dtypes before it launches and raises ValueError naming the argument. The one module of nosa/ that
imports kernels/ (nosa/bench's kernel benchmarks aside; import nosa does not load it).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence

import torch

from nosa import env, select
from nosa.kernels import flashinfer_decode, recall, resolve_cpu, select_cpu, sparse_decode, sparse_prefill
from nosa.kernels import slot_decode as slot_kernel
from nosa.kvquant import QuantizedItems


def backend(*tensors: torch.Tensor) -> str:
    """"triton" or "reference" for an op whose tensor arguments are ``tensors``."""
    choice = env.choice("NOSA_KERNELS")
    if choice == "reference":
        return "reference"
    on_cuda = any(t.is_cuda for t in tensors)
    if choice == "triton" and not on_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("NOSA_KERNELS=triton with CPU tensors needs TRITON_INTERPRET=1 (set before triton is "
                         "imported); unset NOSA_KERNELS to use the torch reference on CPU")
    return "triton" if (on_cuda or choice == "triton") else "reference"


def decode_impl() -> str:
    """$NOSA_DECODE_IMPL: "triton" (default) or "flashinfer", the slot decode used where kernels run."""
    return env.choice("NOSA_DECODE_IMPL")


# ---- recall ---------------------------------------------------------------------------------------
_COPIERS: dict[tuple, object] = {}


def copy_items(dst: Sequence[torch.Tensor], src: Sequence[torch.Tensor], dst_idx: torch.Tensor,
               src_idx: torch.Tensor) -> None:
    """Copy item src_idx[m] -> dst_idx[m] of every pair (dst[i], src[i]) where src_idx[m] >= 0.

    Items are along dim 0 (e.g. k_dev [S, B, D] <- k_host [P*Hkv, B, D], cis_dev [S, B] <- cis_host
    [P*Hkv, B]); dst_idx, src_idx [M] int64, padded with -1. CUDA: one Triton launch for all pairs,
    src or dst may be pinned host memory. CPU: index_select / index_copy_ through preallocated,
    cache-resident staging (nosa.kernels.recall.ItemCopier, one kept per item layout and thread).
    On CUDA, host tensors must be pinned; index lists may be on the host (they are moved).
    A source may be a nosa.kvquant.QuantizedItems (a quantized host pool, NOSA_HOST_KV_DTYPE): its
    items are dequantized into the destination's dtype on the way, in the same launch on CUDA
    (nosa.kernels.recall.copy_items_dequant_triton), by the C++ loop on CPU.

    One operator, ``torch.ops.nosa.copy_items`` (it mutates ``dst``), so that torch.compile keeps
    it whole inside a compiled decode step (fixed shapes outside; on CPU the -1 entries are left
    out inside) and a CUDA graph records its one launch. Eager callers (a CUDA graph capture
    included) skip the operator's dispatch and run the same implementation directly: the
    dispatcher cost about 90 us per call on CPU, more than a warm step's whole recall. Indices are
    trusted (no host reads): set NOSA_DEBUG_CHECKS=1 to check their bounds on every call."""
    if any(isinstance(t, QuantizedItems) for t in src):  # a quantized host pool: dequantize on the way
        if torch.compiler.is_compiling():
            torch.ops.nosa.copy_items_dequant(list(dst), [getattr(t, "data", t) for t in src],
                                              [getattr(t, "scale", _NO_SCALE) for t in src],
                                              [_factor_arg(t) for t in src], dst_idx, src_idx)
        else:
            _copy_items_dequant(dst, src, dst_idx, src_idx)
    elif torch.compiler.is_compiling():
        torch.ops.nosa.copy_items(list(dst), list(src), dst_idx, src_idx)
    else:
        _copy_items(dst, src, dst_idx, src_idx)


def _copy_items_dequant(dst, src, dst_idx, src_idx) -> None:
    """``copy_items`` with some sources nosa.kvquant.QuantizedItems: the Triton kernel on CUDA, the
    C++ loop of nosa.kernels.resolve_cpu on CPU (bf16 / float32 destinations), else the reference
    (gather, dequantize, scatter)."""
    tensors = (*dst, *(getattr(t, "data", t) for t in src))
    if backend(*tensors) == "triton":
        recall.copy_items_dequant_triton(dst, src, dst_idx, src_idx)
    elif resolve_cpu.wanted_here(*tensors, dst_idx, src_idx) and all(d.dtype in resolve_cpu.DEQUANT_OUT for d in dst):
        resolve_cpu.copy_items_dequant(list(dst), list(src), dst_idx, src_idx)  # the C++ loop
    else:
        recall.copy_items_dequant_reference(dst, src, dst_idx, src_idx)


def _copy_items(dst: Sequence[torch.Tensor], src: Sequence[torch.Tensor], dst_idx: torch.Tensor,
                src_idx: torch.Tensor) -> None:
    """The implementation behind ``copy_items`` and its operator."""
    if backend(*dst, *src) == "triton":
        recall.copy_items_triton(dst, src, dst_idx, src_idx)
        return
    if any(t.is_cuda for t in (*dst, *src)):  # NOSA_KERNELS=reference on a GPU
        recall.copy_items_reference(dst, src, dst_idx, src_idx)
        return
    if resolve_cpu.wanted_here(*dst, *src, dst_idx, src_idx):  # one memcpy per item (the CPU kernel)
        if recall.debug_checks():
            recall.check_bounds(dst, src, dst_idx, src_idx)
        resolve_cpu.copy_items(list(dst), list(src), dst_idx, src_idx)  # checks the buffers once per pair
        return
    # one copier (staging buffers) per item layout and thread: staging must not be shared by two calls
    key = (threading.get_ident(), *((tuple(t.shape[1:]), t.dtype) for t in dst))
    copier = _COPIERS.get(key)
    if copier is None:
        copier = _COPIERS[key] = recall.ItemCopier(dst)
    copier.copy(dst, src, dst_idx, src_idx)


@torch.library.custom_op("nosa::copy_items", mutates_args=("dst",))
def _copy_items_op(dst: list[torch.Tensor], src: list[torch.Tensor], dst_idx: torch.Tensor,
                   src_idx: torch.Tensor) -> None:
    _copy_items(dst, src, dst_idx, src_idx)


@_copy_items_op.register_fake
def _(dst, src, dst_idx, src_idx) -> None:
    return None


_NO_SCALE = torch.empty(0)  # the operator's scale (factor) of a pair copied as it is (without factors)


def _factor_arg(src) -> torch.Tensor:
    """The operator's factor argument of a source: its key factors, or _NO_SCALE."""
    factor = getattr(src, "factor", None)
    return _NO_SCALE if factor is None else factor


@torch.library.custom_op("nosa::copy_items_dequant", mutates_args=("dst",))
def _copy_items_dequant_op(dst: list[torch.Tensor], data: list[torch.Tensor], scale: list[torch.Tensor],
                           factor: list[torch.Tensor], dst_idx: torch.Tensor, src_idx: torch.Tensor) -> None:
    src = [t if c.numel() == 0 else QuantizedItems(t, c, d.dtype, f if f.numel() else None)
           for d, t, c, f in zip(dst, data, scale, factor)]
    _copy_items_dequant(dst, src, dst_idx, src_idx)


@_copy_items_dequant_op.register_fake
def _(dst, data, scale, factor, dst_idx, src_idx) -> None:
    return None


# ---- decode ---------------------------------------------------------------------------------------
def select_blocks(query_scores: torch.Tensor, evict_scores: torch.Tensor, positions: torch.Tensor, cfg,
                  branch_free: bool = False) -> torch.Tensor:
    """nosa.select.select_blocks (the spec; same arguments and result) for a serving decode step: the
    C++ kernel on CPU tensors in an eager step (nosa.kernels.select_cpu: the same blocks, without a
    hundred small ops over every block of the context), else the torch code (on CUDA, and in a step
    torch.compile traces)."""
    if select_cpu.wanted_here(query_scores, evict_scores, positions):
        return select_cpu.select_blocks(query_scores, evict_scores, positions, cfg)
    return select.select_blocks(query_scores, evict_scores, positions, cfg, branch_free)


def slot_decode(q, k_dev, v_dev, cis_dev, slots, fill, scale: float, num_splits: int | None = None):
    """Decode attention over the device block cache: q [R, Hq, D], k_dev/v_dev [S, B, D], cis_dev
    [S, B] fp32, slots [R, Hkv, NS] int64 (-1 unused), fill [R, Hkv, NS] int32 -> (out [R, Hq, Dv],
    lse [R, Hq] fp32). See nosa.kernels.slot_decode; NOSA_DECODE_IMPL=flashinfer runs it through
    nosa.kernels.flashinfer_decode instead (num_splits is then FlashInfer's choice)."""
    kind = backend(q, k_dev)
    if decode_impl() == "flashinfer" and env.choice("NOSA_KERNELS") != "reference":
        return flashinfer_decode.slot_decode_flashinfer(q, k_dev, v_dev, cis_dev, slots, fill, scale)
    if kind == "triton":
        return slot_kernel.slot_decode(q, k_dev, v_dev, cis_dev, slots, fill, scale, num_splits)
    return slot_kernel.slot_decode_reference(q, k_dev, v_dev, cis_dev, slots, fill, scale)


def paged_sparse_decode(q, k_pool, v_pool, cis_pool, token_table, selection, seq_lens, block_size: int,
                        scale: float):
    """Decode attention over the selected blocks of a paged token pool (offloading off): q [B, Hq, D],
    k_pool/v_pool [N, Hkv, D], cis_pool [N, Hkv], token_table [B, T] int32, selection [B, Hkv, K]
    int32, seq_lens [B] int32 -> (out [B, Hq, D], lse [B, Hq] fp32). See nosa.kernels.sparse_decode."""
    triton = backend(q, k_pool) == "triton"
    fn = sparse_decode.sparse_decode if triton else sparse_decode.sparse_decode_reference
    return fn(q, k_pool, v_pool, cis_pool, token_table, selection, seq_lens, block_size, scale, return_lse=True)


# ---- prefill / training ---------------------------------------------------------------------------
def sparse_prefill_attention(q, k, v, cis, sel, positions, block_size: int, scale: float):
    """Block-sparse attention of query rows over their selected blocks, differentiable in q, k, v,
    cis: q [n, Hq, D], k/v [L, Hkv, D], cis [L, Hkv], sel [n, Hkv, K] (-1 padded), positions [n]
    -> (out [n, Hq, Dv], lse [n, Hq] fp32). See nosa.kernels.sparse_prefill."""
    if backend(q, k) == "triton":
        return sparse_prefill.sparse_prefill(q, k, v, cis, sel, positions, block_size, scale)
    return sparse_prefill.sparse_prefill_reference(q, k, v, cis, sel, positions, block_size, scale)


def use_kernels(*tensors: torch.Tensor) -> bool:
    """Whether ops on these tensors run Triton kernels (for call sites that keep a faster CPU path)."""
    return backend(*tensors) == "triton"
