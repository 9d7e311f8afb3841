"""The results tables of the docs: one renderer per table, each reading its results/*.json.

A renderer is ``fn(root) -> markdown`` registered in ``RENDERERS`` with the JSON files it reads
(paths relative to the repository root). ``nosa.bench.report`` calls it for a page's marker block
and appends the files' provenance, so a table never says a figure the JSON does not hold.
Formatting is fixed (a percent to one decimal, a ratio to two): rendering is deterministic.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Callable

import torch

from nosa import kvquant

RENDERERS: dict[str, tuple[tuple[str, ...], Callable[[Path], str]]] = {}


def renders(*sources: str):
    """Register ``fn`` as the renderer of the block named after it, reading ``sources``."""

    def register(fn: Callable[[Path], str]) -> Callable[[Path], str]:
        RENDERERS[fn.__name__] = (sources, fn)
        return fn

    return register


def load(root: Path, name: str) -> dict:
    with open(root / name) as f:
        return json.load(f)


def table(header: list[str], rows: list[list]) -> str:
    """A markdown table; every cell is str()-ed."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def pct(x: float | None, digits: int = 1) -> str:
    return "-" if x is None else f"{100 * x:.{digits}f}%"


def times(x: float | None, digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}x"


def share_text(s: dict) -> str:
    """right/n [Wilson 95% interval]."""
    return f"{s['right']}/{s['n']} [{s['lo']:.0%}, {s['hi']:.0%}]"


# ---- the headline (README and the results page) -------------------------------------------------
@renders("results/accuracy.json", "results/longctx.json", "results/ruler.json", "results/ruler_ft.json",
         "results/serve_ask_smollm2.json", "results/offload.json", "results/serve_smollm2_8k_rank_short.json",
         "results/serve.json", "results/gemma3_serve_32k.json", "results/gemma3_onoff.json",
         "results/ruler_gemma3.json", "results/ruler_gemma3_8k.json", "results/gpu_h200.json",
         "results/ruler_host_kv.json",
         "results/serve_host_kv.json", "results/kv_formats.json")
