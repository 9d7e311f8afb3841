"""The planner (nosa.plan, its model nosa.plan_model) checked against what was measured and what peers published.

- ``against_gpu`` / ``calibration``: its formulas against scripts/gpu_check.sh's H200 figures
  (results/gpu_h200.json), and those figures in place of its defaults (``python -m nosa.plan
  --calibration``);
- ``against_cpu`` / ``onoff_against_cpu`` / ``calibrate_cpu``: its KV-read term and its offloading
  on / off speed against bench_serve's CPU runs, at this machine's measured memory bandwidth
  (``python -m nosa.plan --calibrate-cpu``, results/plan_cpu.json);
- ``published_points``: its predictions beside the peers' published figures (``PUBLISHED``, their
  setups as stated; ``NOT_REPRODUCED``: the figures it cannot model, and why).
docs/plan.md renders each.
"""

from __future__ import annotations

import json
import math
import statistics
import time

import torch

from nosa.bench.results import write_result
from nosa.config import NosaConfig
from nosa.plan_model import GPUS, LINKS, MODELS, Gpu, Link, ModelShape, best_throughput, plan

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


def calibrate_cpu(serve_json: str, onoff_json: str | None, out: str) -> None:
    """``python -m nosa.plan --calibrate-cpu``: this machine's memory bandwidth, the planner against
    bench_serve's CPU runs in ``serve_json`` (and a paired on / off run), written to ``out``."""
    with open(serve_json) as f:
        serve = json.load(f)
    bandwidth = memory_bandwidth()
    rows = against_cpu(serve, bandwidth)
    onoff = None
    if onoff_json:
        with open(onoff_json) as f:
            onoff = onoff_against_cpu(json.load(f), bandwidth)
        print(json.dumps(onoff))
    write_result(out, {"memory_bytes_per_s": bandwidth, "threads": torch.get_num_threads(), "serve_json": serve_json,
                       "rows": rows, "onoff_json": onoff_json, "onoff": onoff})
    for r in rows:
        print(json.dumps(r))
    print(f"memory bandwidth {bandwidth / 1e9:.1f} GB/s; wrote {out}")
