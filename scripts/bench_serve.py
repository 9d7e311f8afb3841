"""Decode throughput of SGLang's "nosa" backend vs "torch_native" on the same tiny model.

    .venv/bin/python scripts/bench_serve.py [--quick] [--contexts 4096 8192 32768 65536] [--out results/serve.json]
    .venv/bin/python scripts/bench_serve.py --backends torch_native nosa nosa+compile --contexts 4096 32768
    .venv/bin/python scripts/bench_serve.py --checkpoint runs/tiny/nosa --backends nosa nosa+offload --contexts 2048
    .venv/bin/python scripts/bench_serve.py --checkpoint runs/tiny/nosa --backends nosa nosa+offload --contexts 2048 \
        --repeat 3                                                 # 3 rounds of fresh servers: median ratios
    .venv/bin/python scripts/bench_serve.py --checkpoint runs/tiny/nosa --backends nosa nosa+offload --contexts 2048 \
        --interleave --repeat 10                     # both servers up, paused in turn: 10 paired rounds
    .venv/bin/python scripts/bench_serve.py --backends nosa --tp-sizes 1 2 --evict-scale 1 --contexts 32768
    .venv/bin/python scripts/bench_serve.py --checkpoint runs/smollm2/nosa --compare a0=runs/smollm2-a0/nosa \
        --prompts suite --share 4 --contexts 8192 --batch 1 --new-tokens 16 --threads 1 \
        --backends torch_native nosa nosa+offload+sched            # the real model at 8K

Builds a tiny random Llama (2 layers, hidden 256, GQA 8/2; a dense checkpoint, so the backend uses
the released NosaConfig defaults: 64 blocks of 64 tokens, dense_len 4096), then for each variant
(and tensor-parallel size, ``--tp-sizes``) starts one server (stopped before the next starts: an
idle server keeps a core busy) and, for each context length, sends ``--batch`` concurrent greedy
requests with streaming (see ``_serve_measure.measure``: the decode step time is the median interval between
streamed tokens while the whole batch decodes, so prefill and request handling are excluded).
Contexts above the model's dense_len (4096) are where NOSA's selection applies. ``--backends``
picks variants (VARIANTS: eager or under SGLang's CPU graph runner, offloading off or on);
``--checkpoint`` serves another checkpoint (its NosaConfig; ``--share N``: the long-context
suite's NosaConfig for the longest context and 1/N of its blocks, with the checkpoint's eviction
heads). A prompt and its new tokens stay within the model's ``max_position_embeddings``, so at
SmolLM2's 8,192 an "8192" prompt is a few dozen tokens shorter (``prompt_tokens`` in each row).
``--prompts suite`` sends the long-context suite's chat prompts (nosa.train.ruler, one task per
request) instead of random token ids: what a chat model's selection and hit rate are about.
Offloading variants write the server's counters to a stats file; each row gets the decode steps'
hit rate and recalled bytes (``offload``). ``--compare LABEL=PATH`` adds checkpoints served with
the offloading variants only (fitted heads beside A = 0, say). The JSON's ``ratios`` compare the
variants per context (the ``--checkpoint``'s rows), each variant's longest context with its
shortest, and each TP size with the first. Not a test: nothing is asserted.

This machine's speed drifts: the same decode step, timed in consecutive chunks of a few seconds
inside one process, varies by 1.4-1.5x (CPU time, not waiting; scripts/bench_resolve.py's ``drift``
part), so variants measured minutes apart compare the drift as much as the code. ``--interleave``
starts every variant's server first, keeps all but the measured one paused (SIGSTOP; an idle server
polls), and gives each variant one short turn per round and context, a different one first each
round: the variants of a round ran seconds apart, and ``--repeat N`` rounds give N paired ratios
whose medians the JSON reports.

``--evict-scale A`` (A > 0) converts the model to a NOSA checkpoint with random eviction heads of
scale A, so that under tensor parallelism the ranks exchange the eviction heads' partial sums
(a dense checkpoint's A = 0 heads need no other rank). On CPU a TP server gets
SGLANG_CPU_OMP_THREADS_BIND, one share of the cores per rank (nosa.serve.tools.process.cpu_binding),
and each rank runs ``--threads`` torch threads.

``--py-spy DIR`` also samples the server's scheduler process (the one running the forward passes)
with py-spy (``pip install py-spy``) while each context is measured: the raw stacks go to
``DIR/<checkpoint label>_<variant>_tp<N>_<context>_r<round>.txt`` (rank 0's scheduler under TP),
and each result row gets
``extend_profile``, the functions under the attention backend's ``forward_extend`` (prefill) with
their share of its samples.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import signal
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))

from _serve_measure import measure, profiled_measure  # noqa: E402
from _suite_config import PICKS, picks_share  # noqa: E402


def build_model(path: str, evict_scale: float = 0.0) -> None:
    """The tiny Llama; with ``evict_scale`` > 0 a NOSA checkpoint (default NosaConfig, random
    eviction heads of scale ``evict_scale``)."""
    import nosa
    from nosa.serve.tools.tiny_checkpoint import make_tokenizer
    from nosa.tiny import set_eviction_heads, tiny_llama

    model = tiny_llama(layers=2, hidden=256, heads=8, kv_heads=2, vocab=320, seed=0, intermediate=512,
                       max_positions=131072, bos_token_id=256, eos_token_id=257, tie_word_embeddings=False)
    if evict_scale > 0:
        nosa.convert(model, nosa.NosaConfig())
        set_eviction_heads(model, scale=evict_scale, std=0.3, seed=0, bias_std=0.3)
    model.save_pretrained(path)
    make_tokenizer(path)


def random_prompts(context: int, batch: int, vocab: int = 256) -> list[list[int]]:
    """``batch`` prompts of ``context`` random token ids below ``vocab`` (seeded by ``context``)."""
    import torch

    g = torch.Generator().manual_seed(context)
    return [torch.randint(0, vocab, (context,), generator=g).tolist() for _ in range(batch)]


def suite_prompts(checkpoint: str, length: int, batch: int) -> list[list[int]]:
    """``batch`` prompts of the long-context suite (nosa.train.ruler over held-out prose, one task
    after another) of at most ``length`` tokens, through the checkpoint's tokenizer and chat template."""
    from transformers import AutoTokenizer

    from nosa.serve.tools.suite_chat import suite_examples
    from nosa.train.ruler import TASKS

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
}