def headline(root: Path) -> str:
    acc = {(r["variant"], r["length"]): r for r in load(root, "results/accuracy.json")["results"]}
    tiny = [acc[(v, 512)] for v in ("dense", "training_free", "nosa_finetuned")]
    suite = load(root, "results/longctx.json")
    get = {(r["variant"], r["length"]): r for r in suite["results"]}
    answers = "; ".join(
        f"{n}: " + " / ".join(str(get[(v, n)]["all"]["right"]) for v in ("dense", "A = 0, 1/4", "fitted, 1/4"))
        + f" of {get[('dense', n)]['all']['n']}" for n in suite["lengths"])
    fitted = [get[("fitted, 1/4", n)] for n in suite["lengths"]]
    a0 = [get[("A = 0, 1/4", n)] for n in suite["lengths"]]
    ppl = {p["variant"]: p for p in suite["perplexity"]}
    ruler = load(root, "results/ruler.json")
    scored = {(r["variant"], r["length"]): r["task_mean"] for r in ruler["results"]}
    ruler_scores = "; ".join(f"{n}: " + " / ".join(f"{100 * scored[(v, n)]:.1f}" for v in
                                                   ("dense", "A = 0, 1/4", "A = 0, 1/8")) for n in ruler["lengths"])
    ft = load(root, "results/ruler_ft.json")
    ft_scored = {(r["variant"], r["length"]): r["task_mean"] for r in ft["results"]}
    ft_scores = "; ".join(f"{n}: " + " / ".join(f"{100 * ft_scored[(v, n)]:.1f}" for v in
                                                ("dense-FT", "nosa-ft, 1/4", "nosa-ft, 1/8")) for n in ft["lengths"])
    asked = load(root, "results/serve_ask_smollm2.json")
    cap = load(root, "results/offload.json")["capacity"]
    onoff = paired_speed(load(root, "results/serve_smollm2_8k_rank_short.json"), "offload_sched_over_nosa")
    serve = load(root, "results/serve.json")["decode_speedup_nosa_over_torch_native"]
    gemma = load(root, "results/gemma3_serve_32k.json")
    gemma_onoff = load(root, "results/gemma3_onoff.json")
    rows = [
        ["tiny model (quickstart), 512 tokens, 1/4 of the blocks: held-out answers right, dense / A = 0 / NOSA",
         " / ".join(pct(r["acc"]["mean"]) for r in tiny), "`results/accuracy.json`"],
        ["tiny model: blocks entering the selection per decode step, A = 0 / NOSA; hit rate of a cache = budget",
         f"{tiny[1]['entering_mean']['mean']:.2f} / {tiny[2]['entering_mean']['mean']:.2f}; "
         f"{pct(tiny[1]['hit_rate']['mean'])} / {pct(tiny[2]['hit_rate']['mean'])}", "`results/accuracy.json`"],
        ["SmolLM2-135M (its Q4_1 weights dequantized) long-context suite, 1/4 of the blocks: right answers, "
         "dense / A = 0 / fitted heads",
         answers, "`results/longctx.json`"],
        [f"SmolLM2 (its {ruler['model_source']['quantization']} weights dequantized) on NVIDIA's RULER "
         f"({len(ruler['tasks'])} tasks, score 0-100 averaged over them): dense / "
         "A = 0 at 1/4 / A = 0 at 1/8 of the blocks", ruler_scores, "`results/ruler.json`"],
        [f"SmolLM2 (its {ft['model_source']['quantization']} weights dequantized) fine-tuned the same way with dense "
         "attention (dense-FT) and with NOSA (NOSA-FT, every weight), on RULER: dense-FT / NOSA-FT at 1/4 / at 1/8",
         ft_scores, "`results/ruler_ft.json`"],
        [f"NOSA-FT (SmolLM2, {ft['model_source']['quantization']} dequantized) served at "
         f"{round(asked['prompt_tokens'] / 1024)}K with offloading (SGLang), RULER's prompts: mean "
         "score served / the original dense model on the same prompts; hit rate",
         f"{pct(asked['score'])} / {pct(asked['dense_score'])}; {pct(asked['hit_rate'])}",
         "`results/serve_ask_smollm2.json`"],
        ["SmolLM2 suite, 1/4: hit rate of a cache = budget, fitted heads (A = 0)",
         f"{pct(min(r['hit_rate'] for r in fitted))}-{pct(max(r['hit_rate'] for r in fitted))} "
         f"({pct(min(r['hit_rate'] for r in a0))}-{pct(max(r['hit_rate'] for r in a0))})", "`results/longctx.json`"],
        [f"SmolLM2 suite: perplexity at {ppl['dense']['length']} tokens, fitted heads at 1/4 over dense",
         f"{ppl['fitted, 1/4']['ratio_to_dense']:.4f}", "`results/longctx.json`"],
        [f"device KV budget of {cap['device_kv_tokens']:,} tokens: longest context served, torch_native / "
         "nosa with offloading", f"{cap['torch_native']['served_context']:,} / "
         f"{cap['nosa_offload']['served_context']:,} ({times(cap['capacity_ratio'], 1)})", "`results/offload.json`"],
        [f"SmolLM2 served at 8K: decode speed with offloading on over off (median of {onoff['rounds']} paired rounds)",
         f"{onoff['median']:.2f} (CPU time {onoff['median_cpu']:.2f})", "`results/serve_smollm2_8k_rank_short.json`"],
        ["decode step, nosa over torch_native (tiny random Llama, batch 4): speed-up at 32K / 64K tokens",
         f"{times(serve['32768'])} / {times(serve['65536'])}", "`results/serve.json`"],
        [f"Gemma 3 270M (Q4_K_M dequantized, hybrid) served at {gemma['context'] // 1024}K, A = 0 at "
         f"1/{round(gemma['context'] / (gemma['nosa_config']['topk_blocks'] * gemma['nosa_config']['block_size']))} "
         "of the full layers' blocks: device KV MB per request torch_native / nosa with offloading; requests in "
         "torch_native's bytes for one; decode speed over torch_native; decode speed with offloading on over off "
         f"(median of {gemma_onoff['rounds']} paired rounds)",
         f"{gemma['torch_native']['device_kv_bytes_per_request'] / 1e6:.0f} / "
         f"{gemma['nosa_offload']['device_kv_bytes_per_request'] / 1e6:.1f}; "
         f"{gemma['capacity']['nosa_offload_requests']}; {times(gemma['decode_speed_nosa_over_native'])}; "
         f"{gemma_onoff['decode_speed_on_over_off']:.2f}",
         "`results/gemma3_serve_32k.json`, `results/gemma3_onoff.json`"],
        gemma_ruler_row(load(root, "results/ruler_gemma3.json"), load(root, "results/ruler_gemma3_8k.json")),
        gpu_row(load(root, "results/gpu_h200.json")),
        host_kv_row(load(root, "results/ruler_host_kv.json"), load(root, "results/serve_host_kv.json"),
                    load(root, "results/kv_formats.json")),
    ]
    return table(["what", "measured", "data"], rows)


