"""The docs' serving tables (results/serve*.json, offload*.json, soak*.json): registered like
``report_tables``' renderers, whose helpers they use."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Callable

from nosa.bench.report_tables import load, paired_speed, pct, renders, table, times


def _served(root: Path, name: str) -> str:
    d = load(root, name)
    rows = [
        ["answers right", f"{d['correct']} of {d['questions']} ({pct(d['accuracy'])})"],
        ["prompt tokens (longest)", f"{d['prompt_tokens']:,}"],
        ["hit rate of the device block cache: all decode steps / warm steps",
         f"{pct(d['hit_rate'])} / {pct(d['warm_hit_rate'])}"],
        ["recalled from the host pool", f"{d['recalled_items']:,} blocks ({d['recalled_bytes'] / 2**20:.1f} MiB)"],
        ["most blocks recalled per KV head in a warm step", d["max_warm_misses"]],
        ["peak device KV tokens (budget)", f"{d['peak_device_tokens']:,} ({d['device_budget_tokens']:,})"],
        ["KV tokens torch_native would hold per request", f"{d['torch_native_kv_tokens_per_request']:,}"],
        ["requests decoding at once (peak)", d["peak_batch"]],
        ["admission: admitted / made to wait", f"{d['admission']['admit']} / {d['admission']['wait']}"],
        ["request states and device slots left afterwards", f"{d['requests_after']}, {d['device_slots_in_use_after']}"],
    ]
    if d.get("suite") == "ruler":  # RULER's metrics give partial credit; dense on the same prompts beside it
        rows.insert(1, ["RULER mean score, served (NVIDIA's RULER prompts)", pct(d["score"])])
    if "dense_score" in d:
        dense = [a["dense"] for a in d["answers"]]
        rows.insert(2, [f"dense ({d['dense']}, full attention) on the same prompts: mean score / fully right",
                        f"{pct(d['dense_score'])} / {sum(x['right'] == 1 for x in dense)} of {len(dense)}"])
    if "nosa_config" in d:
        c = d["nosa_config"]
        rows.insert(1, ["NosaConfig served", f"{c['topk_blocks']} blocks of {c['block_size']} = {c['sink_blocks']} "
                        f"sink + {c['window_blocks']} window + {c['query_blocks']} picks + the rest ranked"])
    return table(["served", "measured"], rows)


@renders("results/serve_ask.json")
def serve_ask(root: Path) -> str:
    return _served(root, "results/serve_ask.json")


@renders("results/serve_ask_smollm2.json")
def serve_ask_smollm2(root: Path) -> str:
    return _served(root, "results/serve_ask_smollm2.json")


@renders("results/serve_smollm2_8k_rank_short.json", "results/serve_smollm2_ft_8k.json",
         "results/serve_offload_tiny_kernel_final.json", "results/resolve_kernel.json")
def offload_onoff(root: Path) -> str:
    rows = []
    for label, name in (("SmolLM2-135M, fitted heads, 8K prompt, batch 1", "results/serve_smollm2_8k_rank_short.json"),
                        ("SmolLM2-135M, sparse-aware fine-tune, 8K, batch 1", "results/serve_smollm2_ft_8k.json"),
                        ("tiny quickstart model, 2K, batch 4", "results/serve_offload_tiny_kernel_final.json")):
        data = load(root, name)
        s = paired_speed(data, "offload_sched_over_nosa")
        on = [r["offload"] for r in data["results"] if r["backend"] == "nosa+offload+sched"]
        hit = sum(o["hit_items"] for o in on) / sum(o["selected_items"] for o in on)
        rows.append([f"served: {label}", s["rounds"], f"{s['lo']:.2f}-{s['hi']:.2f}",
                     f"**{s['median']:.2f}** ({s['median_cpu']:.2f})", f"{s['at_least_0_9']} of {s['rounds']}",
                     pct(hit)])
    for r in load(root, "results/resolve_kernel.json")["resolve"]:
        speed = r["ratios_by_round"]["on_over_off_speed"]
        rows.append([f"one process, no SGLang: the {r['shape']} shape", r["rounds"],
                     f"{min(speed):.2f}-{max(speed):.2f}", f"**{r['ratios']['on_over_off_speed']:.2f}** (CPU time)",
                     f"{sum(x >= 0.9 for x in speed)} of {r['rounds']}", pct(r["hit_rate"])])
    return table(["run", "paired rounds", "on / off by round", "median on / off (CPU time)", "rounds >= 0.9",
                  "hit rate"], rows)


@renders("results/offload.json")
def offload_capacity(root: Path) -> str:
    cap = load(root, "results/offload.json")["capacity"]
    tn, off = cap["torch_native"], cap["nosa_offload"]
    rows = [[f"{cap['device_kv_tokens']:,} tokens", f"{tn['served_context']:,} tokens served; one more refused "
             f"(HTTP {tn['status_at_budget_plus_1']})", f"{off['served_context']:,} tokens served (prefill "
             f"{off['seconds']:,.0f} s)", f"**{times(cap['capacity_ratio'], 1)}**"]]
    return table(["device KV budget", "torch_native (its pool is the device memory)", "nosa, `NOSA_OFFLOAD=1`",
                  "ratio"], rows)


@renders("results/offload.json")
def offload_hitrate(root: Path) -> str:
    data = load(root, "results/offload.json")["hitrate"]
    by = {(r["selection"], r["context"]): r for r in data["rows"]}
    rows = []
    for n in sorted({r["context"] for r in data["rows"]}):
        nosa, a0 = by[("nosa", n)], by[("a0", n)]
        rows.append([f"{n} ({nosa['blocks']} blocks)", f"**{pct(nosa['warm_hit_rate'])}** / {pct(a0['warm_hit_rate'])}",
                     f"{nosa['recalled_bytes'] / 1e6:.2f} MB / {a0['recalled_bytes'] / 1e6:.1f} MB "
                     f"({times(nosa['recalled_bytes'] / a0['recalled_bytes'])})",
                     f"{nosa['max_warm_misses_per_head']} / {a0['max_warm_misses_per_head']}"])
    return table(["context", "warm hit rate: NOSA / A = 0", "recalled: NOSA / A = 0",
                  "most recalled per warm step and KV head: NOSA / A = 0"], rows) + (
        f"\n\nCheckpoint `{data['checkpoint']}`, budget {data['nosa_config']['topk_blocks']} blocks of "
        f"{data['nosa_config']['block_size']}, device slots = the budget.")


@renders("results/offload_schedule.json")
def offload_schedule(root: Path) -> str:
    data = load(root, "results/offload_schedule.json")["schedule"]["rows"]
    by = {(r["mode"], r["repeat"]): r for r in data}
    repeats = sorted({r["repeat"] for r in data})
    rows = []
    for mode in ("off", "on", "scheduled"):
        rows.append([f"{mode}, ms / step"] + [by[(mode, k)]["ms_per_decode_step"] if (mode, k) in by else "-"
                                               for k in repeats])
    speed = [by[("off", k)]["ms_per_decode_step"] / by[("scheduled", k)]["ms_per_decode_step"] for k in repeats]
    rows.append(["**scheduled / off (speed)**"] + [f"**{x:.2f}**" for x in speed])
    rows.append(["stall share of the layers' time, scheduled"] + [by[("scheduled", k)]["stall_share"] for k in repeats])
    rows.append(["hit rate, scheduled"] + [pct(by[("scheduled", k)]["hit_rate"]) for k in repeats])
    return table(["32K, batch 4, random A = 0 model"] + [f"repeat {k}" for k in repeats], rows)


@renders("results/offload_trace.json", "results/serve_timeline.json")
def offload_trace(root: Path) -> str:
    data = load(root, "results/offload_trace.json")["trace"]
    off, on = data["admission_off"], data["admission_on"]
    both = (off, on)
    adm = (on["admission"] or {}).get("decisions", {})

    def row(label: str, fmt: Callable[[dict], str]) -> list:
        return [label] + [fmt(x) for x in both]

    rows = [
        row("output tokens / s", lambda x: f"{x['output_tokens_per_s']:.2f} ({x['seconds']:.0f} s)"),
        row("time per output token p50 / p99 (ms)", lambda x: f"{x['tpot_ms_p50']:,.0f} / {x['tpot_ms_p99']:,.0f}"),
        row("time to first token p50 / p99 (s)", lambda x: f"{x['ttft_s_p50']:.1f} / {x['ttft_s_p99']:.1f}"),
        row("decode steps; most requests at once", lambda x: f"{x['steps']}; {x['max_batch']}"),
        row("hit rate; stall share of the layers' time", lambda x: f"{x['hit_rate']:.3f}; {x['stall_share']:.3f}"),
        ["admission decisions", "-", ", ".join(f"{adm.get(k, 0)} {k}s" for k in ("admit", "wait", "grant"))],
    ]
    lengths = data["lengths"]
    return (table([f"Poisson trace, {len(lengths)} requests of {min(lengths):,}-{max(lengths):,} tokens",
                   "admission off", "admission on"], rows)
            + f"\n\nDevice KV budget {data['device_kv_tokens']:,} tokens, {data['new_tokens']} new tokens per "
            f"request, {data['rate_per_s']} arrivals per second; the dashboard above plots "
            "`results/serve_timeline.json`, the admission-on run's decode steps.")


def _against_torch_native(data: dict, key: str, ratio: Callable[[float, float], float]) -> list[list]:
    """Per context: torch_native's and nosa's ``key`` side by side, and ratio(torch_native's, nosa's)."""
    by = {(r["backend"], r["context"]): r[key] for r in data["results"]}
    return [[f"{n // 1024}K", by[("torch_native", n)], by[("nosa", n)],
             f"**{times(ratio(by[('torch_native', n)], by[('nosa', n)]))}**"]
            for n in sorted({r["context"] for r in data["results"]})]


@renders("results/serve.json")
def serve_decode(root: Path) -> str:
    data = load(root, "results/serve.json")
    rows = _against_torch_native(data, "ms_per_decode_step", lambda tn, nosa: tn / nosa)
    c = data["nosa_config"]
    return (table(["context", "torch_native ms / step", "nosa ms / step", "nosa speed-up"], rows)
            + f"\n\n{data['model']}; batch 4; NosaConfig of that run: {c['topk_blocks']} blocks of {c['block_size']}, "
            f"{c['window_blocks']} window, {c['query_blocks']} picks, `dense_len` {c['dense_len']}.")


@renders("results/serve_decode_flat64k.json")
def serve_flat(root: Path) -> str:
    data = load(root, "results/serve_decode_flat64k.json")
    contexts = sorted({r["context"] for r in data["results"]})
    rows = [[f"{n // 1024}K"] + [statistics.median(r[k] for r in data["results"] if r["context"] == n)
                                 for k in ("ms_per_decode_step", "cpu_ms_per_decode_step")] for n in contexts]
    rounds = data.get("ratios_by_round")
    paired = "" if not rounds else (
        f" (median of {len(rounds)} rounds, each context measured seconds apart in each: "
        + ", ".join(times(r["nosa_longest_over_shortest"]) for r in rounds) + ")")
    return (table(["context", "nosa ms / step" + (" (median)" if rounds else ""), "CPU ms / step"], rows)
            + f"\n\nLongest over shortest context: {times(data['ratios']['nosa_longest_over_shortest'])}{paired}.")


@renders("results/serve_prefill.json")
def serve_prefill(root: Path) -> str:
    data = load(root, "results/serve_prefill.json")
    rows = _against_torch_native(data, "prefill_s", lambda tn, nosa: nosa / tn)
    return table(["context", "torch_native prefill s (4 requests)", "nosa prefill s", "nosa / torch_native"], rows)


@renders("results/serve_prefill_offload.json")
def serve_prefill_offload(root: Path) -> str:
    data = load(root, "results/serve_prefill_offload.json")
    off = {r["context"]: r for r in data["results"] if r["backend"] == "nosa"}  # offloading off: the reference
    rows = [[f"{r['context'] // 1024}K", data["variants"][r["backend"]], r["prefill_s"], r["prefill_cpu_s"],
             times(r["prefill_cpu_s"] / off[r["context"]]["prefill_cpu_s"]), r["ms_per_decode_step"]]
            for r in data["results"]]
    return (table(["context", "variant (4 requests)", "prefill s", "prefill CPU s", "CPU s over offloading off",
                   "ms / decode step"], rows) + f"\n\n{data['model']}, one server after another.")


@renders("results/serve_graphs.json")
def serve_graphs(root: Path) -> str:
    data = load(root, "results/serve_graphs.json")
    rows = [[data["variants"][r["backend"]], r["ms_per_decode_step"], r["cpu_ms_per_decode_step"],
             f"{r['server_start_s']:.0f}"] for r in data["results"]]
    return (table(["variant (4K, batch 4)", "ms / decode step", "CPU ms / step", "server start-up s"], rows)
            + f"\n\n{data['model']}.")


@renders("results/serve_graphs_ctx.json")
def serve_graphs_ctx(root: Path) -> str:
    """Eager against the CPU graph runner per context, in servers sized for the longest: medians over
    the paired rounds."""
    data = load(root, "results/serve_graphs_ctx.json")
    rounds = data.get("ratios_by_round") or [data["ratios"]]
    rows = []
    for context in sorted({r["context"] for r in data["results"]}):
        ms = {v: statistics.median(r["ms_per_decode_step"] for r in data["results"]
                                   if r["backend"] == v and r["context"] == context) for v in ("nosa", "nosa+compile")}
        speed = [r[str(context)]["nosa_over_nosa_compile"] for r in rounds]
        rows.append([f"{context // 1024}K", ms["nosa"], ms["nosa+compile"],
                     f"**{times(statistics.median(speed))}** ({times(min(speed))} to {times(max(speed))})"])
    return (table(["context", "eager ms / step", "CPU graph runner ms / step",
                   f"captured speed over eager, median of {len(rounds)} paired rounds (range)"], rows)
            + f"\n\n{data['model']}; batch {data['results'][0]['batch']}; both servers sized for the longest context.")


@renders("results/serve_tp.json")
def serve_tp(root: Path) -> str:
    data = load(root, "results/serve_tp.json")
    rows = [[r["tp_size"], f"{r['context'] // 1024}K", r["ms_per_decode_step"], f"{r['prefill_s']:.0f}"]
            for r in data["results"]]
    return table(["TP size", "context", "ms / decode step", "prefill s (4 requests)"], rows) + (
        f"\n\n{data['model']}, eviction heads at full scale; on this 2-core CPU each TP rank gets one core.")


@renders("results/soak.json", "results/soak_offload.json")
def soak(root: Path) -> str:
    runs = [load(root, "results/soak.json"), load(root, "results/soak_offload.json")]

    def cell(label: str, fmt: Callable[[dict], object]) -> list:
        return [label] + [fmt(d) for d in runs]

    rows = [
        cell("requests under load", lambda d: d["requests_total"]),
        cell("malformed mixed in: 400 / served", lambda d: f"{d['requests']['malformed'].get('400', 0)} / "
             f"{d['requests']['malformed'].get('200', 0)}"),
        cell("5xx or failed checks", lambda d: len(d["failures"])),
        cell("burst of one-token requests at once", lambda d: f"{d['burst']['ok']} of {d['burst']['requests']} "
             f"answered in {d['burst']['seconds']:.1f} s"),
        cell("probe outputs before = after", lambda d: "yes" if d["probes_identical"] else "no"),
        cell("`/generate` latency median / max (s)", lambda d: f"{d['latency_s']['generate']['median']:.1f} / "
             f"{d['latency_s']['generate']['max']:.1f}"),
        cell("server RSS at start -> end (MB)", lambda d: f"{d['rss_mb_start']:,.0f} -> {d['rss_mb_end']:,.0f}"),
        cell("validation of the longest prompt", lambda d: f"{d['validation_us_longest_prompt'] / 1000:.2f} ms"),
    ]
    load_ = runs[0]["load"]
    return table([f"soak ({load_['clients']} clients, {load_['duration']:.0f} s of load)", "KV in SGLang's pool",
                  "offloading on"], rows)


# ---- kernels and training ---------------------------------------------------------------------------


SERVE_HOST_KV = "results/serve_host_kv.json"


@renders(SERVE_HOST_KV)
def serve_host_kv(root: Path) -> str:
    """Offloading on / off per host KV dtype (NOSA_HOST_KV_DTYPE), paired rounds of one run."""
    data = load(root, SERVE_HOST_KV)
    context = str(data["results"][0]["context"])
    rows = []
    for label, variant, key in (("model dtype (fp32)", "nosa+offload+sched", "offload_sched_over_nosa"),
                                ("int8", "nosa+offload+sched+int8", "offload_sched_int8_over_nosa"),
                                ("fp8", "nosa+offload+sched+fp8", "offload_sched_fp8_over_nosa")):
        runs = [r for r in data["results"] if r["backend"] == variant]
        if not runs:
            continue
        speed = paired_speed(data, key)
        layer_steps = sum(r["offload"]["decode_layer_steps"] for r in runs)
        recalled = sum(r["offload"]["recalled_bytes"] for r in runs)
        rows.append([label, f"{speed['lo']:.2f}-{speed['hi']:.2f}", f"**{speed['median']:.2f}** "
                     f"({speed['median_cpu']:.2f})", f"{speed['at_least_0_9']} of {speed['rounds']}",
                     pct(statistics.mean(r["offload"]["hit_rate"] for r in runs)),
                     f"{recalled / max(1, layer_steps) / 1e3:.2f}"])
    return (table(["host KV dtype", "on / off by round", "median on / off (CPU time)", "rounds >= 0.9", "hit rate",
                   "KB recalled per layer and decode step"], rows)
            + f"\n\n{data['model']}, {int(context) // 1024}K tokens, batch {data['results'][0]['batch']}; "
            "offloading with the recall scheduler, against nosa with offloading off, paired rounds"
            + ("; int8 keys with the checkpoint's key factors (python -m nosa.kv_calibrate)."
               if data.get("key_factors") else "."))


@renders("results/select_kernel.json")
def select_kernel(root: Path) -> str:
    data = load(root, "results/select_kernel.json")["select"]
    rows = {(r["case"], r["variant"]): r for r in data["rows"]}
    out = [[case, f"{rows[(case, 'torch')]['layers']} x batch {rows[(case, 'torch')]['batch']}"]
           + [rows[(case, v)][k] for k in ("cpu_ms_per_step", "select_ms_per_step") for v in ("torch", "kernel")]
           + [times(rows[(case, "torch")]["cpu_ms_per_step"] / rows[(case, "kernel")]["cpu_ms_per_step"])]
           for case in data["cases"]]
    flat, by_round = data["longest_over_shortest"], data["longest_over_shortest_by_round"]
    return (table(["harness, context", "layers x requests", "step, torch selection (CPU ms)", "step, C++ selection",
                   "selection alone, torch", "selection alone, C++", "step speed-up"], out)
            + f"\n\nThe tiny Llama's longest context's step over its shortest's, median of {data['rounds']} rounds: "
            f"torch selection {times(flat['torch'])} ({', '.join(times(x) for x in by_round['torch'])}), C++ "
            f"selection {times(flat['kernel'])} ({', '.join(times(x) for x in by_round['kernel'])}). The decode "
            "harness (the backend's step without SGLang), offloading off: bench_serve's tiny Llama (2 layers, 8/2 "
            "heads of 32, the released NosaConfig, A = 0) and SmolLM2-135M's attention (30 layers, 9/3 heads of 64, "
            "the long-context suite's 8K budget, eviction heads on); the selection columns are `StatePool.select` "
            "(compressed-key gather, scores, selection).")
