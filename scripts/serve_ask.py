"""Serve a NOSA checkpoint with offloading on and ask it held-out questions through the OpenAI API.

    python scripts/serve_ask.py                                   # the quickstart's runs/tiny/nosa
    python scripts/serve_ask.py --checkpoint runs/tiny-seed1/nosa --examples 32 --concurrency 8
    python scripts/serve_ask.py --suite --checkpoint runs/smollm2/nosa --length 8192   # the real model

What it does, in order:
1. builds the questions:
   - default: fresh held-out examples of the checkpoint's own training task (typed key-value
     recall: 4 facts in filler, then "? K" asks for key K's value; nosa.train.synthetic, the random
     stream of scripts/bench_accuracy.py, disjoint from training) at the training length;
   - ``--suite`` (a chat model such as SmolLM2-135M-Instruct): the long-context suite's examples
     (nosa.train.ruler over held-out prose, the prompts of scripts/bench_longctx.py) at
     ``--length`` tokens, ``--per-task`` of each task; the checkpoint is served at the suite's
     NosaConfig for that length and ``--share`` (_suite_config.budget_config) with its own
     eviction heads (a dense checkpoint, e.g. models/smollm2-135m: with A = 0, the backend's
     training-free selection, through NOSA_CONFIG);
2. starts SGLang on 127.0.0.1 with ``--attention-backend nosa`` and offloading on
   (NOSA_OFFLOAD=1): each running request holds only ``topk_blocks`` blocks per KV head on the
   device, fewer tokens than its prompt, the rest of its KV lives in the host pool; the recall
   scheduler, admission and the stats file are on (``--wandb offline``: every decode step's
   counters also go to a W&B run, NOSA_SERVE_WANDB);
3. sends every question through the OpenAI API, several at once, greedy:
   - recall: ``/v1/completions`` with the prompt's ids (the tiny model was trained on raw text, so
     no chat template), the answer being the first token, with a few more tokens after it so that
     the offloaded decode path runs;
   - suite: ``/v1/chat/completions`` with the user message and a final assistant message holding
     the answer prefix, ``continue_final_message: true`` (nosa.serve.tools.suite_chat), up to the
     task's reply length; scored as the suite scores (nosa.train.ruler.is_right);
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
import shutil
import signal
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))

from _suite_config import PICKS, picks_share  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", default="runs/tiny/nosa", help="NOSA checkpoint trained on the synthetic "
                   "recall task (python -m nosa.train writes runs/<name>/nosa); with --suite a NOSA chat model")
    p.add_argument("--examples", type=int, default=16, help="held-out examples; each asks 4 questions")
    p.add_argument("--concurrency", type=int, default=8, help="questions in flight at once")
    p.add_argument("--after", type=int, default=15, help="tokens generated after the answer (decode steps)")
    p.add_argument("--seed", type=int, default=1234, help="seed of the held-out examples")
    p.add_argument("--device-requests", type=int, default=4,
                   help="device KV budget, in requests: NOSA_DEVICE_KV_TOKENS = this x topk_blocks x block_size")
    p.add_argument("--threads", type=int, default=1, help="torch threads of the server (OMP_NUM_THREADS)")
    suite = p.add_argument_group("the long-context suite (--suite)")
    suite.add_argument("--suite", action="store_true", help="ask the long-context suite's chat prompts "
                       "through /v1/chat/completions instead of the recall task")
    suite.add_argument("--length", type=int, default=8192, help="tokens of prompt and reply")
    suite.add_argument("--tasks", nargs="+", default=None, help="suite tasks (default: all of nosa.train.ruler)")
    suite.add_argument("--per-task", type=int, default=1, help="examples of each task")
    suite.add_argument("--share", type=int, default=4, help="budget = 1/share of the context's blocks")
    suite.add_argument("--picks", type=picks_share, default=PICKS, metavar="FRACTION",
                       help="free query-aware picks as a share of the budget (bench_longctx.py --picks; "
                            "default the suite's 1/16, the release's 15/64)")
    suite.add_argument("--suite-seed", type=int, default=0, help="seed of the suite's examples "
                       "(bench_longctx.py --seed)")
    p.add_argument("--wandb", choices=["offline", "online"], default=None,
                   help="also log every decode step's counters to W&B (NOSA_SERVE_WANDB; run under --wandb-dir)")
    p.add_argument("--wandb-dir", default="runs/serve", help="NOSA_SERVE_WANDB_DIR (metrics.jsonl beside the run)")
    p.add_argument("--out", default="results/serve_ask.json", help="JSON summary")
    p.add_argument("--plot", default="results/serve_ask.png", help="serving dashboard PNG ('' to skip)")
    p.add_argument("--log", default=None, help="server log file (default: a temporary file, kept on failure)")
    return p.parse_args(argv)


@dataclass
class Question:
    group: str  # what the printout groups answers by: "example 3", "8192 passkey #0"
    label: str  # the key asked (recall) or the task (suite)
    prompt: object  # token ids (recall, /v1/completions) or chat messages (suite, /v1/chat/completions)
    expected: tuple[str, ...]  # the answer token's text (recall) or the suite's references
    max_tokens: int
    prompt_tokens: int
    chat: bool = False  # a suite prompt: asked through the chat API, scored by nosa.train.ruler.is_right


@dataclass
class Plan:
    serve_path: str  # the checkpoint directory the server loads
    cfg: object  # its NosaConfig
    items_per_token: int  # block items (one per layer and KV head) per token of SGLang's KV count
    questions: list[Question]
    note: str  # what is asked, for the first printed line
    env: dict | None = None  # more server environment (NOSA_CONFIG for a dense checkpoint)


def model_config(checkpoint: str) -> dict:
    with open(os.path.join(checkpoint, "config.json")) as f:
        return json.load(f)


def recall_plan(args) -> Plan:
    """Held-out questions of the checkpoint's training task (recall): the answer is the next token."""
    from bench_accuracy import heldout, run_config
    from transformers import AutoTokenizer

    from nosa.config import NosaConfig

    tokenizer = AutoTokenizer.from_pretrained(args.checkpoint)
    train_cfg = run_config(args.checkpoint)
    if not (train_cfg.get("data", {}).get("synthetic") or {}).get("tasks", ["recall"]) == ["recall"]:
        raise SystemExit(f"serve_ask: {args.checkpoint} was not trained on the recall task alone; this asks recall "
                         "questions (see --help; --suite asks a chat model the long-context suite)")
    config = model_config(args.checkpoint)
    cfg = NosaConfig.from_dict(config["nosa"])
    examples = heldout(tokenizer, train_cfg, cfg, train_cfg["seq_len"], args.examples, args.seed)
    asked = []
    for e, ex in enumerate(examples):
        ids = ex["ids"].tolist()
        for a in ex["answers"]:
            asked.append(Question(f"example {e:2d}", tokenizer.decode([ids[a - 1]]).strip(), ids[:a],
                                  (tokenizer.decode([ids[a]]),), args.after + 1, a))
    return Plan(os.path.abspath(args.checkpoint), cfg, config["num_hidden_layers"] * config["num_key_value_heads"],
                asked, f"{len(asked)} questions from {len(examples)} held-out examples")