def gemma_ruler_row(data: dict, pooled: dict) -> list[str]:
    """The headline's RULER row of Gemma 3: dense / A = 0 / fitted heads at 1/4, per length; at the
    lengths of ``pooled`` (more examples, two seeds) its figures, with the heads fitted there."""
    source = {n: (data, "fitted, 1/4") for n in data["lengths"]} | {n: (pooled, "fitted-8k, 1/4")
                                                                  for n in pooled["lengths"]}
    parts = []
    for n, (report, fitted) in sorted(source.items()):
        scored = {r["variant"]: r["task_mean"] for r in report["results"] if r["length"] == n}
        parts.append(f"{n} ({report['examples_per_task'][str(n)]} per task): "
                     + " / ".join(f"{100 * scored[v]:.1f}" for v in ("dense", "A = 0, 1/4", fitted)))
    return [f"Gemma 3 270M ({data['model_source']['quantization']} dequantized) on NVIDIA's RULER "
            f"({len(data['tasks'])} tasks, score 0-100): dense / A = 0 / fitted heads, at 1/4 of the full layers' "
            "blocks (examples per task)", "; ".join(parts),
            "`results/ruler_gemma3_8k.json`, `results/ruler_gemma3.json`"]


def host_kv_row(data: dict, served: dict, formats: dict) -> list[str]:
    """The headline's quantized host KV row: RULER with the pool in the model's dtype, int8, fp8; how
    far int8 and fp8 move the next-token distribution (scripts/bench_kv_formats.py); the served decode
    speed with offloading on over off per dtype."""
    n = data["lengths"][0]
    score = {r["variant"]: r["task_mean"] for r in data["results"] if r["length"] == n}
    # the int8 pool as served from a calibrated checkpoint (key factors) where that ran
    factored = "A = 0, 1/4, int8 host KV, key factors"
    names = [v for v in ("A = 0, 1/4", factored if factored in score else "A = 0, 1/4, int8 host KV",
                         "A = 0, 1/4, fp8 host KV")]
    kl = {r["format"]: r["kl"] for r in formats["formats"]}
    ratio = kvquant.bytes_per_token(64, 64, torch.int8) / kvquant.bytes_per_token(64, 64, torch.bfloat16)
    onoff = [paired_speed(served, f"offload_sched{k}_over_nosa")["median"] for k in ("", "_int8", "_fp8")]
    context = served["results"][0]["context"] // 1024
    int8 = "int8 with key factors" if factored in score and formats.get("key_factors") else "int8"
    return [f"SmolLM2 on RULER at {n // 1024}K, A = 0 at 1/4, the host KV pool in the model's dtype / {int8} / fp8 "
            f"(NOSA_HOST_KV_DTYPE): score; KL to the exact next-token distribution on held-out prose, {int8} / fp8; "
            "host bytes per token against a bf16 pool's; decode speed with offloading "
            f"on over off, same dtypes (tiny model served at {context}K, median of paired rounds)",
            " / ".join(f"{100 * score[v]:.1f}" for v in names) + f"; {kl['int8']:.4f} / {kl['float8_e4m3fn']:.4f}; "
            f"{ratio:.2f}x; " + " / ".join(f"{x:.2f}" for x in onoff),
            "`results/ruler_host_kv.json`, `results/kv_formats.json`, `results/serve_host_kv.json`"]


def gpu_row(gpu: dict) -> list[str]:
    """The headline's H200 row: sparse decode over FlashAttention decode, and the recall from bf16 vs
    quantized host pools."""
    slots = {r["context"]: r for r in gpu["bench_kernels"]["decode_slots"]}
    big = max(r["items"] for r in gpu["bench_recall"]["host_dtypes"])
    q = next(r for r in gpu["bench_recall"]["host_dtypes"] if r["items"] == big)
    p = gpu["bench_kernels"]["prefill"][0]
    return ["H200 (Llama-3-8B heads, bf16): Triton slot decode over FlashAttention decode at "
            + " / ".join(f"{c // 1024}K" for c in sorted(slots)) + f"; block-sparse prefill at {p['context'] // 1024}K "
            "(forward / with backward) over FlashAttention; recall of "
            f"{big} blocks from an int8 / fp8 host pool: bytes and speed-up vs bf16",
            " / ".join(times(slots[c]["dense_over_nosa"]) for c in sorted(slots))
            + f"; {times(p['dense_over_nosa_fwd'])} / {times(p['dense_over_nosa_fwd_bwd'])}"
            + f"; {pct(q['int8_bytes_over_bf16'], 0)} of the bytes, {times(q['int8_speedup_over_bf16'])} / "
            f"{times(q['float8_e4m3fn_speedup_over_bf16'])}", "`results/gpu_h200.json`"]


