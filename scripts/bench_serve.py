"""Decode throughput of SGLang's "nosa" backend vs "torch_native" on the same tiny model.

    .venv/bin/python scripts/bench_serve.py [--quick] [--contexts 4096 8192 32768 65536] [--out results/serve.json]
    .venv/bin/python scripts/bench_serve.py --backends torch_native nosa nosa+compile --contexts 4096 32768
    .venv/bin/python scripts/bench_serve.py --checkpoint runs/tiny/nosa --backends nosa nosa+offload --contexts 2048
    .venv/bin/python scripts/bench_serve.py --checkpoint runs/tiny/nosa --backends nosa nosa+offload --contexts 2048 \
        --repeat 3                                                 # 3 rounds of fresh servers: median ratios
    .venv/bin/python scripts/bench_serve.py --backends nosa --tp-sizes 1 2 --evict-scale 1 --contexts 32768
    .venv/bin/python scripts/bench_serve.py --checkpoint runs/smollm2/nosa --compare a0=runs/smollm2-a0/nosa \
        --prompts suite --share 4 --contexts 8192 --batch 1 --new-tokens 16 --threads 1 \
        --backends torch_native nosa nosa+offload+sched            # the real model at 8K

Builds a tiny random Llama (2 layers, hidden 256, GQA 8/2; a dense checkpoint, so the backend uses
the released NosaConfig defaults: 64 blocks of 64 tokens, dense_len 4096), then for each variant
(and tensor-parallel size, ``--tp-sizes``) starts one server (stopped before the next starts: an
idle server keeps a core busy) and, for each context length, sends ``--batch`` concurrent greedy
requests with streaming (see ``measure``: the decode step time is the median interval between
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

``--evict-scale A`` (A > 0) converts the model to a NOSA checkpoint with random eviction heads of
scale A, so that under tensor parallelism the ranks exchange the eviction heads' partial sums
(a dense checkpoint's A = 0 heads need no other rank). On CPU a TP server gets
SGLANG_CPU_OMP_THREADS_BIND, one share of the cores per rank (nosa.serve.tools.process.cpu_binding),
and each rank runs ``--threads`` torch threads.

``--py-spy DIR`` also samples the server's scheduler process (the one running the forward passes)
with py-spy (``pip install py-spy``) while each context is measured: the raw stacks go to
``DIR/<variant>_tp<N>_<context>.txt`` (rank 0's scheduler under TP), and each result row gets
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
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))


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


def stream_generate(url: str, prompt: list[int], new_tokens: int, start: float, out: list) -> None:
    """Greedy generation with streaming; appends (seconds since ``start``, tokens so far) per chunk."""
    body = {"input_ids": prompt, "stream": True,
            "sampling_params": {"temperature": 0.0, "max_new_tokens": new_tokens, "ignore_eos": True}}
    req = urllib.request.Request(url + "/generate", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=7200) as r:
        for line in r:
            line = line.strip()
            if not line.startswith(b"data:") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[len(b"data:"):])
            out.append((time.perf_counter() - start, int(chunk["meta_info"]["completion_tokens"])))


def _proc_stat(pid: int) -> list[str]:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rpartition(")")[2].split()  # the fields after the command name, which may hold spaces


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (all its threads)."""
    fields = _proc_stat(pid)
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def minor_faults(pid: int) -> int:
    """Minor page faults of process ``pid`` so far: memory the allocator gave back to the kernel and
    touched again (each costs a kernel entry and a zeroed page)."""
    return int(_proc_stat(pid)[7])


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


