"""The tile math the attention kernels share (slot_decode, sparse_decode, sparse_prefill): dot
products by dtype, the online softmax over tiles of keys and the rows of a prefill query tile, as
@triton.jit device functions that Triton inlines into each kernel (the PTX is the same as with
the code written out in each kernel).

This module imports triton, so the kernel modules import it only where triton is needed anyway:
inside their ``kernels()`` builders (as module globals: the interpreter resolves a kernel's
names there) and their ``*_plan`` functions. Importing a kernel module (for its torch reference,
on a machine without triton) never loads it.

Shapes inside a kernel: M query rows of a tile (the G query heads of a KV head, times the query
tokens of a prefill tile), T keys of a tile, Dv value dim; all running statistics in fp32.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl


def exact_products(dtype: torch.dtype) -> bool:
    """The ``IEEE`` constexpr of a launch: exact fp32 dot products for fp32 inputs (tf32 would lose
    3 digits), and always under TRITON_INTERPRET=1, whose bf16/fp16 dot returns garbage (triton
    3.8): the tensor-core path is checked by the AOT compile and on a GPU only."""
    return dtype == torch.float32 or os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def dot(a, b, IEEE: tl.constexpr):
    """a @ b with fp32 accumulation: exact fp32 products when IEEE, else tensor-core products in
    b's dtype (a is cast to it, e.g. fp32 probabilities against bf16 values)."""
    if IEEE:
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        out = tl.dot(a.to(b.dtype), b)
    return out


@triton.jit
def tile_rows(tile, h, r, N, GROUP: tl.constexpr, TQ: tl.constexpr):
    """The matrix rows r (tl.arange(0, M)) of a prefill program, query tile ``tile`` of TQ tokens
    and KV head h: matrix row = (token of the tile, query head of the group). Returns (token row
    [M] int64, query head [M], whether the matrix row is a real (token, head) of the N rows)."""
    row = (tile * TQ + r // GROUP).to(tl.int64)
    return row, h * GROUP + r % GROUP, (r < TQ * GROUP) & (row < N)


@triton.jit
def softmax_step(s, v, m, denom, acc, IEEE: tl.constexpr):
    """Fold one tile of keys into an online softmax: logits s [M, T] (-inf for a key to skip) and
    values v [T, Dv] into the running max m [M], denominator denom [M] and unnormalised output
    acc [M, Dv]. Returns the new (m, denom, acc)."""
    m_new = tl.maximum(m, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # no valid key yet: exp(-inf - 0) keeps zeros
    alpha = tl.exp(m - m_safe)
    p = tl.exp(s - m_safe[:, None])
    return m_new, denom * alpha + tl.sum(p, 1), acc * alpha[:, None] + dot(p, v, IEEE)


@triton.jit
def softmax_result(m, denom, acc):
    """(out [M, Dv], lse [M]) of an online softmax; a row with no valid key gets out 0 and lse -inf,
    so results over disjoint key sets merge exactly (nosa.attention.math.merge_attention)."""
    has = denom > 0
    safe = tl.where(has, denom, 1.0)
    out = tl.where(has[:, None], acc / safe[:, None], 0.0)
    lse = tl.where(has, m + tl.log(safe), float("-inf"))
    return out, lse