# ---- the tiny model -------------------------------------------------------------------------------
@renders("results/demo.json")
def demo(root: Path) -> str:
    """Every top-level number of the demo's JSON (the demo decides what it reports)."""
    data = load(root, "results/demo.json")
    rows = [[f"`{k}`", f"{v:.4g}" if isinstance(v, float) else v] for k, v in data.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool)]
    return table(["figure", "value"], rows)


@renders("results/accuracy.json")
def accuracy(root: Path) -> str:
    data = load(root, "results/accuracy.json")
    get = {(r["variant"], r["length"]): r for r in data["results"]}
    lengths = sorted({r["length"] for r in data["results"]})
    names = {"dense": "dense", "training_free": "A = 0", "nosa_finetuned": "NOSA"}

    def spread(s: dict, fmt: Callable[[float], str]) -> str:
        return f"{fmt(s['mean'])} [{fmt(s['min'])}, {fmt(s['max'])}]"

    rows = []
    for n in lengths:
        rows.append([n, pct(get[("dense", n)]["budget_share"], 0)]
                    + [spread(get[(v, n)]["acc"], pct) for v in names]
                    + [spread(get[(v, n)]["entering_mean"], lambda x: f"{x:.2f}")
                       + f" ({get[(v, n)]['entering_max']['max']:.0f})" for v in ("training_free", "nosa_finetuned")]
                    + [spread(get[(v, n)]["hit_rate"], pct) for v in ("training_free", "nosa_finetuned")])
    header = ["context", "budget", "answers right: dense", "A = 0", "NOSA", "blocks entering per step (max): A = 0",
              "NOSA", "hit rate, cache = budget: A = 0", "NOSA"]
    return (table(header, rows) + f"\n\nMean [min, max] over {len(data['runs'])} training seeds "
            f"({', '.join(data['runs'])}), {data['examples_per_length']} examples per length.")


# ---- the long-context suite on SmolLM2 ----------------------------------------------------------
def _suite(root: Path, name: str):
    data = load(root, name)
    names = list(dict.fromkeys(r["variant"] for r in data["results"]))
    return data, names, {(r["variant"], r["length"]): r for r in data["results"]}


@renders("results/longctx.json")
def longctx_tasks(root: Path) -> str:
    data, names, get = _suite(root, "results/longctx.json")
    rows = []
    for n in data["lengths"]:
        rows += [[n, t] + [share_text(get[(v, n)]["tasks"][t]) for v in names] for t in data["tasks"]]
        rows.append([n, "**all**"] + [f"**{share_text(get[(v, n)]['all'])}**" for v in names])
    return table(["context", "task"] + names, rows) + "\n\nRight answers [Wilson 95% interval]."


def _variant_rows(data: dict, names: list[str], get: dict) -> list[list]:
    rows = []
    for n in data["lengths"]:
        for v in names:
            r = get[(v, n)]
            if r["share"] is None:
                rows.append([n, v, "all", pct(r["all"]["acc"]), "-", "-", "-"])
            else:
                rows.append([n, v, f"{r['budget_blocks']} of {r['context_blocks']}", pct(r["all"]["acc"]),
                             f"{r['entering_mean']:.2f} ({r['entering_max']})", pct(r["hit_rate"]), f"{r['mass']:.3f}"])
    return rows


@renders("results/longctx.json")
def longctx_variants(root: Path) -> str:
    data, names, get = _suite(root, "results/longctx.json")
    header = ["context", "variant", "budget (blocks)", "right, all tasks", "blocks entering per step (max)",
              "hit rate, cache = budget", "dense mass in selection"]
    return table(header, _variant_rows(data, names, get))


