"""The planner's model (``python -m nosa.plan``, whose help derives each formula): model, GPU and
link shapes with their presets, and one decode step's memory, bytes and times for dense, nosa and
nosa with offloading (``plan``), the largest batch and throughput (``best_throughput``), the batch a
request rate keeps decoding (``batch_for_rate``) and where recall hides (``shares_where_recall_hides``)."""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass

import torch

from nosa import kvquant
from nosa.config import NosaConfig


@dataclass(frozen=True)
class ModelShape:
    name: str
    layers: int
    q_heads: int
    kv_heads: int
    head_dim: int
    params: float  # parameters (weights read once per step, 2 FLOPs each per token)


@dataclass(frozen=True)
class Gpu:
    name: str
    memory_bytes: float
    hbm_bytes_per_s: float
    bf16_flops_per_s: float  # dense tensor-core peak


@dataclass(frozen=True)
class Link:
    name: str
    bytes_per_s: float  # one direction, x16
    efficiency: float = 0.85  # share of it a pinned copy reaches (measured on the H200: gpu_check.sh)


MODELS = {  # from the models' config.json
    "llama-3.2-1b": ModelShape("llama-3.2-1b", 16, 32, 8, 64, 1.24e9),
    "llama-3.1-8b": ModelShape("llama-3.1-8b", 32, 32, 8, 128, 8.03e9),
    "qwen3-8b": ModelShape("qwen3-8b", 36, 32, 8, 128, 8.19e9),
    "llama-3.1-70b": ModelShape("llama-3.1-70b", 80, 64, 8, 128, 70.6e9),
}
GPUS = {  # vendors' data sheets: memory, HBM bandwidth, dense bf16
    "h100": Gpu("H100 SXM", 80e9, 3.35e12, 989e12),
    "h200": Gpu("H200 SXM", 141e9, 4.8e12, 989e12),
    "a100": Gpu("A100 80GB SXM", 80e9, 2.04e12, 312e12),
    "a800": Gpu("A800 80GB PCIe", 80e9, 1.94e12, 312e12),
    "l40s": Gpu("L40S", 48e9, 0.864e12, 362e12),
    "rtx4090": Gpu("RTX 4090", 24e9, 1.008e12, 165e12),
}
LINKS = {"pcie4": Link("PCIe Gen4 x16", 32e9), "pcie5": Link("PCIe Gen5 x16", 64e9)}
ACTIVATION_RESERVE = 0.10  # share of device memory kept for activations, CUDA graphs and the allocator


def model_from_config(path: str) -> ModelShape:
    """A ModelShape from an HF config.json (parameters estimated from its matrices)."""
    with open(path) as f:
        c = json.load(f)
    c = c.get("text_config", c)
    hidden, layers, inter = c["hidden_size"], c["num_hidden_layers"], c["intermediate_size"]
    hq = c["num_attention_heads"]
    hkv = c.get("num_key_value_heads", hq)
    d = c.get("head_dim") or hidden // hq
    attn = hidden * d * (hq + 2 * hkv) + hq * d * hidden
    embeddings = c["vocab_size"] * hidden * (1 if c.get("tie_word_embeddings") else 2)
    params = layers * (attn + 3 * hidden * inter) + embeddings
    return ModelShape(os.path.basename(os.path.dirname(os.path.abspath(path))) or path, layers, hq, hkv, d, params)


def nosa_config_for(context: int, share: int | None, cfg: NosaConfig | None) -> NosaConfig:
    """The given NosaConfig, or the released structure scaled to 1/``share`` of the context's blocks."""
    if cfg is not None:
        return cfg
    base = NosaConfig()
    if share is None:
        return base
    budget = max(base.sink_blocks + base.window_blocks + 1, math.ceil(context / base.block_size / share))
    picks = max(1, round(budget * base.query_blocks / base.topk_blocks))
    return NosaConfig(topk_blocks=budget, query_blocks=min(picks, budget - base.sink_blocks - base.window_blocks))