def suite_plan(args, work: str) -> Plan:
    """The suite's examples as chat requests; the checkpoint served at the suite's NosaConfig."""
    from _suite_config import budget_config
    from transformers import AutoTokenizer

    from nosa.serve.tools.suite_chat import chat_messages, suite_examples, suite_view
    from nosa.train import ruler

    tokenizer = AutoTokenizer.from_pretrained(args.checkpoint)
    cfg = budget_config(args.length, args.share, args.picks)
    config = model_config(args.checkpoint)
    if "nosa" in config:  # its eviction heads at the suite's budget
        serve_path, env, heads = suite_view(args.checkpoint, cfg, os.path.join(work, "checkpoint")), None, "its own"
    else:  # a dense checkpoint: the backend's training-free selection at $NOSA_CONFIG
        serve_path, env, heads = os.path.abspath(args.checkpoint), {"NOSA_CONFIG": cfg.to_json()}, "A = 0"
    tasks = args.tasks or list(ruler.TASKS)
    examples = suite_examples(tokenizer, tasks, args.length, args.per_task, args.suite_seed)
    asked = [Question(f"{ex.length} {ex.task} #{ex.index}", ex.task, chat_messages(tokenizer, ex.prompt_ids),
                      ex.references, ex.max_new_tokens, len(ex.prompt_ids), chat=True) for ex in examples]
    return Plan(serve_path, cfg, config["num_hidden_layers"] * config["num_key_value_heads"], asked,
                f"{len(asked)} prompts of the long-context suite at {args.length} tokens ({', '.join(tasks)}), "
                f"budget 1/{args.share} of the blocks, {heads} eviction heads", env)


