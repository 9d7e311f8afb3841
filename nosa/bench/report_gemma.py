"""The docs' tables of Gemma 3 270M served at long context (scripts/bench_gemma.py:
results/gemma3_serve.json at 16K, results/gemma3_serve_32k.json at 32K, results/gemma3_captured.json:
eager against the CPU graph runner, results/gemma3_onoff.json: offloading on against off in paired
rounds): registered like
``report_tables``' renderers."""

from __future__ import annotations

from pathlib import Path

from nosa.bench.report_tables import load, pct, renders, table, times

GEMMA = "results/gemma3_serve.json"
GEMMA_32K = "results/gemma3_serve_32k.json"
CAPTURED = "results/gemma3_captured.json"
ONOFF = "results/gemma3_onoff.json"
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


@renders(ONOFF, GEMMA_32K)
def gemma3_onoff(root: Path) -> str:
    """bench_gemma --onoff: per round both nosa servers' prefill and decode, the on/off ratios,
    medians; then the bytes a decode step reads, and the speed-up over torch_native they allow
    against the one measured (results/gemma3_serve_32k.json)."""
    data, served = load(root, ONOFF), load(root, GEMMA_32K)
    got = {(r["round"], r["server"]): r for r in data["results"]}
    rows = [[r["round"] + 1, got[(r["round"], "nosa_off")]["ms_per_decode_step"],
             got[(r["round"], "nosa_offload")]["ms_per_decode_step"], times(r["decode_speed_on_over_off"]),
             got[(r["round"], "nosa_off")]["prefill_s"], got[(r["round"], "nosa_offload")]["prefill_s"],
             times(r["prefill_on_over_off"])] for r in data["by_round"]]
    rows.append(["**median**", "", "", f"**{times(data['decode_speed_on_over_off'])}**", "", "",
                 f"**{times(data['prefill_on_over_off'])}**"])
    c = data["nosa_config"]
    return (table(["round", "decode ms / step, off", "on", "decode speed on / off", "prefill s, off", "on",
                   "prefill time on / off"], rows)
            + f"\n\n{data['context'] // 1024}K-token request (<bos>, then random ids), {data['new_tokens']} greedy "
            f"tokens, {data['dtype']}; both servers up, measured in turn (the other paused), a different one first "
            f"each round. NOSA with A = 0: {c['topk_blocks']} blocks of {c['block_size']}, {c['window_blocks']} "
            f"window, {c['query_blocks']} picks; on: offloading and the recall scheduler.\n\n"
            + _bound(data["decode_bytes"], served))


def _bound(b: dict, served: dict) -> str:
    """What the shape allows: decode bytes per step, torch_native against nosa, and the measured speed-up."""
    gb = lambda n: f"{n / 1e9:.2f} GB"  # noqa: E731
    parts = ", ".join(f"{k.replace('_', ' ')} {n / 1e6:.1f} MB" for k, n in b["nosa_kv_parts"].items())
    return (f"What this shape allows: a decode step reads every weight once ({gb(b['weights'])}, of which the LM head "
            f"{gb(b['lm_head'])}) and its KV: torch_native {gb(b['torch_native_kv'])} (every "
            f"layer's whole context), nosa {gb(b['nosa_kv'])} ({parts}). A step bound by these bytes, as a GPU's "
            f"decode is, would be at most **{times(b['bound'])}** faster with nosa than with torch_native. "
            f"Measured here at {served['context'] // 1024}K (results/gemma3_serve_32k.json): "
            f"**{times(served['decode_speed_nosa_over_native'])}**, past that bound: on this CPU torch_native's "
            "step costs more than its bytes (it copies each layer's whole context out of the pool per request, "
            "and builds a window mask over it in the sliding layers).")
