"""The docs' tables of the lent H200 (results/gpu_h200.json, joined by scripts/gpu_results.py from
scripts/gpu_check.sh's output): registered like ``report_tables``' renderers."""

from __future__ import annotations

from pathlib import Path

from nosa.bench.report_tables import load, pct, renders, table, times

GPU = "results/gpu_h200.json"


def _ms(seconds: float) -> str:
    return f"{1000 * seconds:.3f}"


@renders(GPU)
def gpu_kernels(root: Path) -> str:
    data = load(root, GPU)
    k, tests = data["bench_kernels"], data["tests"]
    rows = [[f"slot decode, {r['context'] // 1024}K, batch {r['batch']}", _ms(r["dense_s"]), _ms(r["nosa_s"]),
             times(r["dense_over_nosa"])] for r in k["decode_slots"]]
    rows += [[f"paged decode, {r['context'] // 1024}K, batch {r['batch']}", _ms(r["dense_s"]), _ms(r["nosa_triton_s"]),
              times(r["dense_over_nosa_triton"])] for r in k["decode_paged"]]
    rows += [[f"prefill forward, {r['context'] // 1024}K", _ms(r["dense_fwd_s"]), _ms(r["nosa_fwd_s"]),
              times(r["dense_over_nosa_fwd"])] for r in k["prefill"]]
    rows += [[f"prefill forward + backward, {r['context'] // 1024}K", _ms(r["dense_fwd_bwd_s"]),
              _ms(r["nosa_fwd_bwd_s"]), times(r["dense_over_nosa_fwd_bwd"])] for r in k["prefill"]]
    shape = k["shape"]
    graph = data["graph_check"]["results"]
    first = graph[0]

    def mode(r):
        if not r["offload"]:
            return "offloading off"
        host = r.get("host_kv_dtype", "model")
        return "offloading on" + ("" if host == "model" else f", {host} host pool")
    lines = [
        f"Kernel tests on the GPU: {tests['passed']} passed, {tests['failed']} failed, {tests['skipped']} skipped "
        f"({tests['seconds']:.0f} s; the skips are CPU-path tests and FlashInfer's, which run after it is installed"
        + (", below)." if "flashinfer_tests" in data else "; it did not travel in that run)."),
        "",
        table(["Triton kernel vs dense (bf16, Hq 32 / Hkv 8, D 128, 64 blocks of 64)", "dense ms", "nosa ms",
               "dense / nosa"], rows),
        "",
        f"- Dense is SDPA (FlashAttention) over the whole context; decode rows are one step of the batch "
        f"(largest error against the torch reference {k['decode_slots'][0]['max_abs_err_vs_ref']:g}).",
        f"- The serving decode step captured in a CUDA graph (scripts/graph_check.py, {first['batch']} requests of "
        f"{min(first['prompts'])}-{max(first['prompts'])} tokens, 2 layers, {first['steps']} steps), replay vs "
        "eager ms: " + "; ".join(f"{mode(r)} {r['replay_ms']} vs {r['eager_ms']}" if r.get("ok") else
                                 f"{mode(r)} FAILED ({r.get('error', 'outputs differ')})" for r in graph)
        + f". Outputs equal to eager (largest difference {max(r.get('max_abs_diff', 0) for r in graph):g}), "
        f"selections equal: {all(r.get('selections_equal') for r in graph)}.",
    ]
    del shape
    return "\n".join(lines)


