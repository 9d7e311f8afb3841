"""Decode over the device block cache through FlashInfer's paged decode (the FlashInfer option of
nosa.ops.slot_decode, chosen with NOSA_DECODE_IMPL=flashinfer).

Inputs as nosa.kernels.slot_decode: k_dev/v_dev [S, B, D], cis_dev [S, B] fp32, slots [R, Hkv, NS]
(-1 unused), fill [R, Hkv, NS]; q [R, Hq, D]. NOSA selects per KV head, so the KV heads are folded
into FlashInfer's batch: every slot is a page of one KV head (the cache viewed as [S, B, 1, D]),
batch row b = r * Hkv + h with the G query heads of its group (q viewed as [R * Hkv, G, D]), and
every row lists all NS slots (a static page table: one plan() per batch shape, CUDA-graph
friendly). A custom JIT variant (VARIANT_DECL) adds cis_j to the logit and masks by fill. Returns
(out, lse) with lse in natural log, -inf and out 0 for a row with no valid token. Supported:
bf16/fp16, D == Dv, G in FOLDABLE_GROUPS. flashinfer is imported only on the CUDA path
(``require_flashinfer``); the rest is pure torch, tested on CPU through ``paged_decode_reference``.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass

import torch

from nosa.kernels.slot_decode import check_inputs
from nosa.layout import NEG_INF

FLASHINFER_VERSION = "0.7.2.post1"  # the version whose jit_args layout and variant API this follows
FOLDABLE_GROUPS = (1, 2, 3, 4, 6, 8, 16)  # FlashInfer's DISPATCH_GQA_GROUP_SIZE
_DTYPES = (torch.bfloat16, torch.float16)
LN2 = math.log(2.0)

VARIANT_NAME = "NosaSlotDecode"
TENSOR_NAMES = ["nosa_cis", "nosa_fill"]  # per-token cis [S * B] fp32; per-page fill [rows * NS] int32
TENSOR_DTYPES = ["float", "int32_t"]
SCALAR_NAMES = ["sm_scale"]
SCALAR_DTYPES = ["double"]

# The decode kernel calls LogitsTransform on the raw q.k and then multiplies by sm_scale_log2; the
# variant returns scale * q.k + cis (natural units) and sets sm_scale_log2 = log2(e). kv_idx is the
# token's position in the row's page list (page = kv_idx / B, offset = kv_idx % B); positions past
# the row's length (tile padding, masked afterwards) must not index the tables.
VARIANT_DECL = r"""
struct NosaSlotDecode : AttentionVariantBase {
  static constexpr bool use_softmax = true;
  uint32_t window_left, qo_len, kv_len, row_start;
  float sm_scale_log2, scale;

  template <typename Params>
  __device__ __host__ NosaSlotDecode(const Params& params, uint32_t batch_idx, uint8_t* smem_ptr) {
    qo_len = 1;
    kv_len = params.get_kv_len(batch_idx);
    window_left = kv_len;
    row_start = params.paged_kv.indptr[batch_idx];
    scale = float(params.sm_scale);
    sm_scale_log2 = math::log2e;
  }

  REGISTER_LOGITS_TRANSFORM(params, logits, batch_idx, qo_idx, kv_idx, qo_head_idx, kv_head_idx, {
    float bias = 0.f;
    if (kv_idx < kv_len) {
      uint32_t page, offset;
      params.paged_kv.page_size.divmod(kv_idx, page, offset);
      const size_t slot = static_cast<size_t>(params.paged_kv.indices[row_start + page]);
      bias = params.nosa_cis[slot * uint32_t(params.paged_kv.page_size) + offset];
    }
    return logits * scale + bias;
  })

  REGISTER_LOGITS_MASK(params, batch_idx, qo_idx, kv_idx, qo_head_idx, kv_head_idx, {
    if (kv_idx >= kv_len) return false;
    uint32_t page, offset;
    params.paged_kv.page_size.divmod(kv_idx, page, offset);
    return offset < uint32_t(params.nosa_fill[row_start + page]);
  })
};
"""


def jit_args(dtype: torch.dtype, head_dim: int) -> tuple:
    """The `jit_args` of flashinfer.BatchDecodeWithPagedKVCacheWrapper (the positional arguments of
    flashinfer.jit.gen_customize_batch_decode_module) for this variant."""
    tag = {torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]
    return (f"nosa_slot_decode_{tag}_d{head_dim}", dtype, dtype, dtype, torch.int32, head_dim, head_dim,
            TENSOR_NAMES, TENSOR_DTYPES, SCALAR_NAMES, SCALAR_DTYPES, VARIANT_NAME, VARIANT_DECL)


@dataclass
class FoldedPages:
    """The folded problem: rows = R * Hkv batch rows of G query heads and one KV head each.

    q [rows, G, D] (a view of q), k_pages/v_pages [S, B, 1, D] (views of the cache), cis [S * B]
    fp32 (a view), indptr [rows + 1] int32 and last_page_len [rows] int32 on the HOST (static:
    b * NS and B), indices [rows * NS] int32 and page_fill [rows * NS] int32 on the cache's device."""

    q: torch.Tensor
    k_pages: torch.Tensor
    v_pages: torch.Tensor
    cis: torch.Tensor
    indptr: torch.Tensor
    indices: torch.Tensor
    last_page_len: torch.Tensor
    page_fill: torch.Tensor
    requests: int
    kv_heads: int
    slots_per_row: int

    @property
    def rows(self) -> int:
        return self.q.shape[0]

    @property
    def block(self) -> int:
        return self.k_pages.shape[1]


