"""Serve a NOSA checkpoint with offloading on and ask it held-out questions through the OpenAI API.

    python scripts/serve_ask.py                                   # the quickstart's runs/tiny/nosa
    python scripts/serve_ask.py --checkpoint runs/tiny-seed1/nosa --examples 32 --concurrency 8

What it does, in order:
1. builds fresh held-out examples of the checkpoint's own training task (typed key-value recall:
   4 facts in filler, then "? K" asks for key K's value; nosa.train.synthetic, the random stream of
   scripts/bench_accuracy.py, disjoint from training) at the training length;
2. starts SGLang on 127.0.0.1 with ``--attention-backend nosa`` and offloading on
   (NOSA_OFFLOAD=1): each running request holds only ``topk_blocks`` blocks per KV head on the
   device, fewer tokens than its prompt, the rest of its KV lives in the host pool; the recall
   scheduler, admission and the stats file are on;
3. sends every question (the example up to and including the key; the answer is the next token)
   through ``/v1/completions``, several at once, greedy, with a few more tokens after the answer so
   that the offloaded decode path runs (the tiny model was trained on raw text, so no chat template);
4. prints each answer against the expected one, then the accuracy, and from the server's own
   counters ($NOSA_SERVE_STATS_FILE): the hit rate of the device block cache, the recalled bytes,
   the peak device slots against the KV that SGLang's torch_native backend would hold for the same
   requests; writes the serving dashboard (scripts/serve_dashboard.py) and a JSON summary;
5. stops the server: at the end, on an error, on Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", default="runs/tiny/nosa", help="NOSA checkpoint trained on the synthetic "
                   "recall task (python -m nosa.train writes runs/<name>/nosa)")
    p.add_argument("--examples", type=int, default=16, help="held-out examples; each asks 4 questions")
    p.add_argument("--concurrency", type=int, default=8, help="questions in flight at once")
    p.add_argument("--after", type=int, default=15, help="tokens generated after the answer (decode steps)")
    p.add_argument("--seed", type=int, default=1234, help="seed of the held-out examples")
    p.add_argument("--device-requests", type=int, default=4,
                   help="device KV budget, in requests: NOSA_DEVICE_KV_TOKENS = this x topk_blocks x block_size")
    p.add_argument("--threads", type=int, default=1, help="torch threads of the server (OMP_NUM_THREADS)")
    p.add_argument("--out", default="results/serve_ask.json", help="JSON summary")
    p.add_argument("--plot", default="results/serve_ask.png", help="serving dashboard PNG ('' to skip)")
    p.add_argument("--log", default=None, help="server log file (default: a temporary file, kept on failure)")
    return p.parse_args(argv)


def questions(checkpoint: str, count: int, seed: int):
    """(examples, questions): each question is (example index, key text, prompt ids, answer id)."""
    from bench_accuracy import heldout, run_config
    from transformers import AutoTokenizer

    from nosa.config import NosaConfig

    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    train_cfg = run_config(checkpoint)
    if not (train_cfg.get("data", {}).get("synthetic") or {}).get("tasks", ["recall"]) == ["recall"]:
        raise SystemExit(f"serve_ask: {checkpoint} was not trained on the recall task alone; this asks recall "
                         "questions (see --help)")
    with open(os.path.join(checkpoint, "config.json")) as f:
        model_config = json.load(f)
    cfg = NosaConfig.from_dict(model_config["nosa"])
    # block slots (one per layer, KV head and block) per token of KV in SGLang's count, which
    # counts a token once for K and V of every layer and head
    cfg_items = model_config["num_hidden_layers"] * model_config["num_key_value_heads"]
    examples = heldout(tokenizer, train_cfg, cfg, train_cfg["seq_len"], count, seed)
    asked = []
    for e, ex in enumerate(examples):
        ids = ex["ids"].tolist()
        for a in ex["answers"]:
            asked.append((e, tokenizer.decode([ids[a - 1]]).strip(), ids[:a], ids[a]))
    return tokenizer, cfg, cfg_items, train_cfg, examples, asked


def server_settings(cfg, args, prompt_tokens: int, stats_file: str) -> tuple[list[str], dict]:
    per_request = cfg.topk_blocks * cfg.block_size  # device tokens a running request holds
    host = max(65536, 4 * args.concurrency * (prompt_tokens + args.after + 1))
    env = {"NOSA_OFFLOAD": "1", "NOSA_HOST_KV_TOKENS": str(host),
           "NOSA_DEVICE_KV_TOKENS": str(args.device_requests * per_request),
           "NOSA_RECALL_SCHEDULER": "1", "NOSA_ADMISSION": "1",
           "NOSA_SERVE_STATS_FILE": stats_file, "OMP_NUM_THREADS": str(args.threads)}
    flags = ["--attention-backend", "nosa", "--dtype", "float32", "--page-size", str(cfg.block_size),
             "--skip-server-warmup", "--mem-fraction-static", "0.3", "--max-total-tokens", str(host)]
    return flags, env


def ask(url: str, model: str, question, after: int) -> str:
    """The first generated token's text (greedy), through the OpenAI client when SGLang brought it."""
    _, _, prompt, _ = question
    try:
        from openai import OpenAI
    except ImportError:  # plain HTTP: the same request
        import urllib.request

        body = json.dumps({"model": model, "prompt": prompt, "max_tokens": after + 1, "temperature": 0,
                           "logprobs": 1}).encode()
        req = urllib.request.Request(url + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=600) as r:
            return json.loads(r.read())["choices"][0]["logprobs"]["tokens"][0]
    client = OpenAI(base_url=url + "/v1", api_key="none", timeout=600, max_retries=0)
    out = client.completions.create(model=model, prompt=prompt, max_tokens=after + 1, temperature=0, logprobs=1)
    return out.choices[0].logprobs.tokens[0]