@renders(GPU)
def gpu_flashinfer(root: Path) -> str:
    """Triton vs FlashInfer slot decode (gpu_check.sh's bench_flashinfer step, after FlashInfer's JIT build)."""
    data = load(root, GPU)
    build, tests = data["flashinfer_build"], data.get("flashinfer_tests")
    rows, ratios = [], []
    for r in data["bench_flashinfer"]["decode_slots"]:
        where = f"{r['context'] // 1024}K, batch {r['batch']}"
        if "flashinfer_s" not in r:
            rows.append([where, _ms(r["dense_s"]), _ms(r["triton_s"]), "-", "-", r.get("flashinfer", r.get("error"))])
            continue
        ratios.append(r["triton_over_flashinfer"])
        rows.append([where, _ms(r["dense_s"]), _ms(r["triton_s"]), _ms(r["flashinfer_s"]),
                     times(r["triton_over_flashinfer"]), f"{r['faster']} (largest error vs the reference "
                     f"{r['flashinfer_max_abs_err_vs_ref']:g})"])
    built = (f"FlashInfer {build.get('flashinfer', '?')}: the NOSA variant's JIT module "
             f"({build.get('module')}) built in {build['seconds']:.0f} s" if build.get("ok")
             else f"FlashInfer's JIT build of the NOSA variant FAILED: {build.get('error', '')[-300:]}")
    tested = (f"; its GPU test against the reference: {tests['passed']} passed, {tests['failed']} failed, "
              f"{tests['skipped']} skipped" if tests else "")
    verdict = (f"Triton over FlashInfer: {times(1 / max(ratios))} to {times(1 / min(ratios))} as fast."
               if ratios else "FlashInfer did not run; Triton stays the default.")
    return "\n".join([
        built + tested + ".",
        "",
        table(["slot decode (bf16, Hq 32 / Hkv 8, D 128, 65 slots of 64 per KV head)", "dense SDPA ms", "Triton ms",
               "FlashInfer ms", "FlashInfer's speed over Triton's", "faster"], rows),
        "",
        verdict,
    ])


@renders(GPU)
def gpu_train(root: Path) -> str:
    """bench_train --like smollm2-135m on the H200: the sparse-aware fine-tune's step, dense vs NOSA,
    before and after the selection's GPU chunks."""
    data = load(root, GPU)
    after, before = data["train_speed"], data.get("train_speed_before")
    earlier = {r["seq_len"]: r for r in before["by_seq_len"]} if before else {}
    rows = []
    for r in after["by_seq_len"]:
        was = earlier.get(r["seq_len"], {}).get("step_s", {}).get("nosa", {}).get("median")
        step = r["step_s"]
        rows.append([f"{r['seq_len']:,}", f"{step['dense']['median']:.3f}", f"{step['nosa']['median']:.3f}",
                     times(r["ratio_nosa_over_dense"]), f"{was:.3f}" if was else "-",
                     f"{r['step_cpu_s']['nosa']:.3f}", f"{r['peak_memory_gib']:.1f}"])
    longest = after["by_seq_len"][-1]
    per_hour = 3600 / longest["step_s"]["nosa"]["median"]
    return "\n".join([
        table(["tokens per row", "dense s / step", "NOSA s / step", "NOSA / dense", "NOSA s / step before",
               "NOSA host CPU s / step", "peak GiB"], rows),
        "",
        f"{after['parameters'] / 1e6:.0f}M parameters of SmolLM2-135M's shape (random weights), "
        f"{after['micro_batch']} row per step, the NosaConfig of `{after['config']}`, AdamW in bf16 autocast, "
        f"median of {len(longest['step_s']['nosa']['all'])} steps after warm-up. At its "
        f"{longest['seq_len']:,}-token step, an hour holds about {per_hour:,.0f} NOSA steps "
        "(the fine-tune also runs the frozen teacher's forward for its KL).",
    ])


@renders(GPU)
def gpu_prefill_tune(root: Path) -> str:
    """scripts/tune_sparse_prefill.py's sweep of the sparse prefill kernel's launch."""
    t = load(root, GPU)["tune_prefill"]

    def launch(c: dict) -> str:  # the per-kernel launch of the default and of the recommended config
        return "; ".join(f"{name} {o['num_warps']} warps" + (f", {o['num_stages']} stages" if "num_stages" in o else "")
                         for name, o in c["launch"].items()) + f"; tile {c['tile']} rows"

    timed = [c for c in t["configs"] if "forward_ms" in c]
    rows = [[what, launch(c), f"{c['forward_ms']:.2f}", f"{c['forward_backward_ms']:.2f}",
             times(c["speedup_vs_dense"]["forward"]), times(c["speedup_vs_dense"]["forward_backward"])]
            for what, c in (("before (the earlier default)", t["default"]),
                            ("chosen (the new default)", t["recommended"]))]
    best = t["best"]
    return "\n".join([
        table(["sparse prefill launch, 32K", "launch", "forward ms", "forward + backward ms", "dense / nosa forward",
               "dense / nosa forward + backward"], rows),
        "",
        f"{len(timed)} launches timed (warps {t['grid']['warps']} x stages {t['grid']['stages']} x tiles "
        f"{t['grid']['tiles']}, each checked against the earlier default's outputs and gradients first), "
        f"interleaved with dense causal SDPA ({t['dense_ms']['forward']:.2f} / {t['dense_ms']['forward_backward']:.2f} "
        f"ms). Fastest forward: {best['forward']['config']} ({best['forward']['ms']:.2f} ms); fastest forward + "
        f"backward: {best['forward_backward']['config']} ({best['forward_backward']['ms']:.2f} ms). The chosen launch "
        f"runs the forward {times(t['recommended']['speedup_vs_default']['forward'])} and the forward + backward "
        f"{times(t['recommended']['speedup_vs_default']['forward_backward'])} as fast as the earlier one.",
    ])


