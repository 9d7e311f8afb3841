"""Decode throughput of SGLang's "nosa" backend vs "torch_native" on the same tiny model.

    .venv/bin/python scripts/bench_serve.py [--quick] [--contexts 4096 8192 32768 65536] [--out results/serve.json]
    .venv/bin/python scripts/bench_serve.py --backends torch_native nosa nosa+compile --contexts 4096 32768
    .venv/bin/python scripts/bench_serve.py --checkpoint runs/tiny/nosa --backends nosa nosa+offload --contexts 2048

Builds a tiny random Llama (2 layers, hidden 256, GQA 8/2; a dense checkpoint, so the backend uses
the released NosaConfig defaults: 64 blocks of 64 tokens, dense_len 4096), then for each backend
starts one server (stopped before the next starts: an idle server keeps a core busy) and, for each
context length, sends ``--batch`` concurrent greedy requests with streaming (see ``measure``: the
decode step time is the median interval between streamed tokens while the whole batch decodes, so
prefill and request handling are excluded). Contexts above the model's dense_len (4096) are where
NOSA's selection applies. ``--backends`` picks variants (VARIANTS: eager or under SGLang's CPU
graph runner, offloading off or on); ``--checkpoint`` serves another checkpoint (its NosaConfig).
The JSON's ``ratios`` compare the variants per context and each variant's longest context with its
shortest. Not a test: nothing is asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import threading
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def build_model(path: str) -> None:
    from nosa.serve.tools.tiny_checkpoint import make_tokenizer
    from nosa.tiny import tiny_llama

    model = tiny_llama(layers=2, hidden=256, heads=8, kv_heads=2, vocab=320, seed=0, intermediate=512,
                       max_positions=131072, bos_token_id=256, eos_token_id=257, tie_word_embeddings=False)
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


def measure(server, context: int, batch: int, new_tokens: int, warm_up: bool = False) -> dict | None:
    """One batch of ``batch`` concurrent greedy requests of ``context`` random prompt tokens, streamed.

    Prefill: until every request has its first token. Decode: the intervals between streamed tokens
    once every request is decoding (the whole batch in each step), per token; the median over all
    requests and steps is the step time (robust to a noisy machine), the mean is reported too.
    Nothing here depends on the prefix cache or on work done before the first token."""
    import statistics

    import torch

    server.post("/flush_cache", {})
    g = torch.Generator().manual_seed(context)
    prompts = [torch.randint(0, 256, (context,), generator=g).tolist() for _ in range(batch)]
    start = time.perf_counter()
    streams = [[] for _ in prompts]
    threads = [threading.Thread(target=stream_generate, args=(server.url, p, new_tokens, start, out))
               for p, out in zip(prompts, streams)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
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
    return {"context": context, "batch": batch, "decode_tokens_per_s": round(batch / step, 2),
            "ms_per_decode_step": round(1000 * step, 2),
            "ms_per_decode_step_mean": round(1000 * statistics.fmean(per_token), 2),
            "decode_intervals": len(per_token), "prefill_s": round(all_decoding, 2)}


VARIANTS = {
    "torch_native": "SGLang's torch_native backend",
    "nosa": "the nosa backend, eager",
    "nosa+compile": "the nosa backend under SGLang's CPU graph runner (--enable-torch-compile, one graph: the batch)",
    "nosa+offload": "the nosa backend with offloading on (NOSA_OFFLOAD=1, page size = block size)",
    "nosa+offload+compile": "offloading on, under the CPU graph runner",
}


def server_setup(variant: str, flags: list[str], cfg, batch: int, host_tokens: int, threads: int | None):
    """(server arguments, environment) of a variant of VARIANTS."""
    backend = "torch_native" if variant == "torch_native" else "nosa"
    server_args, env = ["--attention-backend", backend, *flags], {}
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    if "offload" in variant:
        server_args += ["--page-size", str(cfg.block_size)]
        env.update(NOSA_OFFLOAD="1", NOSA_HOST_KV_TOKENS=str(host_tokens),
                   NOSA_DEVICE_KV_TOKENS=str(batch * cfg.topk_blocks * cfg.block_size))
    if "compile" in variant:
        server_args += ["--enable-torch-compile", "--cuda-graph-bs-decode", str(batch)]
        import sgl_kernel

        if getattr(sgl_kernel, "IS_NOSA_STANDIN", False):  # this checkout's stand-in declares the graph ops
            standin = os.path.join(ROOT, "serve", "tools", "sgl_kernel_standin")
            env["PYTHONPATH"] = os.pathsep.join(p for p in (standin, os.environ.get("PYTHONPATH")) if p)
    return server_args, env


def ratios(results: list[dict], contexts: list[int]) -> dict:
    """Per context, ms-per-step ratios of the variants measured side by side (> 1: the first is slower)."""
    out = {}
    pairs = {"torch_native_over_nosa": ("torch_native", "nosa"), "nosa_over_nosa_compile": ("nosa", "nosa+compile"),
             "offload_over_nosa": ("nosa+offload", "nosa"),
             "offload_over_offload_compile": ("nosa+offload", "nosa+offload+compile")}
    for context in contexts:
        by = {r["backend"]: r["ms_per_decode_step"] for r in results if r["context"] == context}
        out[str(context)] = {name: round(by[a] / by[b], 3) for name, (a, b) in pairs.items() if a in by and b in by}
    for variant in VARIANTS:  # decode flat in context: the longest context's step over the shortest's
        steps = [(r["context"], r["ms_per_decode_step"]) for r in results if r["backend"] == variant]
        if len(steps) > 1:
            out[f"{variant}_longest_over_shortest"] = round(max(steps)[1] / min(steps)[1], 3)
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
    ap.add_argument("--quick", action="store_true", help="contexts 4K and 8K, 32 new tokens")
    ap.add_argument("--out", default=os.path.join(ROOT, "results", "serve.json"))
    args = ap.parse_args()
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
        build_model(ckpt)
    cfg = load_nosa_config(ckpt)[0] if args.checkpoint else NosaConfig()
    max_ctx = max(args.contexts) + args.new_tokens + 16
    host_tokens = args.batch * max_ctx + 1024
    flags = ["--skip-server-warmup", "--dtype", "float32", "--chunked-prefill-size", "-1",
             "--mem-fraction-static", "0.3", "--context-length", str(max_ctx),
             "--max-total-tokens", str(host_tokens), "--max-running-requests", str(args.batch)]
    results = []
    for variant in args.backends:
        server_args, env = server_setup(variant, flags, cfg, args.batch, host_tokens, args.threads)
        start = time.perf_counter()
        server = ServerProcess(ckpt, server_args, os.path.join(work, f"{variant}.log"), env=env).wait_ready(
            timeout=1800)  # the compiled variants build their decode graph at start-up
        startup = round(time.perf_counter() - start, 1)
        try:
            measure(server, 512, args.batch, 16, warm_up=True)  # first-call costs of a fresh server
            for context in args.contexts:
                row = {"backend": variant, **measure(server, context, args.batch, args.new_tokens),
                       "server_start_s": startup}
                print(json.dumps(row), flush=True)
                results.append(row)
        finally:
            server.stop()
    report = {"model": f"checkpoint {args.checkpoint}" if args.checkpoint else
              "llama 2 layers, hidden 256, GQA 8/2, fp32, random weights",
              "nosa_config": cfg.to_dict(), "device": "cpu", "cpus": os.cpu_count(),
              "threads": args.threads, "command": " ".join(sys.argv),
              "variants": {v: VARIANTS[v] for v in args.backends},
              "results": results, "ratios": ratios(results, args.contexts)}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    print(json.dumps(report["ratios"]))


if __name__ == "__main__":
    main()
