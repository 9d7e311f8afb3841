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
place of the defaults (nosa.plan_checks, which also holds the checks against measured and published
figures). docs/plan.md derives each formula and compares predictions with measurements.
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from nosa import kvquant, plan_checks
from nosa.config import NosaConfig
from nosa.plan_model import (
    GPUS,
    LINKS,
    MODELS,
    Gpu,
    Link,
    batch_for_rate,
    hit_rate_of,
    model_from_config,
    nosa_config_for,
    plan,
    shares_where_recall_hides,
)


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
        plan_checks.calibrate_cpu(args.calibrate_cpu, args.onoff_json, args.out)
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
        cal = plan_checks.calibration(args.calibration)
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