@renders(GPU)
def gpu_recall(root: Path) -> str:
    r = load(root, GPU)["bench_recall"]
    rows = [[f"{x['items']} ({x['bytes'] / 2**20:.0f} MiB)", f"{x['batched_gbps']:.1f}",
             f"{x['per_block_gbps']:.2f}", f"{x['one_copy_gbps']:.1f}", times(x["batched_over_per_block"], 0),
             pct(x["batched_fraction_of_one_copy"], 0)] for x in r["rows"]]
    q = [[x["items"], f"{x['bfloat16_s'] * 1e3:.2f}", f"{x['int8_s'] * 1e3:.2f}", f"{x['float8_e4m3fn_s'] * 1e3:.2f}",
          pct(x["int8_bytes_over_bf16"], 0), times(x["int8_speedup_over_bf16"]),
          times(x["float8_e4m3fn_speedup_over_bf16"]),
          "yes" if all(x[f"{n}_matches_spec"] for n in ("bfloat16", "int8", "float8_e4m3fn")) else "NO"]
         for x in r.get("host_dtypes", [])]
    return "\n".join([
        f"The link: one 1 GiB pinned host -> device copy ran at {r['link_gbps']:.1f} GB/s (PCIe Gen5 x16).",
        "",
        table(["items per call (K + V + cis)", "batched GB/s", "one copy per block GB/s", "one large copy GB/s",
               "batched / per block", "batched / one copy"], rows),
        "",
        "The same batched recall from a quantized host pool (`NOSA_HOST_KV_DTYPE`, nosa.kvquant: one byte per "
        "element plus a float32 scale per token and KV head, dequantized into the bf16 slots in the same launch):",
        "",
        table(["items", "bf16 ms", "int8 ms", "fp8 ms", "bytes vs bf16", "int8 speed-up", "fp8 speed-up",
               "equal to the spec"], q),
    ])


@renders(GPU)
def plan_calibration(root: Path) -> str:
    """nosa.plan's formulas against the H200's measurements."""
    from nosa.plan_checks import against_gpu  # optional: torch (nosa.plan_checks imports it; this module does not)

    rows = [[r["what"], f"{r['predicted_s'] * 1e3:.3f}", f"{r['measured_s'] * 1e3:.3f}",
             f"{r['predicted_over_measured']:.2f}"] for r in against_gpu(load(root, GPU))]
    return table(["one decode layer / one recall call", "predicted ms (data sheet roofline)", "measured ms",
                  "predicted / measured"], rows)


PLAN_CPU = "results/plan_cpu.json"


@renders(PLAN_CPU)
def plan_cpu(root: Path) -> str:
    """nosa.plan's KV-read term against bench_serve's CPU runs (python -m nosa.plan --calibrate-cpu)."""
    data = load(root, PLAN_CPU)
    rows = [[r["backend"], f"{r['context'] // 1024}K, batch {r['batch']}", f"{r['predicted_s'] * 1e3:.1f}",
             f"{r['measured_s'] * 1e3:.1f}", f"{100 * r['error']:+.0f}%"] for r in data["rows"]]
    text = (table(["backend", "context", "predicted ms per decode step", "measured ms", "error"], rows)
            + f"\n\nMemory bandwidth measured here: {data['memory_bytes_per_s'] / 1e9:.1f} GB/s (torch copy, read + "
            f"write, {data['threads']} threads); the measured runs: `{data['serve_json']}`.")
    o = data.get("onoff")
    if o:
        text += (f" {o['model']} served at {o['context'] // 1024}K, batch {o['batch']}, offloading on over off: "
                 f"predicted {o['predicted_on_over_off']:.2f} at its measured warm hit rate "
                 f"({pct(o['hit_rate'])}), measured {o['measured_on_over_off']:.2f} (median of {o['rounds']} paired "
                 f"rounds, `{data['onoff_json']}`): error {100 * o['error']:+.0f}%.")
    return text
