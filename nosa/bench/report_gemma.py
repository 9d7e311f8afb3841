"""The docs' tables of Gemma 3 270M served at long context (scripts/bench_gemma.py:
results/gemma3_serve.json at 16K, results/gemma3_serve_32k.json at 32K, results/gemma3_captured.json:
eager against the CPU graph runner): registered like
``report_tables``' renderers."""

from __future__ import annotations

from pathlib import Path

from nosa.bench.report_tables import load, pct, renders, table, times

GEMMA = "results/gemma3_serve.json"
GEMMA_32K = "results/gemma3_serve_32k.json"
CAPTURED = "results/gemma3_captured.json"
SERVERS = (("torch_native", "torch_native"), ("nosa_off", "nosa, offloading off"),
           ("nosa_offload", "nosa, offloading + recall scheduler"))


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f}"


@renders(GEMMA)
def gemma3_serve(root: Path) -> str:
    return _served(load(root, GEMMA))


@renders(GEMMA_32K)
def gemma3_serve_32k(root: Path) -> str:
    return _served(load(root, GEMMA_32K))


def _served(data: dict) -> str:
    """One bench_gemma run: the three servers side by side, then what it says."""
    rows = [[label, data[k]["prefill_s"], data[k]["ms_per_decode_step"], _mb(data[k]["device_kv_bytes_per_request"])]
            for k, label in SERVERS]
    c, off, cap = data["nosa_config"], data["nosa_offload"], data["capacity"]
    parts = ", ".join(f"{k.replace('_', ' ')} {_mb(v)}" for k, v in off["device_bytes_per_request_parts"].items())
    lines = [
        table(["server", "prefill s", "decode ms / step", "device KV MB per request"], rows),
        "",
        f"{data['context'] // 1024}K-token request (<bos>, then random ids), {data['new_tokens']} greedy tokens, "
        f"{data['dtype']} on this CPU; {data['model']}: {len(data['full_layers'])} full-attention layers of "
        f"{data['layers']}, sliding window {data['sliding_window']}. NOSA with A = 0 (training-free): "
        f"{c['topk_blocks']} blocks of {c['block_size']}, {c['window_blocks']} window, {c['query_blocks']} picks.",
        "",
        f"- decode: nosa with offloading {times(data['decode_speed_nosa_over_native'])} the speed of torch_native, "
        f"{times(data['offload_on_over_off_decode_speed'])} of nosa with offloading off; prefill "
        f"{times(data['prefill_nosa_over_native'])} torch_native's time, {times(data['offload_prefill_over_off'])} "
        "offloading off's.",
        f"- device KV per request with offloading: {parts} (MB).",
        f"- in torch_native's device bytes for one request, {cap['nosa_offload_requests']} such requests fit "
        f"(computed from the allocations, not served concurrently).",
        f"- device cache hit rate {pct(off['warm_hit_rate'])} on warm steps ({pct(off['hit_rate_all_steps'])} "
        f"over all steps), {off['recalled_bytes_per_step'] / 1e3:.0f} KB recalled per decode step.",
    ]
    return "\n".join(lines)


@renders(CAPTURED)
def gemma3_captured(root: Path) -> str:
    """bench_gemma --captured: decode per request length, eager and under SGLang's CPU graph runner."""
    data = load(root, CAPTURED)
    eager, graphs = (data["servers"][n] for n in ("eager", "captured"))
    rows = [[f"{e['context'] // 1024}K", e["ms_per_decode_step"], g["ms_per_decode_step"],
             f"**{times(data['captured_over_eager_speed'][str(e['context'])])}**"]
            for e, g in zip(eager["results"], graphs["results"])]
    return (table(["request", "eager ms / step", "CPU graph runner ms / step", "captured speed over eager"], rows)
            + f"\n\nBoth servers sized for {data['server_context'] // 1024}K tokens, offloading and the recall "
            f"scheduler on, one request at a time, {data['new_tokens']} greedy tokens each; server start-up "
            f"{eager['server_start_s']:.0f} s eager, {graphs['server_start_s']:.0f} s with the graph runner "
            "(it compiles the model).")