def server_settings(cfg, args, longest: int, stats_file: str) -> tuple[list[str], dict]:
    """(SGLang flags, environment) for offloading on with a device budget of ``--device-requests``
    running requests; ``longest`` = the longest request's prompt and reply, in tokens."""
    per_request = cfg.topk_blocks * cfg.block_size  # device tokens a running request holds
    host = max(65536, 4 * args.concurrency * longest) if not args.suite else args.concurrency * longest + 4096
    env = {"NOSA_OFFLOAD": "1", "NOSA_HOST_KV_TOKENS": str(host),
           "NOSA_DEVICE_KV_TOKENS": str(args.device_requests * per_request),
           "NOSA_RECALL_SCHEDULER": "1", "NOSA_ADMISSION": "1",
           "NOSA_SERVE_STATS_FILE": stats_file, "OMP_NUM_THREADS": str(args.threads)}
    if args.wandb:
        env.update(NOSA_SERVE_WANDB=args.wandb, NOSA_SERVE_WANDB_DIR=os.path.abspath(args.wandb_dir))
    flags = ["--attention-backend", "nosa", "--dtype", "float32", "--page-size", str(cfg.block_size),
             "--skip-server-warmup", "--mem-fraction-static", "0.3", "--max-total-tokens", str(host)]
    if args.suite:
        # SGLang stops a request 2 tokens short of its context length, and a suite example fills
        # ``length`` exactly (prompt + reply); no position past length - 1 is computed, so going
        # over the model's max_position_embeddings by 2 here is safe and SGLang has to be told so
        flags += ["--context-length", str(args.length + 2)]
        env["SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN"] = "1"
    return flags, env


def ask(url: str, model: str, question: Question) -> dict:
    """The reply: for the suite the chat reply (nosa.serve.tools.suite_chat.ask_chat), for recall
    the first generated token's text, through the OpenAI client when SGLang brought it."""
    if question.chat:
        from nosa.serve.tools.suite_chat import ask_chat

        return ask_chat(url, model, question.prompt, question.max_tokens)
    try:
        from openai import OpenAI
    except ImportError:  # plain HTTP: the same request
        import urllib.request

        body = json.dumps({"model": model, "prompt": question.prompt, "max_tokens": question.max_tokens,
                           "temperature": 0, "logprobs": 1}).encode()
        req = urllib.request.Request(url + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=600) as r:
            return {"reply": json.loads(r.read())["choices"][0]["logprobs"]["tokens"][0]}
    client = OpenAI(base_url=url + "/v1", api_key="none", timeout=600, max_retries=0)
    out = client.completions.create(model=model, prompt=question.prompt, max_tokens=question.max_tokens,
                                    temperature=0, logprobs=1)
    return {"reply": out.choices[0].logprobs.tokens[0]}


def is_right(question: Question, reply: str) -> bool:
    if question.chat:
        from nosa.train.ruler import is_right as suite_right

        return suite_right(reply, question.expected)
    return reply.strip() == question.expected[0].strip()


def counters(stats_file: str) -> dict:
    """Hit rate, recalled bytes and peak device slots from the server's stats file."""
    with open(stats_file) as f:
        stats = json.load(f)
    off = stats["offload"]
    selected, hits = sum(off["selected"]), sum(off["hits"])
    warm_selected, warm_hits = sum(off["warm_selected"]), sum(off["warm_hits"])
    steps = stats.get("timeline", [])
    return {
        "decode_layer_steps": sum(off["steps"]), "selected_items": selected, "hit_items": hits,
        "warm_selected_items": warm_selected, "warm_hit_items": warm_hits,
        "hit_rate": hits / selected if selected else None,
        "warm_hit_rate": warm_hits / warm_selected if warm_selected else None,
        "recalled_items": sum(off["misses"]), "recalled_bytes": sum(off["recalled_bytes"]),
        "prefetched_items": sum(off["prefetched"]), "max_warm_misses": max(off["max_warm_misses"]),
        "peak_device_slots": stats.get("peak_device_slots", max((r["resident_slots"] for r in steps), default=0)),
        "peak_batch": max((r["batch"] for r in steps), default=0),
        "device_slots_in_use_after": stats["device_slots_in_use"], "requests_after": stats["requests"],
        "admission": (stats.get("admission") or {}).get("decisions"),
    }


def serve_and_ask(plan: Plan, args, work: str) -> tuple[list[dict], float, dict, str]:
    """(replies in question order, seconds, the server's counters, stats file); the server is
    stopped on return, on an error, on Ctrl-C and on SIGTERM."""
    from nosa.serve.tools.process import ServerProcess

    stats_file, log = os.path.join(work, "stats.json"), args.log or os.path.join(work, "server.log")
    longest = max(q.prompt_tokens + q.max_tokens for q in plan.questions)
    flags, env = server_settings(plan.cfg, args, longest, stats_file)
    env.update(plan.env or {})
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the finally below, which stops the server
    server = ServerProcess(plan.serve_path, flags, log, env)
    # not a with-block: its exit waits for the requests in flight, which an 8K prompt keeps busy for
    # minutes; on Ctrl-C or SIGTERM the server is stopped instead, which ends them
    pool = ThreadPoolExecutor(args.concurrency)
    failed = True
    try:
        server.wait_ready(timeout=600)
        start = time.perf_counter()
        got = list(pool.map(lambda q: ask(server.url, "nosa", q), plan.questions))
        seconds = time.perf_counter() - start
        server.post("/flush_cache", {})  # the registry writes its counters once the requests are gone
        time.sleep(1.5)
        served = counters(stats_file)
        failed = False
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
        server.stop()
        if failed:
            print(f"serve_ask: failed; the server log is {log}", file=sys.stderr)
    return got, seconds, served, stats_file


