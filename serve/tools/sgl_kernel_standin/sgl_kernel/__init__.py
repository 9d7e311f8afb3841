"""A pure-torch stand-in for ``sgl_kernel``'s CPU helpers (SGLang 0.5.23, SGLANG_USE_CPU_ENGINE=1).

SGLang's CPU engine imports a few ``*_cpu`` helpers from ``sgl_kernel`` at module level; their real
home is the Intel CPU build of sgl-kernel, which is not on PyPI. scripts/install_sglang_cpu.sh puts
the folder holding this package on ``sys.path`` (a .pth file) only when no real ``sgl_kernel`` is
importable. Helpers SGLang can reach in plain (non-speculative) serving are implemented in torch;
the rest raise NotImplementedError naming the function.

Deliberately absent: ``torch.ops.sgl_kernel.convert_weight_packed``. SGLang's cpu_has_amx_support()
looks for it; without it norms, activations and rotary embeddings take their forward_native paths.
Declared without a kernel: the operators SGLang's CPU graph runner registers fakes for
(``GRAPH_RUNNER_OPS``), so ``--enable-torch-compile`` starts.
"""

from __future__ import annotations

import ctypes

import torch

__version__ = "0.0.0+nosa.cpu.standin"
IS_NOSA_STANDIN = True


def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """req_to_token[req_pool_indices[i], start[i]:end[i]] = the next end[i]-start[i] entries of
    out_cache_loc (requests in order). req_to_token [rows, pool_len] int32; others [B] / [N]."""
    del pool_len  # the row length of req_to_token, implied by its shape
    rows = req_pool_indices.tolist()
    starts = start_offset.tolist()
    ends = end_offset.tolist()
    offset = 0
    for row, start, end in zip(rows, starts, ends):
        n = end - start
        if n > 0:
            req_to_token[row, start:end] = out_cache_loc[offset : offset + n].to(req_to_token.dtype)
        offset += n


def copy_all_layer_kv_cache_cpu(
    data_ptrs: torch.Tensor, strides: torch.Tensor, tgt_loc: torch.Tensor, src_loc: torch.Tensor
) -> None:
    """For every buffer b (base address data_ptrs[b], row size strides[b] bytes): copy row src_loc[i]
    to row tgt_loc[i]. Sources are read before any target is written (safe in place)."""
    if tgt_loc.numel() == 0:
        return
    tgt = tgt_loc.long().cpu()
    src = src_loc.long().cpu()
    rows = int(torch.maximum(tgt.max(), src.max())) + 1
    for ptr, stride in zip(data_ptrs.tolist(), strides.tolist()):
        raw = (ctypes.c_uint8 * (rows * int(stride))).from_address(int(ptr))
        buf = torch.frombuffer(raw, dtype=torch.uint8).view(rows, int(stride))
        buf[tgt] = buf[src]


def _not_implemented(name: str):
    def helper(*args, **kwargs):
        raise NotImplementedError(
            f"sgl_kernel.{name} is not implemented by nosa's CPU stand-in of sgl_kernel "
            "(speculative decoding and the intel_amx backend are not supported on this route)"
        )

    helper.__name__ = name
    return helper


# Imported at module level by SGLang's CPU engine, called only by speculative decoding / intel_amx.
for _name in (
    "assign_draft_cache_locs_contiguous_cpu",
    "assign_extend_cache_locs_cpu",
    "build_draft_decode_metadata_cpu",
    "build_tree_kernel_efficient_cpu",
    "fill_accept_out_cache_loc_cpu",
    "fill_bonus_tokens_cpu",
    "rotate_input_ids_cpu",
    "verify_tree_greedy_cpu",
):
    globals()[_name] = _not_implemented(_name)
del _name

# SGLang's CPU graph runner (--enable-torch-compile) registers fake implementations for these
# sgl_kernel operators (sglang/srt/model_executor/cpu_graph_runner.py, register_fake_ops), which
# raises "operator sgl_kernel::shm_allreduce does not exist" at start-up unless each one exists.
# The stand-in declares them without arguments and without a kernel: SGLang's native paths never
# call them (no AMX), so a call would be a bug and fails on the schema.
GRAPH_RUNNER_OPS = (
    "shm_allreduce", "bmm_cpu", "fused_add_rmsnorm_cpu", "decode_attention_cpu", "extend_attention_cpu",
    "gemma_fused_add_rmsnorm_cpu", "layernorm_cpu", "fused_add_layernorm_cpu", "multimodal_rotary_embedding_cpu",
    "apply_multidimensional_rope_cpu", "fused_sigmoid_mul_cpu", "rmsnorm_cpu", "l2norm_cpu", "fused_experts_cpu",
    "fused_rmsnorm_gated_cpu", "shared_expert_cpu", "causal_conv1d_update_cpu", "causal_conv1d_fwd_cpu",
    "gemma_rmsnorm_cpu", "gemma3_rmsnorm_cpu", "gemma4_rmsnorm_cpu", "fused_dual_residual_rmsnorm_cpu",
    "fused_qk_gemma_rmsnorm_cpu", "fused_qk_gemma_rmsnorm_with_gate_cpu", "fused_qk_rmsnorm_cpu",
    "fused_qk_rmsnorm_sumsq_cpu", "fused_qk_rmsnorm_apply_from_stats_cpu", "shm_allgather", "qkv_proj_with_rope",
    "rotary_embedding_cpu", "apply_rotary_pos_emb_cpu", "qkv_proj_with_rope_fused_weight", "weight_packed_linear",
    "per_token_quant_int8_cpu", "int8_scaled_mm_cpu", "grouped_topk_cpu", "biased_grouped_topk_cpu",
    "topk_sigmoid_cpu", "fused_moe_router_cpu", "topk_softmax_cpu", "silu_and_mul_cpu", "gelu_tanh_and_mul_cpu",
    "gelu_and_mul_cpu", "int8_scaled_mm_with_quant", "fp8_scaled_mm_cpu", "fp8_per_tensor_scaled_mm_cpu",
    "mxfp4_scaled_mm_cpu", "int4_scaled_mm_cpu", "fused_linear_sigmoid_mul", "fused_qkvzba_split_reshape_cat_cpu",
    "fused_qkvzba_split_reshape_cat_contiguous_cpu", "fused_input_proj_cpu",
    "fused_sigmoid_gating_delta_rule_update_cpu", "fused_gdn_gating_cpu", "chunk_gated_delta_rule_cpu",
)
_LIB = torch.library.Library("sgl_kernel", "FRAGMENT")
for _op in GRAPH_RUNNER_OPS:
    if not hasattr(torch.ops.sgl_kernel, _op):
        _LIB.define(f"{_op}() -> ()")
del _op
