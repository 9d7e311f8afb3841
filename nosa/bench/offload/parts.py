"""The parts of the offloading benchmark (scripts/bench_offload.py): hit rate of fitted eviction heads
vs A = 0, capacity at one device KV budget, decode step with offloading on vs off, recall
scheduling, and a Poisson trace with admission off vs on."""

from __future__ import annotations

import json
import math
import os
import random
import statistics
import tempfile
import threading
import time

import torch

from nosa.bench.offload.servers import decode_setup, offload_env, start_server, task_prompts, zero_heads_copy
from nosa.bench.results import write_result
from nosa.bench.server.dashboard import load_timeline, plot
from nosa.bench.server.measure import measure, random_prompts, stream_generate
from nosa.bench.server.stats import TimelineRecorder, offload_counters, read_timeline, summarize_timeline
from nosa.bench.tiny_checkpoint import make_bench_checkpoint
from nosa.config import NosaConfig
from nosa.hf import nosa_config_of


# ---- hit rate: trained eviction heads vs A = 0 ------------------------------------------------
def bench_hitrate(args, work) -> dict:
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
        nosa_row, a0_row = (_row(rows, length, selection=s) for s in ("nosa", "a0"))
        summary[str(length)] = {
            "hit_rate_nosa": nosa_row["warm_hit_rate"], "hit_rate_a0": a0_row["warm_hit_rate"],
            "recalled_bytes_nosa_over_a0": round(nosa_row["warm_misses"] / max(a0_row["warm_misses"], 1), 3),
        }
    return {"checkpoint": args.checkpoint, "nosa_config": cfg.to_dict(), "rows": rows, "summary": summary}


# ---- capacity ---------------------------------------------------------------------------------
def bench_capacity(args, work, ckpt) -> dict:
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
    contexts, server_args = decode_setup(args)
    rows = []
    for mode in ("off", "on"):
        stats = os.path.join(work, f"decode_{mode}_stats.json")
        flags, env = server_args(mode, stats)
        server = start_server(ckpt, flags, os.path.join(work, f"decode_{mode}.log"), env, args.threads)
        try:
            measure(server, random_prompts(512, args.batch), 16, warm_up=True)
            for context in contexts:
                row = {"offload": mode, "context": context,
                       **measure(server, random_prompts(context, args.batch), args.decode_tokens)}
                if mode == "on":
                    row.update(offload_counters(stats))
                print(json.dumps(row), flush=True)
                rows.append(row)
        finally:
            server.stop()
    ratio = {str(c): round(_row(rows, c, offload="off")["ms_per_decode_step"]
                           / _row(rows, c, offload="on")["ms_per_decode_step"], 3) for c in contexts}
    return {"rows": rows, "speed_on_over_off": ratio}


# ---- recall scheduling: decode step off / on / on + scheduler ------------------------------------
def bench_schedule(args, work, ckpt) -> dict:
    """Off, on and on + scheduler side by side. The three servers are up at once (an idle one sleeps,
    ``--sleep-on-idle``) and the measurements interleave: each of ``--repeats`` repeats measures off
    then on + scheduler back to back (and "on" in the first repeat), so each repeat's ratio compares two
    measurements minutes apart on a shared machine whose load drifts; the median ratio is the figure."""
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
            measure(server, random_prompts(512, args.batch), 16, warm_up=True)
        for context in contexts:
            for rep in range(repeats):
                for mode in ("off", "on", "scheduled") if rep == 0 else ("off", "scheduled"):
                    since = time.time()
                    row = {"mode": mode, "repeat": rep, "context": context,
                           **measure(servers[mode], random_prompts(context, args.batch), args.decode_tokens)}
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


def run(args) -> None:
    """The parts ``args.parts`` (as scripts/bench_offload.py parses them) in that order, each row
    printed as it is measured; the report written to ``args.out``."""
    work = tempfile.mkdtemp(prefix="nosa_offload_")
    report = {"device": "cpu", "threads": args.threads}
    ckpt = None
    if {"capacity", "decode", "schedule", "trace"} & set(args.parts):
        ckpt = os.path.join(work, "tiny-llama")
        make_bench_checkpoint(ckpt)
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
            plot(load_timeline(args.timeline), args.dashboard, "nosa serving dashboard (trace, admission on)")
    write_result(args.out, report)
    print(f"wrote {args.out}")


def _row(rows: list[dict], context: int, **where) -> dict:
    """The one row at ``context`` whose fields equal ``where`` (e.g. offload="on")."""
    return next(r for r in rows if r["context"] == context and all(r[k] == v for k, v in where.items()))