def counters(stats_file: str) -> dict:
    """Hit rate, recalled bytes and peak device slots from the server's stats file."""
    with open(stats_file) as f:
        stats = json.load(f)
    off = stats["offload"]
    selected, hits = sum(off["selected"]), sum(off["hits"])
    warm_selected, warm_hits = sum(off["warm_selected"]), sum(off["warm_hits"])
    steps = stats.get("timeline", [])
    return {
        "decode_layer_steps": sum(off["steps"]),
        "hit_rate": hits / selected if selected else None,
        "warm_hit_rate": warm_hits / warm_selected if warm_selected else None,
        "recalled_items": sum(off["misses"]), "recalled_bytes": sum(off["recalled_bytes"]),
        "prefetched_items": sum(off["prefetched"]), "max_warm_misses": max(off["max_warm_misses"]),
        "peak_device_slots": stats.get("peak_device_slots", max((r["resident_slots"] for r in steps), default=0)),
        "peak_batch": max((r["batch"] for r in steps), default=0),
        "device_slots_in_use_after": stats["device_slots_in_use"], "requests_after": stats["requests"],
        "admission": (stats.get("admission") or {}).get("decisions"),
    }


def main(argv=None) -> int:
    args = parse_args(argv)
    if not os.path.isdir(args.checkpoint):
        raise SystemExit(f"serve_ask: no checkpoint at {args.checkpoint}; train one first "
                         "(python -m nosa.train --config configs/train/tiny.yaml)")
    from nosa.serve.tools.process import ServerProcess

    tokenizer, cfg, items_per_block, train_cfg, examples, asked = questions(args.checkpoint, args.examples, args.seed)
    prompt_tokens = train_cfg["seq_len"]
    work = tempfile.mkdtemp(prefix="serve_ask-")
    stats_file, log = os.path.join(work, "stats.json"), args.log or os.path.join(work, "server.log")
    flags, env = server_settings(cfg, args, prompt_tokens, stats_file)
    per_request = cfg.topk_blocks * cfg.block_size
    print(f"serving {args.checkpoint}: offloading on, device KV budget {args.device_requests} x {per_request} tokens "
          f"(a request's {cfg.topk_blocks} blocks of {cfg.block_size} per KV head, its prompt {prompt_tokens} tokens); "
          f"{len(asked)} questions from {len(examples)} held-out examples, {args.concurrency} at once", flush=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the finally below, which stops the server
    server = ServerProcess(os.path.abspath(args.checkpoint), flags, log, env)
    failed = True
    try:
        server.wait_ready()
        start = time.perf_counter()
        with ThreadPoolExecutor(args.concurrency) as pool:
            got = list(pool.map(lambda q: ask(server.url, "nosa", q, args.after), asked))
        seconds = time.perf_counter() - start
        server.post("/flush_cache", {})  # the registry writes its counters once the requests are gone
        time.sleep(1.5)
        served = counters(stats_file)
        failed = False
    finally:
        server.stop()
        if failed:
            print(f"serve_ask: failed; the server log is {log}", file=sys.stderr)
    right = 0
    lines: dict[int, list[str]] = {}
    for (e, key, _, answer), text in zip(asked, got):
        want = tokenizer.decode([answer])
        ok = text.strip() == want.strip()
        right += ok
        lines.setdefault(e, []).append(f"{key}->{text.strip() or repr(text)}{'' if ok else f' (want {want.strip()})'}"
                                       f" {'ok' if ok else 'WRONG'}")
    for e, parts in lines.items():
        print(f"  example {e:2d}: " + "  ".join(parts))
    peak_tokens = served["peak_device_slots"] * cfg.block_size // items_per_block
    summary = {
        "checkpoint": args.checkpoint, "questions": len(asked), "correct": right, "accuracy": right / len(asked),
        "seconds": round(seconds, 2), "concurrency": args.concurrency, "prompt_tokens": prompt_tokens,
        "device_budget_tokens": args.device_requests * per_request, "device_tokens_per_request": per_request,
        "peak_device_tokens": peak_tokens,
        "torch_native_kv_tokens_per_request": prompt_tokens + args.after + 1, **served,
    }
    hit = served["warm_hit_rate"]
    print(f"accuracy {right}/{len(asked)} = {right / len(asked):.1%} in {seconds:.1f} s")
    print(f"device block cache: hit rate {served['hit_rate']:.1%} over all decode steps, "
          f"{'n/a' if hit is None else f'{hit:.1%}'} in warm steps; recalled {served['recalled_items']} blocks "
          f"({served['recalled_bytes'] / 2**20:.2f} MiB), prefetched {served['prefetched_items']}; at most "
          f"{served['max_warm_misses']} blocks per KV head and warm step (bound query_blocks + 1 = "
          f"{cfg.query_blocks + 1})")
    running = served["peak_batch"]
    need = prompt_tokens + args.after + 1  # one request's KV at its end in SGLang's own pool
    print(f"device KV: budget {summary['device_budget_tokens']} tokens, peak {peak_tokens} resident "
          f"({served['peak_device_slots']} block items over layers and KV heads; a token = K and V of every layer, as "
          f"SGLang counts), {running} requests decoding at once. torch_native keeps a request's whole KV on device: "
          f"{need} tokens each, {running * need} for {running} ({running * need / max(peak_tokens, 1):.1f}x); at this "
          f"budget it could run {summary['device_budget_tokens'] // need} of these requests at once")
    print(f"afterwards: {served['requests_after']} request states, {served['device_slots_in_use_after']} device "
          "slots in use")
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(summary, f, indent=1)
        print(f"wrote {args.out}")
    if args.plot:
        from serve_dashboard import load_timeline, plot

        plot(load_timeline(stats_file), args.plot)
        print(f"wrote {args.plot} (the serving dashboard: scripts/serve_dashboard.py)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