def measure(server, prompts: list[list[int]], new_tokens: int, warm_up: bool = False,
            cpu_pid: int | None = None) -> dict | None:
    """One batch of concurrent greedy requests, one per prompt, streamed.

    Prefill: until every request has its first token (``prefill_s``; with ``cpu_pid``, the server's
    scheduler process, also its CPU seconds over that time, ``prefill_cpu_s``: less sensitive than
    wall time to other load on a shared machine). Decode: the intervals between streamed tokens
    once every request is decoding (the whole batch in each step), per token; the median over all
    requests and steps is the step time (robust to a noisy machine), the mean is reported too, and
    ``ms_per_decode_step_window``, the median over requests of each one's mean step over its window
    (robust to a stream delivered in bursts, where the median interval reads near 0); with
    ``cpu_pid`` also the scheduler's CPU milliseconds per decode step (``cpu_ms_per_decode_step``:
    its CPU time from the last first token to the last token over ``new_tokens - 1`` steps; what the
    step costs the CPU, whatever else the machine runs) and its minor page faults per decode step
    (``minor_faults_per_decode_step``: memory given back to the kernel and touched again).
    Nothing here depends on the prefix cache or on work done before the first token."""
    import statistics

    server.post("/flush_cache", {})
    batch = len(prompts)
    cpu_start = cpu_seconds(cpu_pid) if cpu_pid else 0.0
    start = time.perf_counter()
    streams = [[] for _ in prompts]
    threads = [threading.Thread(target=stream_generate, args=(server.url, p, new_tokens, start, out))
               for p, out in zip(prompts, streams)]
    for t in threads:
        t.start()
    while not all(streams) and any(t.is_alive() for t in threads):  # until every first token
        time.sleep(0.02)
    decode_cpu_start = cpu_seconds(cpu_pid) if cpu_pid else 0.0
    faults_start = minor_faults(cpu_pid) if cpu_pid else 0
    prefill_cpu = decode_cpu_start - cpu_start if cpu_pid else None
    for t in threads:
        t.join()
    decode_cpu = cpu_seconds(cpu_pid) - decode_cpu_start if cpu_pid else None
    decode_faults = minor_faults(cpu_pid) - faults_start if cpu_pid else None
    if any(not s or s[-1][1] != new_tokens for s in streams):
        raise RuntimeError(f"a request did not stream {new_tokens} tokens: {[s[-1:] for s in streams]}")
    all_decoding = max(s[0][0] for s in streams)  # every request has its first token
    per_token = [(t1 - t0) / (n1 - n0) for s in streams for (t0, n0), (t1, n1) in zip(s, s[1:])
                 if t0 >= all_decoding and n1 > n0]
    if warm_up:  # only the server's first-call costs matter; a loaded machine may stream fewer chunks
        return None
    if len(per_token) < batch * 8:
        raise RuntimeError(f"too few decode steps with the whole batch running ({len(per_token)}); raise --new-tokens")
    step = statistics.median(per_token)
    # each stream's mean step over its whole window (last token minus its first token after every
    # request decodes): unlike the median interval, not fooled when a loaded machine delivers the
    # stream in bursts (many near-zero intervals, then a long one)
    windows = []
    for s in streams:
        inside = [(t, n) for t, n in s if t >= all_decoding]
        if len(inside) > 1 and inside[-1][1] > inside[0][1]:
            windows.append((inside[-1][0] - inside[0][0]) / (inside[-1][1] - inside[0][1]))
    return {"prompt_tokens": max(len(p) for p in prompts), "batch": batch,
            "decode_tokens_per_s": round(batch / step, 2),
            "ms_per_decode_step": round(1000 * step, 2),
            "ms_per_decode_step_mean": round(1000 * statistics.fmean(per_token), 2),
            "ms_per_decode_step_window": round(1000 * statistics.median(windows), 2) if windows else None,
            "decode_intervals": len(per_token), "prefill_s": round(all_decoding, 2),
            **({"prefill_cpu_s": round(prefill_cpu, 2),
                # every request decodes new_tokens - 1 steps after its first token, the batch together
                "cpu_ms_per_decode_step": round(1000 * decode_cpu / max(1, new_tokens - 1), 2),
                "minor_faults_per_decode_step": round(decode_faults / max(1, new_tokens - 1), 1)} if cpu_pid else {})}


def scheduler_pid(server) -> int:
    """The pid of the server's scheduler process, which runs the model (a child of the launcher)."""
    listing = subprocess.run(["ps", "-o", "pid=,args=", "--ppid", str(server.proc.pid)], capture_output=True,
                             text=True, check=True).stdout
    for line in listing.splitlines():
        pid, _, args = line.strip().partition(" ")
        if "scheduler" in args:
            return int(pid)
    raise RuntimeError(f"no scheduler process under the server's pid {server.proc.pid}:\n{listing}")


def extend_profile(raw_path: str, top: int = 10) -> list[list]:
    """[function (file), share of the extend's samples] for the functions under ``forward_extend``
    in py-spy's raw stacks (``frame;frame;... count`` per line), most samples first (a function
    counts once per stack), then the extend's samples and those of the whole run (decode too)."""
    calls, total, busy = {}, 0, 0
    with open(raw_path) as f:
        for line in f:
            stack, _, count = line.rstrip().rpartition(" ")
            busy += int(count)
            frames = stack.split(";")
            # frames read "Class.method (file.py:line)"
            below = [i for i, frame in enumerate(frames) if frame.partition(" (")[0].split(".")[-1] == "forward_extend"]
            if not below:
                continue
            total += int(count)
            names = set()
            for frame in frames[below[0]:]:
                name, _, where = frame.partition(" (")
                names.add(f"{name} ({'/'.join(where.split(':')[0].split('/')[-2:])})")
            for name in names:
                calls[name] = calls.get(name, 0) + int(count)
    ranked = sorted(calls.items(), key=lambda kv: -kv[1])[:top]
    return [[name, round(n / max(1, total), 3)] for name, n in ranked] + [["samples", total], ["all samples", busy]]


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
             "offload_over_offload_compile": ("nosa+offload", "nosa+offload+compile")}
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