def main(argv=None) -> int:
    args = parse_args(argv)
    if not os.path.isdir(args.checkpoint):
        raise SystemExit(f"serve_ask: no checkpoint at {args.checkpoint}; train one first "
                         "(python -m nosa.train --config configs/train/tiny.yaml)")
    work = tempfile.mkdtemp(prefix="serve_ask-")  # the server's log, stats file and checkpoint view
    code = _serve_ask(args, work)
    shutil.rmtree(work, ignore_errors=True)  # kept when anything failed: the log is there
    return code


def _serve_ask(args, work: str) -> int:
    plan = suite_plan(args, work) if args.suite else recall_plan(args)
    cfg, asked = plan.cfg, plan.questions
    per_request = cfg.topk_blocks * cfg.block_size
    prompt_tokens = max(q.prompt_tokens for q in asked)
    print(f"serving {args.checkpoint}: offloading on, device KV budget {args.device_requests} x {per_request} tokens "
          f"(a request's {cfg.topk_blocks} blocks of {cfg.block_size} per KV head, its prompt up to {prompt_tokens} "
          f"tokens); {plan.note}, {args.concurrency} at once", flush=True)
    got, seconds, served, stats_file = serve_and_ask(plan, args, work)
    right = 0
    lines: dict[str, list[str]] = {}
    answers = []
    for q, out in zip(asked, got):
        if out.get("served_prompt_tokens", q.prompt_tokens) != q.prompt_tokens:
            raise SystemExit(f"serve_ask: the server tokenised {q.group}'s chat messages to "
                             f"{out['served_prompt_tokens']} tokens, not the suite's {q.prompt_tokens}")
        reply = out["reply"] or ""
        ok = is_right(q, reply)
        right += ok
        want = " / ".join(e.strip() for e in q.expected)
        shown = " ".join(reply.split()) or repr(reply)  # one line: a chat reply may span several
        shown = shown if len(shown) <= 80 else shown[:77] + "..."
        lines.setdefault(q.group, []).append(f"{q.label}->{shown}{'' if ok else f' (want {want})'}"
                                             f" {'ok' if ok else 'WRONG'}")
        answers.append({"group": q.group, "label": q.label, "expected": list(q.expected), "right": ok,
                        "prompt_tokens": q.prompt_tokens, **out})
    for group, parts in lines.items():
        print(f"  {group}: " + "  ".join(parts))
    peak_tokens = served["peak_device_slots"] * cfg.block_size // plan.items_per_token
    need = max(q.prompt_tokens + q.max_tokens for q in asked)  # a request's KV at its end in SGLang's own pool
    summary = {
        "checkpoint": args.checkpoint, "questions": len(asked), "correct": right, "accuracy": right / len(asked),
        "seconds": round(seconds, 2), "concurrency": args.concurrency, "prompt_tokens": prompt_tokens,
        "nosa_config": cfg.to_dict(), "device_budget_tokens": args.device_requests * per_request,
        "device_tokens_per_request": per_request, "peak_device_tokens": peak_tokens,
        "torch_native_kv_tokens_per_request": need, **served, "answers": answers,
    }
    hit = served["warm_hit_rate"]
    print(f"accuracy {right}/{len(asked)} = {right / len(asked):.1%} in {seconds:.1f} s")
    print(f"device block cache: hit rate {served['hit_rate']:.1%} over all decode steps, "
          f"{'n/a' if hit is None else f'{hit:.1%}'} in warm steps; recalled {served['recalled_items']} blocks "
          f"({served['recalled_bytes'] / 2**20:.2f} MiB), prefetched {served['prefetched_items']}; at most "
          f"{served['max_warm_misses']} blocks per KV head and warm step (bound query_blocks + 1 = "
          f"{cfg.query_blocks + 1})")
    running = served["peak_batch"]
    print(f"device KV: budget {summary['device_budget_tokens']} tokens, peak {peak_tokens} resident "
          f"({served['peak_device_slots']} block items over layers and KV heads; a token = K and V of every layer, as "
          f"SGLang counts), {running} requests decoding at once. torch_native keeps a request's whole KV on device: "
          f"up to {need} tokens each, {running * need} for {running} ({running * need / max(peak_tokens, 1):.1f}x); "
          f"at this budget it could run {summary['device_budget_tokens'] // need} of these requests at once")
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
