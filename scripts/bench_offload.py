"""KV offloading benchmarks of the "nosa" SGLang backend ($NOSA_OFFLOAD=1), each side by side in one run.

    .venv/bin/python scripts/bench_offload.py [--quick] [--parts hitrate capacity decode] [--out results/offload.json]

- ``hitrate``: recall traffic and hit rate on the same long prompts and the same device slots
  (exactly the budget per request and KV head), NOSA with its fine-tuned eviction heads
  (``--checkpoint``, default the quickstart's runs/tiny/nosa) vs the same weights with A = 0
  (training-free, InfLLM-v2-style selection). Prompts are the checkpoint's synthetic tasks at its
  training length and 2x, 4x; counted over warm decode steps (the cache in steady state).
- ``capacity``: a fixed device KV budget (``--device-tokens``, default 8192): the longest context
  torch_native serves with that many KV tokens (its pool is the device memory) vs the nosa backend
  with offloading (host pool ``--host-tokens``), which serves a ``--capacity-context`` prompt
  (default 131072, --quick 32768). Tiny random Llama (bench_serve's), released NosaConfig.
- ``decode``: decode step time with offloading on vs off at ``--contexts`` (default 32768), batch 4,
  bench_serve's streamed measurement (median interval between streamed tokens while the whole
  batch decodes), without the recall scheduler (the ``schedule`` part adds it).
- ``schedule``: the same decode step with offloading off, on, and on with the recall scheduler
  ($NOSA_RECALL_SCHEDULER=1: the next layer's predicted blocks prefetched while a layer computes),
  the stall share of the step and the prefetch hit rate per layer (demand misses avoided), from
  the server's per-step timeline (nosa.serve.offload.stats). The three servers are up at once and
  ``--repeats`` off / on + scheduler pairs interleave (a shared machine's load drifts): each
  repeat's ratio and the median are reported.
- ``trace``: Poisson arrivals of requests of mixed lengths (log-uniform in ``--trace-lengths``,
  default 1K-64K; --quick: 512-8K, 8 requests, at least 0.3 arrivals/s) under one device
  budget, with the scheduler, admission off vs
  on ($NOSA_ADMISSION=1): throughput and p50/p99 time per output token. The admission-on
  server's timeline is saved (``--timeline``) and plotted (``--dashboard``, scripts/serve_dashboard.py).
Not a test: nothing is asserted. Writes JSON (and prints each row).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))

from _bench_offload_setup import decode_setup, offload_env, start_server, task_prompts, zero_heads_copy  # noqa: E402
from _bench_offload_stats import TimelineRecorder, offload_counters, read_timeline, summarize_timeline  # noqa: E402


# ---- hit rate: trained eviction heads vs A = 0 ------------------------------------------------
def bench_hitrate(args, work) -> dict:
    from nosa.hf import nosa_config_of

    with open(os.path.join(args.checkpoint, "config.json")) as f:
        cfg = nosa_config_of(json.load(f), source=args.checkpoint)
    if cfg is None:
        raise SystemExit(f"{args.checkpoint} is not a NOSA checkpoint (no 'nosa' section): run the quickstart first")
    train_len = args.train_length
    lengths = [train_len, 2 * train_len] if args.quick else [train_len, 2 * train_len, 4 * train_len]
    variants = {"nosa": args.checkpoint, "a0": zero_heads_copy(args.checkpoint, os.path.join(work, "a0"))}
    rows = []
    for name, ckpt in variants.items():
        stats = os.path.join(work, f"{name}_stats.json")
        budget = cfg.budget_tokens
        server = start_server(ckpt, ["--attention-backend", "nosa", "--page-size", str(cfg.block_size),
                                     "--context-length", str(max(lengths) + args.new_tokens + 64)],
                              os.path.join(work, f"{name}.log"),
                              offload_env(8 * max(lengths) + 4096, args.batch * budget, stats), args.threads)
        try:
            for length in lengths:
                before = offload_counters(stats) if os.path.exists(stats) else None
                for p in task_prompts(ckpt, length, args.prompts, seed=1000 + length):
                    server.generate(p, args.new_tokens)
                time.sleep(1.0)
                after = offload_counters(stats)
                row = {"selection": name, "context": length, "blocks": cfg.num_blocks(length),
                       "budget_blocks": cfg.topk_blocks}
                for key in ("warm_selected", "warm_misses", "recalled_blocks", "recalled_bytes"):
                    row[key] = after[key] - (before[key] if before else 0)
                row["warm_hit_rate"] = round(1 - row["warm_misses"] / max(row["warm_selected"], 1), 4)
                row["max_warm_misses_per_head"] = after["max_warm_misses_per_head"]
                print(json.dumps(row), flush=True)
                rows.append(row)
        finally:
            server.stop()
    summary = {}
    for length in lengths:
        by = {r["selection"]: r for r in rows if r["context"] == length}
        summary[str(length)] = {
            "hit_rate_nosa": by["nosa"]["warm_hit_rate"], "hit_rate_a0": by["a0"]["warm_hit_rate"],
            "recalled_bytes_nosa_over_a0": round(by["nosa"]["warm_misses"] / max(by["a0"]["warm_misses"], 1), 3),
        }
    return {"checkpoint": args.checkpoint, "nosa_config": cfg.to_dict(), "rows": rows, "summary": summary}


# ---- capacity ---------------------------------------------------------------------------------
def bench_capacity(args, work, ckpt) -> dict:
    import torch

    device = args.device_tokens
    context = 32768 if args.quick else args.capacity_context
    g = torch.Generator().manual_seed(0)
    out = {"device_kv_tokens": device}
    # torch_native: its KV pool is the device memory; the longest prompt it accepts
    server = start_server(ckpt, ["--attention-backend", "torch_native", "--max-total-tokens", str(device),
                                 "--context-length", str(context)], os.path.join(work, "native_cap.log"),
                          threads=args.threads)
    try:
        fits = device - args.new_tokens - 8
        ok = server.post("/generate", {"input_ids": torch.randint(0, 256, (fits,), generator=g).tolist(),
                                       "sampling_params": {"max_new_tokens": args.new_tokens, "temperature": 0}})
        over = server.post("/generate", {"input_ids": torch.randint(0, 256, (device + 1,), generator=g).tolist(),
                                         "sampling_params": {"max_new_tokens": args.new_tokens, "temperature": 0}})
        out["torch_native"] = {"served_context": fits if ok[0] == 200 else None, "status_at_budget_plus_1": over[0],
                               "refusal": str(over[1])[:200]}
    finally:
        server.stop()
    stats = os.path.join(work, "cap_stats.json")
    server = start_server(ckpt, ["--attention-backend", "nosa", "--page-size", "64", "--context-length", str(context),
                                 "--chunked-prefill-size", "4096"], os.path.join(work, "nosa_cap.log"),
                          offload_env(context + 4096, device, stats), args.threads)
    try:
        prompt = torch.randint(0, 256, (context - args.new_tokens - 8,), generator=g).tolist()
        start = time.perf_counter()
        status, body = server.post("/generate", {"input_ids": prompt, "sampling_params": {
            "max_new_tokens": args.new_tokens, "temperature": 0, "ignore_eos": True}}, timeout=7200)
        seconds = time.perf_counter() - start
        out["nosa_offload"] = {"served_context": len(prompt) + args.new_tokens if status == 200 else None,
                               "status": status, "seconds": round(seconds, 1),
                               "generated": len(body["output_ids"]) if status == 200 else str(body)[:200],
                               **offload_counters(stats)}
    finally:
        server.stop()
    if out["torch_native"]["served_context"] and out["nosa_offload"]["served_context"]:
        out["capacity_ratio"] = round(out["nosa_offload"]["served_context"] / out["torch_native"]["served_context"], 2)
    print(json.dumps(out), flush=True)
    return out

# ---- decode step, offloading on vs off ---------------------------------------------------------
def bench_decode(args, work, ckpt) -> dict:
    from _serve_measure import measure

    contexts, server_args = decode_setup(args)
    rows = []
    for mode in ("off", "on"):
        stats = os.path.join(work, f"decode_{mode}_stats.json")
        flags, env = server_args(mode, stats)
        server = start_server(ckpt, flags, os.path.join(work, f"decode_{mode}.log"), env, args.threads)
        try:
            measure(server, 512, args.batch, 16)  # warm-up
            for context in contexts:
                row = {"offload": mode, **measure(server, context, args.batch, args.decode_tokens)}
                if mode == "on":
                    row.update(offload_counters(stats))
                print(json.dumps(row), flush=True)
                rows.append(row)
        finally:
            server.stop()
    ratio = {}
    for context in contexts:
        by = {r["offload"]: r for r in rows if r["context"] == context}
        ratio[str(context)] = round(by["off"]["ms_per_decode_step"] / by["on"]["ms_per_decode_step"], 3)
    return {"rows": rows, "speed_on_over_off": ratio}


# ---- recall scheduling: decode step off / on / on + scheduler ------------------------------------
def bench_schedule(args, work, ckpt) -> dict:
    """Off, on and on + scheduler side by side. The three servers are up at once (an idle one sleeps,
    ``--sleep-on-idle``) and the measurements interleave: each of ``--repeats`` repeats measures off
    then on + scheduler back to back (and "on" in the first repeat), so each repeat's ratio compares two
    measurements minutes apart on a shared machine whose load drifts; the median ratio is the figure."""
    import statistics

    from _serve_measure import measure

    contexts, server_args = decode_setup(args)
    repeats = 1 if args.quick else args.repeats
    rows, servers, stats = [], {}, {}
    try:
        for mode in ("off", "on", "scheduled"):
            stats[mode] = os.path.join(work, f"sched_{mode}_stats.json")
            flags, env = server_args(mode, stats[mode])
            servers[mode] = start_server(ckpt, [*flags, "--sleep-on-idle"], os.path.join(work, f"sched_{mode}.log"),
                                         env, args.threads)
        for server in servers.values():
            measure(server, 512, args.batch, 16)  # warm-up
        for context in contexts:
            for rep in range(repeats):
                for mode in ("off", "on", "scheduled") if rep == 0 else ("off", "scheduled"):
                    since = time.time()
                    row = {"mode": mode, "repeat": rep, **measure(servers[mode], context, args.batch,
                                                                  args.decode_tokens)}
                    if mode != "off":
                        time.sleep(1.5)
                        row.update(summarize_timeline(read_timeline(stats[mode], since), args.batch))
                    print(json.dumps(row), flush=True)
                    rows.append(row)
    finally:
        for server in servers.values():
            server.stop()
    ratio = {}
    for context in contexts:
        by = {(r["mode"], r["repeat"]): r for r in rows if r["context"] == context}
        pairs = [round(by["off", k]["ms_per_decode_step"] / by["scheduled", k]["ms_per_decode_step"], 3)
                 for k in range(repeats)]
        ratio[str(context)] = {
            "on": round(by["off", 0]["ms_per_decode_step"] / by["on", 0]["ms_per_decode_step"], 3),
            "scheduled_per_repeat": pairs, "scheduled_median": round(statistics.median(pairs), 3),
            "scheduled_stall_share_per_repeat": [by["scheduled", k].get("stall_share") for k in range(repeats)],
            "on_stall_share": by["on", 0].get("stall_share")}
    return {"repeats": repeats, "rows": rows, "speed_over_off": ratio}


# ---- a Poisson trace, admission off vs on ----------------------------------------------------
def bench_trace(args, work, ckpt) -> dict:
    import math
    import random
    import statistics
    import threading

    from _serve_measure import stream_generate

    from nosa.config import NosaConfig

    cfg = NosaConfig()
    lo, hi = (512, 8192) if args.quick else args.trace_lengths
    count = args.trace_requests if not args.quick else min(args.trace_requests, 8)
    rate = args.trace_rate if not args.quick else max(args.trace_rate, 0.3)
    rng = random.Random(0)
    lengths = [int(math.exp(rng.uniform(math.log(lo), math.log(hi)))) for _ in range(count)]
    arrivals, t = [], 0.0
    for _ in range(count):
        t += rng.expovariate(rate)
        arrivals.append(t)
    prompts = [[rng.randrange(256) for _ in range(n)] for n in lengths]
    device = args.trace_budget_requests * cfg.budget_tokens
    host = sum(lengths) + count * (args.trace_new_tokens + 64) + 4096
    out = {"lengths": lengths, "arrivals_s": [round(a, 2) for a in arrivals], "device_kv_tokens": device,
           "new_tokens": args.trace_new_tokens, "rate_per_s": rate}
    for mode in ("admission_off", "admission_on"):
        stats = os.path.join(work, f"trace_{mode}_stats.json")
        env = {**offload_env(host, device, stats), "NOSA_RECALL_SCHEDULER": "1"}
        if mode == "admission_on":
            env.update({"NOSA_ADMISSION": "1", "NOSA_DEVICE_EXTRA_SLOTS": str(args.trace_extra_slots)})
        server = start_server(ckpt, ["--attention-backend", "nosa", "--page-size", str(cfg.block_size),
                                     "--context-length", str(hi + args.trace_new_tokens + 64), "--chunked-prefill-size",
                                     "4096"], os.path.join(work, f"trace_{mode}.log"), env, args.threads)
        try:
            stream_generate(server.url, prompts[0][:256], 4, time.perf_counter(), [])  # warm-up
            time.sleep(1.5)
            start = time.perf_counter()
            since = time.time()
            recorder = TimelineRecorder(stats, since)
            streams = [[] for _ in prompts]

            def run(i):
                time.sleep(max(0.0, arrivals[i] - (time.perf_counter() - start)))
                stream_generate(server.url, prompts[i], args.trace_new_tokens, start, streams[i])

            threads = [threading.Thread(target=run, args=(i,)) for i in range(count)]
            for th in threads:
                th.start()
            for th in threads:
                th.join()
            end = max(s[-1][0] for s in streams)
            tpot = [(s[-1][0] - s[0][0]) / max(s[-1][1] - s[0][1], 1) for s in streams]
            ttft = [s[0][0] - a for s, a in zip(streams, arrivals)]
            time.sleep(1.5)
            timeline = recorder.stop()
            row = {"mode": mode, "seconds": round(end, 2),
                   "output_tokens_per_s": round(sum(s[-1][1] for s in streams) / end, 3),
                   "tpot_ms_p50": round(1000 * statistics.median(tpot), 2),
                   "tpot_ms_p99": round(1000 * sorted(tpot)[min(len(tpot) - 1, int(0.99 * len(tpot)))], 2),
                   "ttft_s_p50": round(statistics.median(ttft), 2),
                   "ttft_s_p99": round(sorted(ttft)[min(len(ttft) - 1, int(0.99 * len(ttft)))], 2),
                   "tpot_ms_per_request": [round(1000 * x, 1) for x in tpot],
                   "ttft_s_per_request": [round(x, 2) for x in ttft],
                   "max_batch": max((r["batch"] for r in timeline), default=0), **summarize_timeline(timeline)}
            with open(stats) as f:
                final = json.load(f)
            row["admission"] = final.get("admission")
            print(json.dumps(row), flush=True)
            out[mode] = row
            if mode == "admission_on" and args.timeline:
                with open(args.timeline, "w") as f:
                    json.dump(timeline, f)
        finally:
            server.stop()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", nargs="+", default=["hitrate", "capacity", "decode"],
                    choices=["hitrate", "capacity", "decode", "schedule", "trace"])
    ap.add_argument("--checkpoint", default=os.path.join(ROOT, "runs", "tiny", "nosa"),
                    help="a NOSA checkpoint with fine-tuned eviction heads (hitrate)")
    ap.add_argument("--train-length", type=int, default=None, help="its training length (default: from the run)")
    ap.add_argument("--prompts", type=int, default=4, help="prompts per length (hitrate)")
    ap.add_argument("--device-tokens", type=int, default=8192, help="device KV budget (capacity)")
    ap.add_argument("--capacity-context", type=int, default=131072)
    ap.add_argument("--contexts", type=int, nargs="+", default=[32768], help="decode part")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=64, help="tokens generated per request (hitrate, capacity)")
    ap.add_argument("--decode-tokens", type=int, default=160,
                    help="tokens per request in the decode part (enough steps with the whole batch decoding)")
    ap.add_argument("--threads", type=int, default=None, help="OMP_NUM_THREADS of the servers")
    ap.add_argument("--repeats", type=int, default=3,
                    help="schedule: off / on + scheduler pairs, interleaved (--quick: 1)")
    ap.add_argument("--trace-lengths", type=int, nargs=2, default=[1024, 65536], help="trace: prompt lengths lo hi")
    ap.add_argument("--trace-requests", type=int, default=16)
    ap.add_argument("--trace-rate", type=float, default=0.1,
                    help="trace: Poisson arrivals per second (0.1: the prefill work outlasts the arrivals)")
    ap.add_argument("--trace-new-tokens", type=int, default=48)
    ap.add_argument("--trace-budget-requests", type=int, default=8, help="trace: device budget in requests' budgets")
    ap.add_argument("--trace-extra-slots", type=int, default=4, help="trace: NOSA_DEVICE_EXTRA_SLOTS with admission")
    ap.add_argument("--timeline", default=os.path.join(ROOT, "results", "serve_timeline.json"),
                    help="trace: the admission-on server's per-step timeline")
    ap.add_argument("--dashboard", default=os.path.join(ROOT, "results", "serve_dashboard.png"))
    ap.add_argument("--quick", action="store_true", help="hitrate at 1x/2x, capacity at 32K, decode at 8K")
    ap.add_argument("--out", default=os.path.join(ROOT, "results", "offload.json"))
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if args.quick:
        args.new_tokens = min(args.new_tokens, 32)
    if "hitrate" in args.parts and args.train_length is None:
        run = os.path.join(args.checkpoint, "nosa_train.json")
        args.train_length = 2048
        if os.path.exists(run):
            with open(run) as f:
                args.train_length = int(json.load(f).get("seq_len", 2048))

    from bench_serve import build_model

    work = tempfile.mkdtemp(prefix="nosa_offload_")
    report = {"command": " ".join(sys.argv), "device": "cpu", "cpus": os.cpu_count(), "threads": args.threads}
    ckpt = None
    if {"capacity", "decode", "schedule", "trace"} & set(args.parts):
        ckpt = os.path.join(work, "tiny-llama")
        build_model(ckpt)
        report["model"] = "llama 2 layers, hidden 256, GQA 8/2, fp32, random weights (bench_serve's)"
    if "hitrate" in args.parts:
        report["hitrate"] = bench_hitrate(args, work)
    if "capacity" in args.parts:
        report["capacity"] = bench_capacity(args, work, ckpt)
    if "decode" in args.parts:
        report["decode"] = bench_decode(args, work, ckpt)
    if "schedule" in args.parts:
        report["schedule"] = bench_schedule(args, work, ckpt)
    if "trace" in args.parts:
        report["trace"] = bench_trace(args, work, ckpt)
        if args.timeline and args.dashboard:
            from serve_dashboard import load_timeline, plot

            plot(load_timeline(args.timeline), args.dashboard, "nosa serving dashboard (trace, admission on)")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