def plan(model: ModelShape, context: int, batch: int, gpu: Gpu, link: Link, cfg: NosaConfig,
         dtype_bytes: int = 2, host_kv_dtype: torch.dtype = torch.bfloat16, hit_rate: float | None = None,
         extra_slots: int = 0, recall_share_of_copy: float = 0.88, output: int = 0,
         attention_efficiency: dict[str, float] | None = None) -> dict:
    """The plan of one decode step at context ``context`` (all figures per the whole model)."""
    if context < 1 or batch < 1:
        raise ValueError(f"plan: context and batch must be >= 1 (got {context}, {batch})")
    if hit_rate is not None and not 0 <= hit_rate <= 1:
        raise ValueError(f"plan: hit_rate must be in [0, 1], got {hit_rate}")
    L, hkv, d, e = model.layers, model.kv_heads, model.head_dim, dtype_bytes
    tokens = context + output  # the KV at the end of the reply
    kv_token_bytes = 2 * hkv * d * e * L  # K and V of one token, every layer
    cis_token_bytes = 4 * hkv * L  # its eviction score (float32)
    # the selection state (nosa.state_pool): float32 compressed keys per window, 2 float32 per block
    state_bytes = L * hkv * (math.ceil(tokens / cfg.compress_stride) * d * 4 + math.ceil(tokens / cfg.block_size) * 8)
    budget_tokens = min(tokens, cfg.topk_blocks * cfg.block_size)
    slot_tokens = min(tokens, (cfg.topk_blocks + extra_slots) * cfg.block_size)
    device = {
        "dense": kv_token_bytes * tokens,
        "nosa": (kv_token_bytes + cis_token_bytes) * tokens + state_bytes,
        "nosa_offload": (kv_token_bytes + cis_token_bytes) * slot_tokens + state_bytes,
    }
    host_token_bytes = L * hkv * kvquant.bytes_per_token(d, d, host_kv_dtype)
    weights = model.params * e
    free = gpu.memory_bytes * (1 - ACTIVATION_RESERVE) - weights
    max_batch = {k: max(0, int(free // v)) for k, v in device.items()}
    # one step: weights once, the KV read, the compressed keys scored (nosa)
    hbm = gpu.hbm_bytes_per_s
    flops_s = 2 * model.params * batch / gpu.bf16_flops_per_s
    read = {"dense": batch * kv_token_bytes * tokens,
            "nosa": batch * (kv_token_bytes * budget_tokens + L * hkv * d * 4 * tokens / cfg.compress_stride)}
    eff = {"dense": 1.0, "nosa": 1.0, **(attention_efficiency or {})}  # measured share of the roofline
    step = {k: max(flops_s, weights / hbm + v / (hbm * eff[k])) for k, v in read.items()}
    # recall: blocks entering per request and KV head per step
    bound = cfg.query_blocks + 1
    entering = bound if hit_rate is None else min(bound, (1 - hit_rate) * cfg.topk_blocks)
    if tokens <= cfg.dense_len or tokens <= cfg.topk_blocks * cfg.block_size:
        entering = 0.0  # the whole context fits the budget: nothing to recall after the prefill
    recall_bytes = batch * L * hkv * entering * cfg.block_size * kvquant.bytes_per_token(d, d, host_kv_dtype)
    link_rate = link.bytes_per_s * link.efficiency * recall_share_of_copy
    recall_s = recall_bytes / link_rate
    hides = recall_s <= step["nosa"]  # per layer the same ratio: both are sums of equal layers
    offload_step = step["nosa"] + max(0.0, recall_s - step["nosa"])
    return {
        "model": asdict(model), "gpu": asdict(gpu), "link": asdict(link), "nosa_config": cfg.to_dict(),
        "context": context, "output": output, "batch": batch, "host_kv_dtype": str(host_kv_dtype)[6:],
        "device_bytes_per_request": device, "host_bytes_per_request": host_token_bytes * tokens,
        "weights_bytes": weights, "max_batch": max_batch,
        "device_bytes_total": {k: v * batch + weights for k, v in device.items()},
        "host_bytes_total": host_token_bytes * tokens * batch,
        "blocks_entering_per_head": entering, "recall_bytes_per_step": recall_bytes,
        "recall_s": recall_s, "step_s": {**step, "nosa_offload": offload_step}, "compute_s": flops_s,
        "recall_hides": hides,
        "tokens_per_s": {"dense": batch / step["dense"], "nosa": batch / step["nosa"],
                         "nosa_offload": batch / offload_step},
    }


def best_throughput(model: ModelShape, context: int, gpu: Gpu, link: Link, cfg: NosaConfig, **kw) -> dict:
    """Per mode (dense, nosa, nosa_offload): the largest batch that fits the device and the decode
    tokens/s at it (what a throughput figure at "as many requests as fit" compares)."""
    one = plan(model, context, 1, gpu, link, cfg, **kw)
    out = {}
    for mode, batch in one["max_batch"].items():
        if batch < 1:
            out[mode] = {"batch": 0, "tokens_per_s": 0.0}
            continue
        tokens_per_s = plan(model, context, batch, gpu, link, cfg, **kw)["tokens_per_s"][mode]
        out[mode] = {"batch": batch, "tokens_per_s": tokens_per_s}
    return out


def batch_for_rate(rate: float, output: int, model: ModelShape, context: int, gpu: Gpu, link: Link, cfg: NosaConfig,
                   mode: str = "nosa_offload", **kw) -> int:
    """The requests decoding at once at ``rate`` requests/s: the smallest batch B with B >= rate x
    output x step(B) (Little's law: each request decodes ``output`` steps of the step time at that
    batch), by bisection up to the largest batch that fits; ValueError naming the highest rate that
    fits when the rate needs more."""
    if rate <= 0 or output < 1:
        raise ValueError(f"plan: --rate needs a positive rate and --output >= 1 (got {rate}, {output})")

    def step(batch: int) -> float:
        return plan(model, context, batch, gpu, link, cfg, output=output, **kw)["step_s"][mode]

    top = plan(model, context, 1, gpu, link, cfg, output=output, **kw)["max_batch"][mode]
    if top < 1 or top < rate * output * step(top):
        most = top / (output * step(top)) if top >= 1 else 0.0
        raise ValueError(f"plan: {rate:g} requests/s do not fit: at most {top} requests fit the device "
                         f"({mode}), which sustain {most:.3g} requests/s")
    lo, hi = 1, top
    while lo < hi:
        mid = (lo + hi) // 2
        if mid >= rate * output * step(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo


def hit_rate_of(report: dict) -> float:
    """The device cache hit rate of a bench_longctx / RULER report (results/longctx.json, ruler.json):
    the mean over its NOSA variants' results (a cache of exactly the budget)."""
    rates = [r["hit_rate"] for r in report.get("results", []) if r.get("share") and r.get("hit_rate") is not None]
    if not rates:
        raise ValueError("plan: the report has no NOSA results with a hit_rate (a bench_longctx / RULER JSON)")
    return sum(rates) / len(rates)


SHARES = (2, 4, 8, 16, 32, 64)


def shares_where_recall_hides(model, context, batch, gpu, link, dtype_bytes=2, host_kv_dtype=torch.bfloat16,
                              hit_rate=None, recall_share_of_copy=0.88, attention_efficiency=None) -> dict[int, bool]:
    """{s: whether recall hides} at budgets of 1/s of the context's blocks (the released structure
    scaled, ``nosa_config_for``). A smaller budget shortens the step (less KV read) and, at a given
    hit rate, recalls fewer blocks; under the locality bound the blocks entering follow the free
    picks, which scale with the budget too."""
    return {s: plan(model, context, batch, gpu, link, nosa_config_for(context, s, None), dtype_bytes, host_kv_dtype,
                    hit_rate, recall_share_of_copy=recall_share_of_copy,
                    attention_efficiency=attention_efficiency)["recall_hides"] for s in SHARES}
