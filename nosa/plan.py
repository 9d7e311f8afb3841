"""What a GPU deployment of nosa will need and reach: memory, PCIe traffic, whether recall hides.

    python -m nosa.plan --model llama-3.1-8b --context 131072 --gpu h100 --link pcie5 --batch 16
    python -m nosa.plan --model path/to/config.json --context 32768 --share 8 --host-kv-dtype int8 --json

A roofline model of one decode step, per layer and summed over the layers; every quantity carries
its unit in its name (``_bytes``, ``_s``, ``_per_s``). For a batch of B requests at context T:

- KV bytes per token (one layer): ``2 * Hkv * D * e`` (K and V, e bytes per element); a NOSA host
  pool adds per (token, KV head) 4 bytes of eviction score and, quantized, 2 x 4 bytes of scales
  (nosa.kvquant.bytes_per_token).
- Device memory per request: dense, the whole KV (T tokens); nosa without offloading the same plus
  an eviction score per token and KV head (4 bytes) and the selection state (nosa.state_pool: per
  layer and KV head, T / stride compressed keys of D float32, 2 float32 per block); nosa with
  offloading only ``slots = topk_blocks + extra`` blocks of KV and scores per KV head plus the
  selection state, the rest in the host pool.
- The step's HBM time: the weights once (P x e bytes) plus the KV the attention reads (dense: B x T
  tokens; nosa: B x min(T, topk_blocks x block_size) tokens, plus the compressed keys it scores),
  over the HBM bandwidth (the attention's share of it measured by ``--calibration``: the kernels
  reach part of the roofline); its compute time 2 x P x B FLOPs over the peak; the step takes the
  larger (``max``: decode is memory-bound at small batches).
- Recall per step: the blocks that enter a request's selection, per KV head, at most
  ``query_blocks + 1`` (the locality theorem) or ``(1 - hit_rate) x topk_blocks`` when a hit rate is
  given (measured: a NOSA_SERVE_STATS_FILE, or bench_longctx's JSON), times Hkv, L and B, each block
  ``block_size`` tokens of host bytes; its time is those bytes over the link's bandwidth times its
  efficiency times the recall kernel's share of a plain copy.
- Recall hides behind the step when, layer by layer, it takes no longer than the layer's compute (the
  layer-wise scheduler copies layer l + 1's blocks while layer l computes): then the offloaded step
  costs what the step without offloading costs, else the recall's excess is added.

The presets are the vendors' published figures (HBM bandwidth, dense bf16 tensor throughput,
memory) and the models' configs; ``--calibration`` reads the measured figures of
scripts/gpu_check.sh (results/gpu_h200.json: link bandwidth, recall kernel share of one copy) in
place of the defaults. docs/plan.md derives each formula and compares predictions with measurements.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time
from dataclasses import asdict, dataclass

import torch

from nosa import kvquant
from nosa.bench.results import write_result
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


# Published figures the planner is checked against, with their setups as stated (the notes of
# anchors-and-user-asks.md); what a setup leaves out is assumed and said so in "assumed".
PUBLISHED = [
    {"system": "NOSA v1 (secondary summary)", "figure": "500.8 tok/s with offloading vs 240.8 without: 2.08x",
     "published_ratio": 500.8 / 240.8, "compare": ("nosa_offload", "nosa"),
     "model": "llama-3.2-1b", "context": 16384, "gpu": "a800", "link": "pcie4", "device_gib": 21,
     "config": dict(topk_blocks=64, query_blocks=16, window_blocks=16, sink_blocks=1), "hit_rate": 0.944,
     "assumed": "the 1B model's shape (Llama-3.2-1B's), one 64-token block per 64 budget tokens, the A800's "
                "HBM; the device memory (21 GB) and the budget (4,096 tokens) as stated"},
    {"system": "SparDA", "figure": "5.3x decode over sparse attention without offloading",
     "published_ratio": 5.3, "compare": ("nosa_offload", "nosa"),
     "model": "llama-3.1-8b", "context": 131072, "gpu": "h100", "link": "pcie5", "device_gib": None,
     "config": dict(), "hit_rate": 0.97,
     "assumed": "NOSA-8B's shape (Llama-3.1-8B's), NosaConfig's defaults, a 97% hit rate (this project's "
                "measured range), PCIe Gen5"},
    {"system": "NOSA (thunlp/NOSA README)", "figure": "up to 5.04x decode throughput over full attention",
     "published_ratio": 5.04, "compare": ("nosa_offload", "dense"),
     "model": "llama-3.1-8b", "context": 131072, "gpu": "a800", "link": "pcie4", "device_gib": None,
     "config": dict(), "hit_rate": 0.944,
     "assumed": "not stated which model, context or GPU gives the maximum: an 8B model at 128K on an A800 is "
                "a guess; the figure is an upper end"},
]
NOT_REPRODUCED = [
    ("SGLang HiSparse: 0.92x at batch 1, 3.00x at batch 54", "GLM-5.1-FP8 is a mixture-of-experts model with "
     "multi-head latent attention on 8 H200s: the planner models dense GQA transformers on one GPU"),
    ("SparDA: 1.7x decode over sparse offloading", "the baseline is another offloading system (its transfer "
     "schedule is not modelled here)"),
]


def published_points() -> list[dict]:
    """The planner's prediction beside each published figure (PUBLISHED)."""
    rows = []
    for p in PUBLISHED:
        gpu = GPUS[p["gpu"]]
        if p["device_gib"]:
            gpu = Gpu(gpu.name + f", {p['device_gib']} GB for the KV and weights", p["device_gib"] * 1e9,
                      gpu.hbm_bytes_per_s, gpu.bf16_flops_per_s)
        cfg = NosaConfig(**p["config"]) if p["config"] else NosaConfig()
        best = best_throughput(MODELS[p["model"]], p["context"], gpu, LINKS[p["link"]], cfg, hit_rate=p["hit_rate"])
        a, b = p["compare"]
        predicted = best[a]["tokens_per_s"] / best[b]["tokens_per_s"] if best[b]["tokens_per_s"] else math.inf
        rows.append({**{k: p[k] for k in ("system", "figure", "published_ratio", "assumed")},
                     "predicted_ratio": predicted, "batches": {m: best[m]["batch"] for m in (a, b)},
                     "predicted_tokens_per_s": {m: best[m]["tokens_per_s"] for m in (a, b)},
                     "setup": f"{p['model']}, {p['context'] // 1024}K, {gpu.name}, {LINKS[p['link']].name}"})
    return rows


