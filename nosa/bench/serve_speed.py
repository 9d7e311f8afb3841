"""Decode throughput of SGLang's "nosa" backend vs "torch_native" (scripts/bench_serve.py): the
variants, their servers' flags and environment, the measurement of each variant at each context
(one server after another, or all up and paused in turn), and the ratios compared side by side."""

from __future__ import annotations

import itertools
import json
import os
import shutil
import statistics
import tempfile
import time

from transformers import AutoTokenizer

from nosa.bench import REPO
from nosa.bench.longctx.chat import suite_examples, suite_view
from nosa.bench.longctx.config import budget_config
from nosa.bench.results import write_result
from nosa.bench.server.measure import measure, profiled_measure, random_prompts
from nosa.bench.server.process import ServerProcess, cpu_binding, stop_all
from nosa.bench.server.stats import counters
from nosa.bench.tiny_checkpoint import make_bench_checkpoint
from nosa.config import NosaConfig
from nosa.kvquant import KEY_FACTORS_FILE
from nosa.serve.checkpoint import load_nosa_config
from nosa.train.ruler import TASKS


def suite_prompts(checkpoint: str, length: int, batch: int) -> list[list[int]]:
    """``batch`` prompts of the long-context suite (nosa.train.ruler over held-out prose, one task
    after another) of at most ``length`` tokens, through the checkpoint's tokenizer and chat template."""
    tasks = TASKS[:min(batch, len(TASKS))]
    examples = suite_examples(AutoTokenizer.from_pretrained(checkpoint), tasks, length, -(-batch // len(tasks)))
    order = sorted(range(len(examples)), key=lambda i: (examples[i].index, i))  # example 0 of every task first
    return [list(examples[i].prompt_ids) for i in order[:batch]]


VARIANTS = {
    "torch_native": "SGLang's torch_native backend",
    "nosa": "the nosa backend, eager",
    "nosa+compile": "the nosa backend under SGLang's CPU graph runner (--enable-torch-compile, one graph: the batch)",
    "nosa+offload": "the nosa backend with offloading on (NOSA_OFFLOAD=1, page size = block size)",
    "nosa+offload+sched": "offloading on with the recall scheduler (NOSA_RECALL_SCHEDULER=1)",
    "nosa+offload+compile": "offloading on, under the CPU graph runner",
    "nosa+offload+sched+int8": "offloading on with the recall scheduler, an int8 host pool (NOSA_HOST_KV_DTYPE)",
    "nosa+offload+sched+fp8": "offloading on with the recall scheduler, a float8_e4m3fn host pool",
}
HOST_DTYPES = {"int8": "int8", "fp8": "float8_e4m3fn"}  # variant suffix -> NOSA_HOST_KV_DTYPE


def server_setup(variant: str, flags: list[str], cfg, batch: int, host_tokens: int, threads: int | None,
                 tp: int = 1, stats_file: str | None = None):
    """(server arguments, environment) of a variant of VARIANTS at tensor-parallel size ``tp``; an
    offloading variant writes its counters to ``stats_file`` when given."""
    backend = "torch_native" if variant == "torch_native" else "nosa"
    server_args, env = ["--attention-backend", backend, "--tp-size", str(tp), *flags], {}
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    if tp > 1:
        env["SGLANG_CPU_OMP_THREADS_BIND"] = cpu_binding(tp)
    if "offload" in variant:
        server_args += ["--page-size", str(cfg.block_size)]
        env.update(NOSA_OFFLOAD="1", NOSA_HOST_KV_TOKENS=str(host_tokens),
                   NOSA_DEVICE_KV_TOKENS=str(batch * cfg.topk_blocks * cfg.block_size))
        if stats_file:
            env["NOSA_SERVE_STATS_FILE"] = stats_file
    if "sched" in variant:
        env["NOSA_RECALL_SCHEDULER"] = "1"
    suffix = variant.rsplit("+", 1)[-1]
    if suffix in HOST_DTYPES:
        env["NOSA_HOST_KV_DTYPE"] = HOST_DTYPES[suffix]
    if "compile" in variant:
        server_args += ["--enable-torch-compile", "--cuda-graph-bs-decode", str(batch)]
        import sgl_kernel  # optional: sgl_kernel (SGLang's, or the CPU stand-in)

        if getattr(sgl_kernel, "IS_NOSA_STANDIN", False):  # this checkout's stand-in declares the graph ops
            standin = os.path.join(REPO, "serve", "tools", "sgl_kernel_standin")
            env["PYTHONPATH"] = os.pathsep.join(p for p in (standin, os.environ.get("PYTHONPATH")) if p)
    return server_args, env


def ratios(results: list[dict], contexts: list[int], tp_sizes: list[int]) -> dict:
    """Ratios of ms per decode step measured side by side (> 1: the first is slower): per context the
    variants at the first TP size, each variant's longest context over its shortest, and per
    variant and context the first TP size over each other one ("nosa 32768 tp2")."""
    out = {}
    first = [r for r in results if r["tp_size"] == tp_sizes[0]]
    pairs = {"torch_native_over_nosa": ("torch_native", "nosa"), "nosa_over_nosa_compile": ("nosa", "nosa+compile"),
             "offload_over_nosa": ("nosa+offload", "nosa"), "offload_sched_over_nosa": ("nosa+offload+sched", "nosa"),
             "offload_over_offload_compile": ("nosa+offload", "nosa+offload+compile"),
             "offload_compile_over_nosa_compile": ("nosa+offload+compile", "nosa+compile"),
             "offload_sched_int8_over_nosa": ("nosa+offload+sched+int8", "nosa"),
             "offload_sched_fp8_over_nosa": ("nosa+offload+sched+fp8", "nosa"),
             "offload_sched_int8_over_offload_sched": ("nosa+offload+sched+int8", "nosa+offload+sched")}
    for context in contexts:
        by = {r["backend"]: r["ms_per_decode_step"] for r in first if r["context"] == context}
        out[str(context)] = {name: round(by[a] / by[b], 3) for name, (a, b) in pairs.items() if a in by and b in by}
        cpu = {r["backend"]: r.get("cpu_ms_per_decode_step") for r in first if r["context"] == context}
        out[f"{context} cpu"] = {name: round(cpu[a] / cpu[b], 3) for name, (a, b) in pairs.items()
                                 if cpu.get(a) and cpu.get(b)}
    for variant in VARIANTS:  # decode flat in context: the longest context's step over the shortest's
        steps = [(r["context"], r["ms_per_decode_step"]) for r in first if r["backend"] == variant]
        if len(steps) > 1:
            out[f"{variant}_longest_over_shortest"] = round(max(steps)[1] / min(steps)[1], 3)
    for r in results:
        if r["tp_size"] != tp_sizes[0]:
            base = next(b for b in first if b["backend"] == r["backend"] and b["context"] == r["context"])
            out[f"{r['backend']} {r['context']} tp{r['tp_size']}"] = round(
                base["ms_per_decode_step"] / r["ms_per_decode_step"], 3)
    return out


def median_ratios(rounds: list[dict]) -> dict:
    """Each ratio's median over the rounds' ``ratios`` (nested per context as they are)."""
    out = {}
    for key, value in rounds[0].items():
        if isinstance(value, dict):
            out[key] = median_ratios([r.get(key, {}) for r in rounds])
        else:
            values = [r[key] for r in rounds if key in r]
            out[key] = round(statistics.median(values), 3)
    return out


def served_counters(server, stats_file: str, flush: bool = True) -> dict:
    """The offloading counters of ``stats_file`` once the server has released its requests (the
    registry writes them then): nosa.bench.server.stats.counters. ``flush``: flush the prefix
    cache first."""
    if flush:
        server.post("/flush_cache", {})
    time.sleep(1.5)
    return counters(stats_file)


def counter_delta(before: dict | None, after: dict) -> dict:
    """Hit rates and recalled bytes of the decode steps between two ``served_counters`` readings."""
    keys = ("decode_layer_steps", "selected_items", "hit_items", "warm_selected_items", "warm_hit_items",
            "recalled_items", "recalled_bytes", "prefetched_items")
    out = {k: after[k] - (before or {}).get(k, 0) for k in keys}
    out["hit_rate"] = round(out["hit_items"] / out["selected_items"], 4) if out["selected_items"] else None
    warm = out["warm_selected_items"]
    out["warm_hit_rate"] = round(out["warm_hit_items"] / warm, 4) if warm else None
    return out


def run(args) -> None:
    """Every variant of ``args.backends`` (as scripts/bench_serve.py parses them) at every context,
    each row printed as it is measured; the report written to ``args.out``, its ratios printed."""
    work = tempfile.mkdtemp(prefix="nosa_bench_")
    ckpt = args.checkpoint
    if ckpt is None:
        ckpt = os.path.join(work, "tiny-llama")
        make_bench_checkpoint(ckpt, args.evict_scale)
        if any(v.endswith("+int8") for v in args.backends):  # int8 keys as a calibrated checkpoint serves them
            from nosa.kv_calibrate import calibrate  # optional: transformers, the train extra's prose

            calibrate(ckpt, progress=False)
    checkpoints = [("main", ckpt)] + [tuple(c.split("=", 1)) for c in args.compare]
    if args.share:
        share_cfg = budget_config(max(args.contexts), args.share, args.picks)
        checkpoints = [(label, suite_view(path, share_cfg, os.path.join(work, f"view-{label}")))
                       for label, path in checkpoints]
    cfg = load_nosa_config(checkpoints[0][1])[0] if args.checkpoint else NosaConfig()
    with open(os.path.join(ckpt, "config.json")) as f:
        positions = json.load(f).get("max_position_embeddings") or 1 << 30
    max_ctx = min(max(args.contexts) + args.new_tokens + 16, positions)
    # a prompt and its new tokens fit the model's positions (SmolLM2: 8,192)
    prompts = {c: suite_prompts(ckpt, min(c, max_ctx - args.new_tokens), args.batch) if args.prompts == "suite"
               else random_prompts(min(c, max_ctx - args.new_tokens - 16), args.batch) for c in args.contexts}
    host_tokens = args.batch * max_ctx + 1024
    flags = ["--skip-server-warmup", "--dtype", "float32", "--chunked-prefill-size", "-1",
             "--mem-fraction-static", "0.3", "--context-length", str(max_ctx),
             "--max-total-tokens", str(host_tokens), "--max-running-requests", str(args.batch)]
    results = []

    def start(path: str, variant: str, tp: int, name: str):
        """A warmed-up server of the variant: (server, its stats file or None, start-up seconds)."""
        stats = os.path.join(work, f"{name}.stats.json") if "offload" in variant else None
        server_args, env = server_setup(variant, flags, cfg, args.batch, host_tokens, args.threads, tp, stats)
        begin = time.perf_counter()
        server = ServerProcess(path, server_args, os.path.join(work, f"{name}.log"),
                               env=env).wait_ready(timeout=1800)  # compiled variants build a graph first
        startup = round(time.perf_counter() - begin, 1)
        try:
            measure(server, random_prompts(512, args.batch), 16, warm_up=True)  # a fresh server's first calls
        except BaseException:
            server.stop()
            raise
        return server, stats, startup

    def measure_rows(server, stats, before, meta: dict, contexts: list[int]):
        """One row per context (results and stdout); returns the offloading counters after them."""
        for context in contexts:
            spy = (os.path.join(args.py_spy, f"{meta['checkpoint']}_{meta['backend']}_tp{meta['tp_size']}_{context}"
                                f"_r{meta['round']}.txt") if args.py_spy else None)
            row = {**meta, "context": context,
                   **profiled_measure(server, prompts[context], args.new_tokens, spy, flush=not args.keep_prefix_cache)}
            if stats:
                after = served_counters(server, stats, flush=not args.keep_prefix_cache)
                row["offload"] = counter_delta(before, after)
                before = after
            print(json.dumps(row), flush=True)
            results.append(row)
        return before

    runs = [(label, path, variant, tp) for label, path in checkpoints for variant in args.backends
            for tp in args.tp_sizes if label == "main" or "offload" in variant]
    if not args.interleave:  # each variant's server alone, one after the other (a fresh one per round)
        for round_, (label, path, variant, tp) in itertools.product(range(args.repeat), runs):
            name = f"{label}_{variant}_tp{tp}" + (f"_r{round_}" if args.repeat > 1 else "")
            server, stats, startup = start(path, variant, tp, name)
            try:
                before = served_counters(server, stats) if stats else None
                meta = {"checkpoint": label, "round": round_, "backend": variant, "tp_size": tp,
                        "server_start_s": startup}
                measure_rows(server, stats, before, meta, args.contexts)
            finally:
                server.stop()
    else:  # every server up at once, all but the measured one paused; rounds of short turns
        up = []
        try:
            for label, path, variant, tp in runs:
                name = f"{label}_{variant}_tp{tp}"
                server, stats, startup = start(path, variant, tp, name)
                up.append({"server": server, "stats": stats,
                           "before": served_counters(server, stats) if stats else None,
                           "meta": {"checkpoint": label, "backend": variant, "tp_size": tp, "server_start_s": startup}})
                server.pause()
            for round_, context in itertools.product(range(args.repeat), args.contexts):
                shift = round_ % len(up)  # each round another variant goes first
                for entry in up[shift:] + up[:shift]:
                    entry["server"].resume()
                    try:
                        entry["before"] = measure_rows(entry["server"], entry["stats"], entry["before"],
                                                       {**entry["meta"], "round": round_}, [context])
                    finally:
                        entry["server"].pause()
        finally:
            stop_all(e["server"] for e in up)
    main_rows = [r for r in results if r["checkpoint"] == "main"]
    report = {"model": f"checkpoint {args.checkpoint}" if args.checkpoint else
              "llama 2 layers, hidden 256, GQA 8/2, fp32, random weights",
              "checkpoints": dict(checkpoints), "prompts": args.prompts,
              "nosa_config": cfg.to_dict(), "evict_scale": None if args.checkpoint else args.evict_scale,
              "device": "cpu", "threads": args.threads,
              "key_factors": os.path.isfile(os.path.join(ckpt, KEY_FACTORS_FILE)),  # what int8 keys were served with
              "variants": {v: VARIANTS[v] for v in args.backends},
              "results": results}
    by_round = [ratios([r for r in main_rows if r["round"] == k], args.contexts, args.tp_sizes)
                for k in range(args.repeat)]
    report["ratios"] = by_round[0] if args.repeat == 1 else median_ratios(by_round)
    if args.repeat > 1:
        report["ratios_by_round"] = by_round
    write_result(args.out, report)
    print(json.dumps(report["ratios"]))
    shutil.rmtree(work, ignore_errors=True)  # the model built here and the servers' logs; kept on a failure