@renders("results/longctx.json")
def longctx_targets(root: Path) -> str:
    """Per NOSA variant and length: the tasks dense answers at least half of, the points below dense
    averaged over them, the tasks answered worse than A = 0 at the same budget, and the recall."""
    data, names, get = _suite(root, "results/longctx.json")
    ppl = {p["variant"]: p["ratio_to_dense"] for p in data["perplexity"]}
    rows = []
    for r in data["results"]:
        if r["share"] is None or r["variant"].startswith("A = 0"):
            continue
        n = r["length"]
        dense, a0 = get[("dense", n)], get[(f"A = 0, 1/{r['share']}", n)]
        kept = [t for t in data["tasks"] if dense["tasks"][t]["acc"] >= 0.5]
        mean_dense = statistics.fmean(dense["tasks"][t]["acc"] for t in kept)
        mean_var = statistics.fmean(r["tasks"][t]["acc"] for t in kept)
        below = [t for t in data["tasks"] if r["tasks"][t]["right"] < a0["tasks"][t]["right"]]
        rows.append([n, r["variant"], ", ".join(kept), pct(mean_dense), pct(mean_var),
                     f"{100 * (mean_dense - mean_var):.1f}", ", ".join(below) or "none", pct(r["hit_rate"]),
                     times(r["entering_mean"] / a0["entering_mean"]),
                     f"{ppl[r['variant']]:.4f}" if n == data["perplexity"][0]["length"] else "-"])
    header = ["context", "variant", "tasks dense answers >= half of", "dense", "variant", "points below dense",
              "tasks below A = 0", "hit rate", "entering / A = 0", "perplexity / dense"]
    p0 = data["perplexity"][0]
    return (table(header, rows) + f"\n\nPerplexity over the last {p0['tokens'] // p0['windows']} tokens of "
            f"{p0['windows']} held-out windows of {p0['length']} tokens, at that length only.")


@renders("results/longctx_picks_seed1_2048.json", "results/longctx_picks_seed1_4096.json")
def picks_split(root: Path) -> str:
    """The split of the budget: free query-aware picks as a share of it, on examples of seed 1."""
    rows = []
    for name in ("results/longctx_picks_seed1_2048.json", "results/longctx_picks_seed1_4096.json"):
        data, names, get = _suite(root, name)
        ppl = {p["variant"]: p["ratio_to_dense"] for p in data["perplexity"]}
        for n in data["lengths"]:
            for v in names:
                r = get[(v, n)]
                right = "+".join(str(r["tasks"][t]["right"]) for t in data["tasks"]) + f" = {r['all']['right']}"
                if r["share"] is None:
                    rows.append([n, v, right + f"/{r['all']['n']}", "-", "-", "-"])
                    continue
                a0 = get[(f"A = 0, 1/{r['share']}", n)]
                rows.append([n, v, right + f"/{r['all']['n']}",
                             f"{r['entering_mean']:.2f} ({times(r['entering_mean'] / a0['entering_mean'])})",
                             pct(r["hit_rate"]), f"{ppl[v]:.3f}"])
    header = ["context", "variant", "right (" + " + ".join(data["tasks"]) + ")", "entering per step (/ A = 0)",
              "hit rate", "perplexity / dense"]
    return table(header, rows)


@renders("results/fit_sweep.json")
def fit_sweep(root: Path) -> str:
    data = load(root, "results/fit_sweep.json")
    keys = list(data["results"][0]["coverage"])
    rows = [[f"`{r['setting']}`"] + [f"{r['coverage'][k]:.3f}" for k in keys] + [f"**{r['mean']:.3f}**"]
            for r in data["results"]]
    return (table(["setting"] + [k.replace("@", ", ") for k in keys] + ["mean"], rows)
            + f"\n\nAnswer-block coverage at 1/{data['share']} of the blocks, examples of seed {data['seed']}.")


@renders("results/probe_ranking.json")
def probe_ranking(root: Path) -> str:
    data = load(root, "results/probe_ranking.json")
    rows = [[r["task"], f"1/{r['share']} ({r['config']['topk_blocks']} blocks, {r['config']['query_blocks']} pick)",
             f"{r['ranked']:.3f}", f"{r['picked']:.3f}", f"{r['covered']:.3f}", f"{r['above']:.2f}"]
            for r in data["rows"]]
    header = ["task", "budget", "ranked by the heads", "picked by the query", "in the selection",
              "distractors ranked above it"]
    return table(header, rows) + f"\n\nShares of the answer block's weight; checkpoint `{data['checkpoint']}`."