def fold(q, k_dev, v_dev, cis_dev, slots, fill) -> FoldedPages:
    """Fold (request, KV head) into the batch (module docstring). Shapes as nosa.ops.slot_decode."""
    check_inputs(q, k_dev, v_dev, cis_dev, slots, fill)
    q = q.contiguous()  # small; the caches are large and must already be contiguous
    for name, t in (("k_dev", k_dev), ("v_dev", v_dev), ("cis_dev", cis_dev)):
        if not t.is_contiguous():
            raise ValueError(f"flashinfer slot decode: {name} must be contiguous (it is viewed, never copied), "
                             f"strides {t.stride()}")
    if v_dev.shape[2] != k_dev.shape[2]:
        raise ValueError(f"flashinfer slot decode: FlashInfer's decode kernel needs Dv == D, got D={k_dev.shape[2]} "
                         f"and Dv={v_dev.shape[2]}")
    requests, hq, d = q.shape
    hkv, ns = slots.shape[1:]
    slot_count, block = k_dev.shape[:2]
    rows = requests * hkv
    used = slots >= 0
    return FoldedPages(
        q=q.view(rows, hq // hkv, d),
        k_pages=k_dev.view(slot_count, block, 1, d),
        v_pages=v_dev.view(slot_count, block, 1, d),
        cis=cis_dev.view(-1),
        indptr=torch.arange(rows + 1, dtype=torch.int32) * ns,
        indices=torch.where(used, slots, 0).to(torch.int32).view(-1),
        last_page_len=torch.full((rows,), block, dtype=torch.int32),
        page_fill=torch.where(used, fill, 0).to(torch.int32).view(-1),
        requests=requests, kv_heads=hkv, slots_per_row=ns)


def paged_decode_reference(pages: FoldedPages, scale: float):
    """A torch model of the FlashInfer kernel with the NOSA variant, reading only the folded page
    table: row b attends to the tokens of pages indices[indptr[b]:indptr[b+1]] (the last one
    holding last_page_len[b] tokens), token t of entry e kept iff t < page_fill[e], logit
    scale * q.k + cis. Returns what the kernel returns: (out [rows, G, Dv] in q.dtype, lse [rows, G]
    fp32 in LOG2 units, -inf for a row with no valid token)."""
    indptr, last = pages.indptr.tolist(), pages.last_page_len.tolist()
    block = pages.block
    outs, lses = [], []
    for b in range(pages.rows):
        entries = torch.arange(indptr[b], indptr[b + 1], device=pages.indices.device)
        ids = pages.indices[entries].long()
        offsets = torch.arange(block, device=ids.device)
        tokens = offsets[None, :] < pages.page_fill[entries, None]  # [n, B]
        if len(ids):
            tokens[-1] &= offsets < last[b]
        k = pages.k_pages[ids, :, 0].float().reshape(-1, pages.k_pages.shape[-1])
        v = pages.v_pages[ids, :, 0].float().reshape(-1, pages.v_pages.shape[-1])
        cis = pages.cis.view(-1, block)[ids].reshape(-1)
        logits = scale * (pages.q[b].float() @ k.T) + cis  # [G, n * B]
        logits = logits.masked_fill(~tokens.reshape(-1), NEG_INF)
        lse = torch.logsumexp(logits, dim=-1)
        p = torch.exp(logits - torch.where(torch.isfinite(lse), lse, 0.0)[:, None])
        outs.append(torch.nan_to_num(p @ v).to(pages.q.dtype))
        lses.append(lse / LN2)
    return torch.stack(outs), torch.stack(lses).float()


def unfold(out: torch.Tensor, lse_log2: torch.Tensor, requests: int, hq: int):
    """FlashInfer's (out [rows, G, Dv], log2 lse [rows, G]) -> (out [R, Hq, Dv], natural lse [R, Hq]):
    rows are (request, KV head) pairs in order and G heads each, so the views are exact. A row with
    no valid token gives lse -inf and out 0 whatever the kernel left there."""
    empty = ~torch.isfinite(lse_log2)
    lse = torch.where(empty, NEG_INF, lse_log2 * LN2)
    out = out.masked_fill(empty[..., None], 0.0)
    return out.reshape(requests, hq, out.shape[-1]), lse.reshape(requests, hq)


def require_flashinfer():
    """The flashinfer module, or RuntimeError saying how to get it (never called on CPU paths)."""
    try:
        import flashinfer  # optional: flashinfer (CUDA only; NOSA_DECODE_IMPL=flashinfer)
    except ImportError as e:
        raise RuntimeError(f"NOSA_DECODE_IMPL=flashinfer needs the flashinfer package ({e}); install it with "
                           f"`pip install flashinfer-python=={FLASHINFER_VERSION}` (CUDA only, JIT-compiles the NOSA "
                           "variant with nvcc on first use) or unset NOSA_DECODE_IMPL to use the Triton kernel") from e
    return flashinfer


def check_supported(q, k_dev) -> None:
    """ValueError naming what the FlashInfer path cannot take (dtype, device)."""
    if q.dtype not in _DTYPES:
        raise ValueError(f"NOSA_DECODE_IMPL=flashinfer supports {_DTYPES}, got {q.dtype}; use the Triton kernel "
                         "(unset NOSA_DECODE_IMPL) for other dtypes")
    if not (q.is_cuda and k_dev.is_cuda):
        raise ValueError(f"NOSA_DECODE_IMPL=flashinfer runs on CUDA tensors only, got q on {q.device} and the block "
                         f"cache on {k_dev.device}; unset NOSA_DECODE_IMPL (the default, triton) elsewhere")


_WORKSPACES: dict = {}
_PLANS: OrderedDict = OrderedDict()
_MAX_PLANS = 8  # batch shapes kept planned (each holds 8 MiB of int workspace on the device and the host)


class _Plan:
    """One planned FlashInfer wrapper per batch shape, in FlashInfer's CUDA-graph mode: the page
    table lives in buffers this object owns, so a call only copies the new indices and fills into
    them (device ops) and runs; plan() runs once per shape (it reads indptr on the host)."""

    def __init__(self, pages: FoldedPages, dtype: torch.dtype):
        fi = require_flashinfer()
        device, d = pages.k_pages.device, pages.k_pages.shape[-1]
        if device not in _WORKSPACES:  # split-KV scratch, shared: calls on one stream never overlap
            _WORKSPACES[device] = torch.zeros(128 << 20, dtype=torch.uint8, device=device)
        self.indptr = pages.indptr.to(device)
        self.indices = torch.zeros_like(pages.indices)
        self.fill = torch.zeros_like(pages.page_fill)
        self.last = pages.last_page_len.to(device)
        self.wrapper = fi.BatchDecodeWithPagedKVCacheWrapper(
            _WORKSPACES[device], "NHD", use_cuda_graph=True, paged_kv_indptr_buffer=self.indptr,
            paged_kv_indices_buffer=self.indices, paged_kv_last_page_len_buffer=self.last, backend="fa2",
            jit_args=list(jit_args(dtype, d)))
        self.wrapper.plan(pages.indptr, pages.indices, pages.last_page_len, pages.q.shape[1], 1, d, pages.block,
                          q_data_type=dtype, kv_data_type=dtype)

    def run(self, pages: FoldedPages, scale: float):
        self.indices.copy_(pages.indices)
        self.fill.copy_(pages.page_fill)
        return self.wrapper.run(pages.q, (pages.k_pages, pages.v_pages), pages.cis, self.fill, float(scale),
                                return_lse=True)


def slot_decode_flashinfer(q, k_dev, v_dev, cis_dev, slots, fill, scale: float):
    """nosa.ops.slot_decode through FlashInfer (CUDA, bf16/fp16): same arguments and result
    (out [R, Hq, Dv] in q.dtype, natural lse [R, Hq] fp32)."""
    check_supported(q, k_dev)
    pages = fold(q, k_dev, v_dev, cis_dev, slots, fill)
    group = pages.q.shape[1]
    if group not in FOLDABLE_GROUPS:
        raise ValueError(f"NOSA_DECODE_IMPL=flashinfer: GQA group {group} (Hq/Hkv) has no FlashInfer decode kernel "
                         f"(groups {FOLDABLE_GROUPS}); use the Triton kernel")
    key = (q.device, q.dtype, q.shape[-1], group, pages.rows, pages.slots_per_row, pages.block)
    plan = _PLANS.get(key)
    if plan is None:
        plan = _PLANS[key] = _Plan(pages, q.dtype)
        while len(_PLANS) > _MAX_PLANS:
            _PLANS.popitem(last=False)
    _PLANS.move_to_end(key)
    out, lse = plan.run(pages, scale)
    return unfold(out, lse, pages.requests, q.shape[1])