TINY = ModelShape("tiny llama (bench_serve's)", 2, 8, 2, 32, 2 * 12 * 256 * 256 + 2 * 320 * 256)
SMOLLM2 = ModelShape("SmolLM2-135M", 30, 9, 3, 64, 1.35e8)


def memory_bandwidth(nbytes: int = 256 << 20, repeats: int = 7) -> float:
    """This machine's memory bandwidth as torch's copy of ``nbytes`` reaches it (read + write), bytes/s."""
    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - start)
    return 2 * nbytes / sorted(times)[len(times) // 2]


def against_cpu(serve: dict, bytes_per_s: float, model: ModelShape = TINY) -> list[dict]:
    """The planner's KV-read term against bench_serve's CPU runs (results/serve.json: the tiny model,
    batch B, contexts 4K-64K, torch_native and nosa): each backend's step at its shortest context is
    taken as measured (a CPU step is mostly fixed overheads the roofline does not model), and the
    growth to the longer contexts is predicted from the bytes the attention reads at ``bytes_per_s``."""
    cfg = NosaConfig(**serve["nosa_config"])
    cpu = Gpu("this CPU", 24e9, bytes_per_s, 1e12)
    rows = []
    for backend, mode in (("torch_native", "dense"), ("nosa", "nosa")):
        runs = sorted((r["context"], r["ms_per_decode_step"] / 1e3, r["batch"]) for r in serve["results"]
                      if r["backend"] == backend)
        if not runs:
            continue
        base_context, base_s, batch = runs[0]
        base = plan(model, base_context, batch, cpu, LINKS["pcie5"], cfg, dtype_bytes=4)["step_s"][mode]
        for context, measured, batch in runs[1:]:
            grown = plan(model, context, batch, cpu, LINKS["pcie5"], cfg, dtype_bytes=4)["step_s"][mode] - base
            predicted = base_s + grown
            rows.append({"backend": backend, "context": context, "batch": batch, "predicted_s": predicted,
                         "measured_s": measured, "error": predicted / measured - 1})
    return rows


def onoff_against_cpu(serve: dict, bytes_per_s: float, model: ModelShape = SMOLLM2) -> dict:
    """The planner's offloading on / off decode speed against a served CPU run of paired rounds
    (bench_serve --interleave: results/serve_smollm2_8k_rank_short.json), at the run's measured warm
    hit rate; on a CPU the "link" is a copy within the same memory (``bytes_per_s``)."""
    cfg = NosaConfig(**serve["nosa_config"])
    on = [r for r in serve["results"] if "offload" in r["backend"]]
    context, batch = on[0]["context"], on[0]["batch"]
    hit = sum(r["offload"]["warm_hit_items"] for r in on) / sum(r["offload"]["warm_selected_items"] for r in on)
    cpu = Gpu("this CPU", 24e9, bytes_per_s, 1e12)
    p = plan(model, context, batch, cpu, Link("memory copy", bytes_per_s, 1.0), cfg, dtype_bytes=4, hit_rate=hit,
             recall_share_of_copy=1.0)
    key = next(k for k in serve["ratios_by_round"][0][str(context)] if k.startswith("offload"))
    measured = [1 / r[str(context)][key] for r in serve["ratios_by_round"]]
    median = statistics.median(measured)
    predicted = p["step_s"]["nosa"] / p["step_s"]["nosa_offload"]
    return {"model": model.name, "context": context, "batch": batch, "hit_rate": hit,
            "predicted_on_over_off": predicted, "measured_on_over_off": median, "rounds": len(measured),
            "error": predicted / median - 1}


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


def calibration(path: str) -> dict:
    """Measured figures of scripts/gpu_check.sh (results/gpu_h200.json): the link's efficiency and
    the recall kernel's share of one plain copy, in place of the defaults."""
    with open(path) as f:
        data = json.load(f)
    recall = data["bench_recall"]
    biggest = max(recall["rows"], key=lambda r: r["items"])
    rows = against_gpu(data)

    def efficiency(prefix: str) -> float:
        ratios = [r["predicted_over_measured"] for r in rows if r["what"].startswith(prefix)]
        return min(1.0, sum(ratios) / len(ratios))

    return {"link_bytes_per_s": recall["link_gbps"] * 1e9,
            "recall_share_of_copy": biggest["batched_fraction_of_one_copy"],
            "attention_efficiency": {"dense": efficiency("dense"), "nosa": efficiency("nosa")}, "source": path}


def against_gpu(data: dict, gpu: Gpu = GPUS["h200"], link: Link = LINKS["pcie5"]) -> list[dict]:
    """The planner's formulas against what scripts/gpu_check.sh measured (results/gpu_h200.json, its
    data): one decode layer's attention read at the data sheet's HBM bandwidth vs the measured dense
    and sparse decode kernels, and a recall at the default link efficiency and copy share vs the
    measured batched recall. ``predicted / measured`` below 1: the kernel is slower than the roofline."""
    shape = data["bench_kernels"]["shape"]
    hkv, d, block = int(shape["hkv"]), int(shape["d"]), int(shape["block"])
    rows = []
    for r in data["bench_kernels"]["decode_slots"]:
        kv = 2 * hkv * d * 2  # bytes per token, bf16 K and V of one layer
        for what, tokens, measured in (("dense decode attention (FlashAttention)", r["context"], r["dense_s"]),
                                       ("nosa slot decode (Triton)", r["slots_per_head"] * block, r["nosa_s"])):
            predicted = r["batch"] * tokens * kv / gpu.hbm_bytes_per_s
            rows.append({"what": f"{what}, {r['context'] // 1024}K, batch {r['batch']}", "predicted_s": predicted,
                         "measured_s": measured, "predicted_over_measured": predicted / measured})
    for r in data["bench_recall"]["rows"]:
        predicted = r["bytes"] / (link.bytes_per_s * link.efficiency * 0.88)
        rows.append({"what": f"recall of {r['items']} blocks (K, V, cis), bf16", "predicted_s": predicted,
                     "measured_s": r["batched_s"], "predicted_over_measured": predicted / r["batched_s"]})
    return rows


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def table(p: dict, by_share: dict[int, bool]) -> str:
    """The plan as text: one line per figure."""
    dev, mb, tps = p["device_bytes_per_request"], p["max_batch"], p["tokens_per_s"]
    c = p["nosa_config"]
    lines = [
        f"{p['model']['name']}, {p['context']:,} tokens (+{p['output']} out), batch {p['batch']}, {p['gpu']['name']}, "
        f"{p['link']['name']} at {p['link']['efficiency']:.0%}; NOSA budget {c['topk_blocks']} blocks of "
        f"{c['block_size']} ({c['query_blocks']} free picks), host KV {p['host_kv_dtype']}",
        "",
        f"{'':34}{'dense':>14}{'nosa':>14}{'nosa+offload':>14}",
        f"{'device memory per request':34}"
        + "".join(f"{_gib(dev[k]):>14}" for k in ("dense", "nosa", "nosa_offload")),
        f"{'largest batch on the device':34}{mb['dense']:>14}{mb['nosa']:>14}{mb['nosa_offload']:>14}",
        f"{'batch ' + str(p['batch']) + ' fits':34}" + "".join(f"{'yes' if mb[k] >= p['batch'] else 'NO':>14}"
                                                               for k in ("dense", "nosa", "nosa_offload")),
        f"{'decode step (ms)':34}{1e3 * p['step_s']['dense']:>14.3f}{1e3 * p['step_s']['nosa']:>14.3f}"
        f"{1e3 * p['step_s']['nosa_offload']:>14.3f}",
        f"{'decode tokens/s (batch)':34}{tps['dense']:>14.0f}{tps['nosa']:>14.0f}{tps['nosa_offload']:>14.0f}",
        "",
        f"host memory per request: {_gib(p['host_bytes_per_request'])}; in total {_gib(p['host_bytes_total'])}",
        f"blocks entering per request and KV head per step: {p['blocks_entering_per_head']:.2f}",
        f"recalled per step: {p['recall_bytes_per_step'] / 2**20:.2f} MiB in {1e3 * p['recall_s']:.3f} ms against a "
        f"{1e3 * p['step_s']['nosa']:.3f} ms step: recall {'hides' if p['recall_hides'] else 'does NOT hide'}",
        "recall hides at budgets of " + ", ".join(f"1/{s}: {'yes' if h else 'no'}" for s, h in by_share.items()),
    ]
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m nosa.plan", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help=f"a preset ({', '.join(MODELS)}) or an HF config.json path")
    ap.add_argument("--context", type=int, help="prompt tokens per request")
    ap.add_argument("--output", type=int, default=0, help="reply tokens per request (the KV at the end)")
    ap.add_argument("--batch", type=int, default=1, help="requests decoding together")
    ap.add_argument("--rate", type=float, help="requests per second instead of --batch (with --output: the batch "
                    "that rate keeps decoding, by Little's law, for nosa with offloading)")
    ap.add_argument("--gpu", default="h100", choices=sorted(GPUS))
    ap.add_argument("--link", default="pcie5", choices=sorted(LINKS))
    ap.add_argument("--link-efficiency", type=float, help="share of the link a pinned copy reaches (default 0.85)")
    ap.add_argument("--link-gbps", type=float, help="override the link's bandwidth (GB/s, one direction)")
    ap.add_argument("--hbm-gbps", type=float, help="override the GPU's HBM bandwidth (GB/s)")
    ap.add_argument("--memory-gib", type=float, help="override the GPU's memory (GiB)")
    ap.add_argument("--share", type=int, help="NOSA budget: 1/SHARE of the context's blocks (default: NosaConfig())")
    ap.add_argument("--nosa-config", help="a NosaConfig as JSON text or a file (instead of --share)")
    ap.add_argument("--extra-slots", type=int, default=0, help="$NOSA_DEVICE_EXTRA_SLOTS")
    ap.add_argument("--host-kv-dtype", default="auto", choices=["auto", "int8", "float8_e4m3fn"])
    ap.add_argument("--hit-rate", type=float, help="measured device cache hit rate (default: the locality bound)")
    ap.add_argument("--stats", help="a NOSA_SERVE_STATS_FILE, or a bench_longctx / RULER JSON, to read the hit "
                    "rate from")
    ap.add_argument("--calibration", help="scripts/gpu_check.sh's joined results (e.g. results/gpu_h200.json)")
    ap.add_argument("--json", action="store_true", help="print JSON instead of the table")
    ap.add_argument("--calibrate-cpu", metavar="SERVE_JSON",
                    help="instead of a plan: measure this machine's memory bandwidth and compare the planner with "
                         "bench_serve's CPU runs in SERVE_JSON (results/serve.json), written to --out")
    ap.add_argument("--onoff-json", metavar="SERVE_JSON", help="with --calibrate-cpu: a paired on / off served run "
                    "(results/serve_smollm2_8k_rank_short.json) to compare the predicted on / off speed with")
    ap.add_argument("--out", default="results/plan_cpu.json", help="where --calibrate-cpu writes")
    args = ap.parse_args(argv)
    if args.calibrate_cpu:
        with open(args.calibrate_cpu) as f:
            serve = json.load(f)
        bandwidth = memory_bandwidth()
        rows = against_cpu(serve, bandwidth)
        onoff = None
        if args.onoff_json:
            with open(args.onoff_json) as f:
                onoff = onoff_against_cpu(json.load(f), bandwidth)
            print(json.dumps(onoff))
        write_result(args.out, {"memory_bytes_per_s": bandwidth, "threads": torch.get_num_threads(),
                                "serve_json": args.calibrate_cpu, "rows": rows, "onoff_json": args.onoff_json,
                                "onoff": onoff})
        for r in rows:
            print(json.dumps(r))
        print(f"memory bandwidth {bandwidth / 1e9:.1f} GB/s; wrote {args.out}")
        return
    if not args.model or not args.context:
        ap.error("--model and --context are required (or --calibrate-cpu)")
    if args.model in MODELS:
        model = MODELS[args.model]
    elif os.path.isfile(args.model):
        model = model_from_config(args.model)
    else:
        ap.error(f"--model {args.model!r}: not a preset ({', '.join(MODELS)}) nor a config.json file")
    gpu, link = GPUS[args.gpu], LINKS[args.link]
    if args.hbm_gbps or args.memory_gib:
        gpu = Gpu(gpu.name, args.memory_gib * 2**30 if args.memory_gib else gpu.memory_bytes,
                  args.hbm_gbps * 1e9 if args.hbm_gbps else gpu.hbm_bytes_per_s, gpu.bf16_flops_per_s)
    share_of_copy, attention = 0.88, None
    if args.calibration:
        cal = calibration(args.calibration)
        link = Link(link.name, link.bytes_per_s, min(1.0, cal["link_bytes_per_s"] / link.bytes_per_s))
        share_of_copy, attention = cal["recall_share_of_copy"], cal["attention_efficiency"]
    if args.link_gbps:
        link = Link(f"{link.name} at {args.link_gbps:g} GB/s", args.link_gbps * 1e9, link.efficiency)
    if args.link_efficiency:
        link = Link(link.name, link.bytes_per_s, args.link_efficiency)
    cfg = None
    if args.nosa_config:
        text = open(args.nosa_config).read() if os.path.isfile(args.nosa_config) else args.nosa_config
        cfg = NosaConfig(**json.loads(text))
    hit = args.hit_rate
    if args.stats:
        with open(args.stats) as f:
            stats = json.load(f)
        layers = stats.get("offload", {})
        selected = sum(layers.get("warm_selected", [])) or sum(layers.get("selected", []))
        hits = sum(layers.get("warm_hits", [])) if layers.get("warm_selected") else sum(layers.get("hits", []))
        if selected:
            hit = hits / selected  # warm steps when there are any: a request's first step recalls its whole budget
        else:
            try:
                hit = hit_rate_of(stats)
            except ValueError:
                ap.error(f"--stats {args.stats}: neither offloading counters with selected blocks (a "
                         "NOSA_SERVE_STATS_FILE after some decode steps) nor NOSA results with a hit_rate "
                         "(a bench_longctx / RULER JSON)")
    host = kvquant.host_kv_dtype(args.host_kv_dtype, torch.bfloat16)
    cfg = nosa_config_for(args.context, args.share, cfg)
    if args.rate is not None:
        try:
            args.batch = batch_for_rate(args.rate, args.output, model, args.context, gpu, link, cfg, host_kv_dtype=host,
                                        hit_rate=hit, recall_share_of_copy=share_of_copy,
                                        attention_efficiency=attention)
        except ValueError as err:
            ap.error(str(err))
    try:
        p = plan(model, args.context, args.batch, gpu, link, cfg, 2, host, hit, args.extra_slots, share_of_copy,
                 args.output, attention)
    except ValueError as err:
        ap.error(str(err))
    by_share = shares_where_recall_hides(model, args.context, args.batch, gpu, link, 2, host, hit, share_of_copy,
                                         attention)
    p["recall_hides_by_share"] = {f"1/{s}": h for s, h in by_share.items()}
    print(json.dumps(p, indent=1) if args.json else table(p, by_share))


if __name__ == "__main__":
    main()