def paired_speed(data: dict, key: str) -> dict:
    """Speed with the first variant of ``key`` over the second (1 / the ms ratio), per paired round."""
    context = str(data["results"][0]["context"])
    wall = [1 / r[context][key] for r in data["ratios_by_round"]]
    cpu = [1 / r[f"{context} cpu"][key] for r in data["ratios_by_round"]]
    return {"rounds": len(wall), "median": statistics.median(wall), "median_cpu": statistics.median(cpu),
            "lo": min(wall), "hi": max(wall), "at_least_0_9": sum(x >= 0.9 for x in wall)}


@renders("results/kernels.json")
def kernels_cpu(root: Path) -> str:
    data = load(root, "results/kernels.json")
    rows = [[f"slot decode, {r['context'] // 1024}K, batch {r['batch']}", times(r["dense_over_nosa"], 1)]
            for r in data["decode_slots"]]
    rows += [[f"paged decode, {r['context'] // 1024}K, batch {r['batch']}", times(r["dense_over_nosa_ref"], 1)]
             for r in data["decode_paged"]]
    rows += [[f"prefill reference, {r['context'] // 1024}K, forward + backward", times(r["dense_over_nosa_fwd_bwd"])]
             for r in data["prefill"]]
    return table(["torch reference on CPU (fp32, one thread)", "dense time / nosa time"], rows)


@renders("results/recall.json")
def recall_cpu(root: Path) -> str:
    data = load(root, "results/recall.json")
    rows = [[f"{r['items']} ({r['bytes'] / 2**20:.0f} MiB)"]
            + [f"{r[k]:.2f} GB/s" for k in ("batched_gbps", "per_block_gbps", "one_copy_gbps")]
            + [times(r["batched_over_per_block"]), pct(r["batched_fraction_of_one_copy"], 0)] for r in data["rows"]]
    return table(["items per call", "batched", "one copy per block", "one large copy", "batched / per block",
                  "batched / one copy"], rows) + f"\n\nLoad average while measuring: {data['load_average_1min']:.1f}."


@renders("results/train_tiny.json")
def train_step(root: Path) -> str:
    data = load(root, "results/train_tiny.json")
    step = data["step_s"]
    rows = [[f"`{data['config']}` ({data['micro_batch']} x {data['seq_len']} tokens)", step["dense"]["median"],
             step["nosa"]["median"], times(data["ratio_nosa_over_dense"]), times(data["cpu_ratio_nosa_over_dense"])]]
    return table(["config", "dense s / step", "NOSA s / step", "NOSA / dense (wall)", "NOSA / dense (CPU time)"], rows)


@renders("results/train.json")
def crossover(root: Path) -> str:
    rows = load(root, "results/train.json")["crossover"]
    header = ["keys per row / budget"] + [f"{r['mean_keys_per_budget']:g} ({r['context']} tok., "
                                          f"{'training' if r['training'] else 'prefill'})" for r in rows]
    ratios = [times(r["gathered_cpu_s"] / r["masked_cpu_s"]) for r in rows]
    return table(header, [["gathered / masked (CPU time)"] + ratios])


@renders("results/suite.json")
def suite(root: Path) -> str:
    data = load(root, "results/suite.json")
    counts = data["tests"]
    head = (f"`{data['suite_command']}`: {counts['passed']} passed, {counts['skipped']} skipped, "
            f"{counts['failed']} failed in {data['wall_seconds'] / 60:.1f} min of wall time on "
            f"{data['workers']} workers ({data['test_seconds_total'] / 60:.1f} min of tests' own time)"
            + (f"; the cores were busy {data['cpu_busy']:.0%} of the time" if data.get("cpu_busy") is not None else "")
            + (". The machine's speed: a fixed Python loop (`nosa.bench.suite_time.loop_seconds`) took "
               f"{data['speed_loop_seconds'][0]:.2f} s on one core before the run and "
               f"{data['speed_loop_seconds'][1]:.2f} s after it" if data.get("speed_loop_seconds") else "")
            + ". The slowest tests (setup, call and teardown together; a module's servers start in its first "
            "test's setup):")
    rows = [[f"`{t['test']}`", f"{t['seconds']:.0f} s"] for t in data["slowest"]]
    out = head + "\n\n" + table(["test", "time"], rows)
    if data.get("files"):  # written since the timer kept per-file totals
        files = [[f"`{f['file']}`", str(f["tests"]), f"{f['seconds']:.0f} s"] for f in data["files"][:12]]
        out += ("\n\nThe files that take longest, all their tests together:\n\n"
                + table(["file", "tests", "time"], files))
    return out