def server_setup(variant: str, flags: list[str], cfg, batch: int, host_tokens: int, threads: int | None,
                 tp: int = 1, stats_file: str | None = None):
    """(server arguments, environment) of a variant of VARIANTS at tensor-parallel size ``tp``; an
    offloading variant writes its counters to ``stats_file`` when given."""
    from nosa.serve.tools.process import cpu_binding

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
    if "compile" in variant:
        server_args += ["--enable-torch-compile", "--cuda-graph-bs-decode", str(batch)]
        import sgl_kernel

        if getattr(sgl_kernel, "IS_NOSA_STANDIN", False):  # this checkout's stand-in declares the graph ops
            standin = os.path.join(ROOT, "serve", "tools", "sgl_kernel_standin")
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
             "offload_compile_over_nosa_compile": ("nosa+offload+compile", "nosa+compile")}
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
    import statistics

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
    registry writes them then): scripts/serve_ask.py's ``counters``. ``flush``: flush the prefix
    cache first."""
    from serve_ask import counters

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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", type=int, nargs="+", default=[4096, 8192, 32768, 65536])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=None,
                    help="OMP_NUM_THREADS of the servers (torch intra-op threads; default: all cores)")
    ap.add_argument("--backends", nargs="+", default=["torch_native", "nosa"], choices=list(VARIANTS),
                    help="variants, each its own server in turn (see VARIANTS)")
    ap.add_argument("--checkpoint", default=None,
                    help="serve this checkpoint (e.g. the quickstart's runs/tiny/nosa), not the tiny random Llama")
    ap.add_argument("--compare", nargs="+", default=[], metavar="LABEL=PATH",
                    help="more NOSA checkpoints (e.g. A = 0 beside fitted heads), each served with the offloading "
                         "variants of --backends only: hit rates and recalled bytes side by side")
    ap.add_argument("--prompts", choices=["random", "suite"], default="random",
                    help="random token ids, or the long-context suite's chat prompts (nosa.train.ruler; a chat "
                         "model such as SmolLM2), one task per request")
    ap.add_argument("--share", type=int, default=None,
                    help="serve every checkpoint at the suite's NosaConfig for the longest context and 1/share "
                         "of its blocks (_suite_config.budget_config) with its own eviction heads")
    ap.add_argument("--picks", type=picks_share, default=PICKS, metavar="FRACTION",
                    help="with --share: free query-aware picks as a share of the budget (bench_longctx.py "
                         "--picks; default the suite's 1/16, the release's 15/64)")
    ap.add_argument("--tp-sizes", type=int, nargs="+", default=[1],
                    help="tensor-parallel sizes to run side by side (--tp-size of each server)")
    ap.add_argument("--evict-scale", type=float, default=0.0,
                    help="> 0: the tiny Llama as a NOSA checkpoint with random eviction heads of this scale "
                         "(default: dense, A = 0)")
    ap.add_argument("--repeat", type=int, default=1,
                    help="rounds: every variant measured again in each round (a fresh server each round, or with "
                         "--interleave the same servers in turns); the JSON's ratios are then medians over the "
                         "rounds, ratios_by_round each round's")
    ap.add_argument("--interleave", action="store_true",
                    help="start every variant's server first and keep all but the measured one paused (SIGSTOP); "
                         "each round measures every variant at one context after the other, so the variants "
                         "compared in a round ran seconds apart: this machine's speed drifts by up to 1.5x over "
                         "seconds within one process, and a ratio of runs minutes apart measures the drift")
    ap.add_argument("--keep-prefix-cache", action="store_true",
                    help="do not flush SGLang's prefix cache before each measurement: a prompt served before is a "
                         "cache hit (its decode state rebuilt from the cached KV), so with --interleave the rounds "
                         "after the first compare decode windows seconds apart, not a prefill apart (SmolLM2 at 8K: "
                         "2 minutes); prefill_s is then the cached prefill")
    ap.add_argument("--quick", action="store_true", help="contexts 4K and 8K, 32 new tokens")
    ap.add_argument("--out", default=os.path.join(ROOT, "results", "serve.json"))
    ap.add_argument("--py-spy", metavar="DIR", default=None,
                    help="sample the server's scheduler with py-spy while each context runs (see above)")
    args = ap.parse_args()
    if args.repeat < 1:
        ap.error(f"--repeat must be at least 1, got {args.repeat}")
    # A plain kill must still stop the server (its process group) through the finally below.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if args.quick:
        args.contexts, args.new_tokens = [4096, 8192], 32

    from nosa.config import NosaConfig
    from nosa.serve.checkpoint import load_nosa_config
    from nosa.serve.tools.process import ServerProcess, stop_all

    work = tempfile.mkdtemp(prefix="nosa_bench_")
    ckpt = args.checkpoint
    if ckpt is None:
        ckpt = os.path.join(work, "tiny-llama")
        build_model(ckpt, args.evict_scale)
    checkpoints = [("main", ckpt)] + [tuple(c.split("=", 1)) for c in args.compare]
    if args.share:
        from _suite_config import budget_config

        from nosa.serve.tools.suite_chat import suite_view

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
              "device": "cpu", "cpus": os.cpu_count(), "threads": args.threads, "command": " ".join(sys.argv),
              "variants": {v: VARIANTS[v] for v in args.backends},
              "results": results}
    by_round = [ratios([r for r in main_rows if r["round"] == k], args.contexts, args.tp_sizes)
                for k in range(args.repeat)]
    report["ratios"] = by_round[0] if args.repeat == 1 else median_ratios(by_round)
    if args.repeat > 1:
        report["ratios_by_round"] = by_round
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    print(json.dumps(report["ratios"]))
    shutil.rmtree(work, ignore_errors=True)  # the model built here and the servers' logs; kept on a failure


if __name__ == "__main__":
    main()