def profiled_measure(server, prompts: list[list[int]], new_tokens: int, spy_path: str | None) -> dict:
    """``measure`` with the scheduler's CPU seconds; with ``spy_path``, py-spy samples the scheduler
    meanwhile (raw stacks to that file) and the row gets ``extend_profile``."""
    pid = scheduler_pid(server)
    if spy_path is None:
        return measure(server, prompts, new_tokens, cpu_pid=pid)
    os.makedirs(os.path.dirname(spy_path), exist_ok=True)
    # py-spy as installed beside this Python (a venv's bin), else on PATH
    py_spy = shutil.which("py-spy", path=os.path.dirname(sys.executable)) or shutil.which("py-spy") or "py-spy"
    # --nonblocking: samples without pausing the server, so the timings stand
    spy = subprocess.Popen([py_spy, "record", "--pid", str(pid), "--rate", "50", "--nonblocking", "--format", "raw",
                            "-o", spy_path], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        row = measure(server, prompts, new_tokens, cpu_pid=pid)
    finally:
        spy.send_signal(signal.SIGINT)  # py-spy writes its file on SIGINT
        spy.wait(timeout=120)
    return {**row, "extend_profile": extend_profile(spy_path)}


def served_counters(server, stats_file: str) -> dict:
    """The offloading counters of ``stats_file`` once the server has released its requests (the
    registry writes them then): scripts/serve_ask.py's ``counters``."""
    from serve_ask import counters

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
                         "of its blocks (bench_longctx.budget_config) with its own eviction heads")
    ap.add_argument("--tp-sizes", type=int, nargs="+", default=[1],
                    help="tensor-parallel sizes to run side by side (--tp-size of each server)")
    ap.add_argument("--evict-scale", type=float, default=0.0,
                    help="> 0: the tiny Llama as a NOSA checkpoint with random eviction heads of this scale "
                         "(default: dense, A = 0)")
    ap.add_argument("--repeat", type=int, default=1,
                    help="rounds: every variant's server started and measured again in each round, in turn "
                         "(fresh processes of the same code differ by up to 40%% on this machine); the JSON's "
                         "ratios are then medians over the rounds, ratios_by_round each round's")
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
    from nosa.serve.tools.process import ServerProcess

    work = tempfile.mkdtemp(prefix="nosa_bench_")
    ckpt = args.checkpoint
    if ckpt is None:
        ckpt = os.path.join(work, "tiny-llama")
        build_model(ckpt, args.evict_scale)
    checkpoints = [("main", ckpt)] + [tuple(c.split("=", 1)) for c in args.compare]
    if args.share:
        from bench_longctx import budget_config

        from nosa.serve.tools.suite_chat import suite_view

        share_cfg = budget_config(max(args.contexts), args.share)
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
    for round_, (label, path) in itertools.product(range(args.repeat), checkpoints):
        for variant in args.backends:
            if label != "main" and "offload" not in variant:
                continue
            for tp in args.tp_sizes:
                name = f"{label}_{variant}_tp{tp}" + (f"_r{round_}" if args.repeat > 1 else "")
                stats = os.path.join(work, f"{name}.stats.json") if "offload" in variant else None
                server_args, env = server_setup(variant, flags, cfg, args.batch, host_tokens, args.threads, tp, stats)
                start = time.perf_counter()
                server = ServerProcess(path, server_args, os.path.join(work, f"{name}.log"),
                                       env=env).wait_ready(timeout=1800)  # compiled variants build a graph first
                startup = round(time.perf_counter() - start, 1)
                try:
                    measure(server, random_prompts(512, args.batch), 16, warm_up=True)  # a fresh server's first calls
                    before = served_counters(server, stats) if stats else None
                    for context in args.contexts:
                        spy = (os.path.join(args.py_spy, f"{name}_{context}.txt")
                               if args.py_spy else None)
                        row = {"checkpoint": label, "round": round_, "backend": variant, "tp_size": tp,
                               "context": context,
                               **profiled_measure(server, prompts[context], args.new_tokens, spy),
                               "server_start_s": startup}
                        if stats:
                            after = served_counters(server, stats)
                            row["offload"] = counter_delta(before, after)
                            before = after
                        print(json.dumps(row), flush=True)
                        results.append(row)
                finally:
                    server.stop()
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


if __name__ == "__main__":
    main()
