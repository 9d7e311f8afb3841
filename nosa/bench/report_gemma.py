"""The docs' tables of Gemma 3 270M served at long context (scripts/bench_gemma.py:
results/gemma3_serve.json at 16K, results/gemma3_serve_32k.json at 32K): registered like
``report_tables``' renderers."""

from __future__ import annotations

from pathlib import Path

from nosa.bench.report_tables import load, pct, renders, table, times

GEMMA = "results/gemma3_serve.json"
GEMMA_32K = "results/gemma3_serve_32k.json"
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
