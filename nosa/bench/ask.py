"""Serve a NOSA checkpoint with offloading on and ask it held-out questions through the OpenAI API
(scripts/serve_ask.py): the questions (the checkpoint's recall task, or the long-context suite's chat
prompts), the server's settings, the asking, and the summary against what torch_native would hold."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable

from transformers import AutoTokenizer

from nosa.bench.accuracy import heldout, run_config
from nosa.bench.longctx.chat import ask_chat, chat_messages, suite_view
from nosa.bench.longctx.config import budget_config
from nosa.bench.longctx.run import dense_answers
from nosa.bench.longctx.suites import SEEDS, make_suite
from nosa.bench.results import write_result
from nosa.bench.server.dashboard import load_timeline, plot
from nosa.bench.server.process import ServerProcess
from nosa.bench.server.stats import counters
from nosa.checkpoint_format import nosa_layers
from nosa.config import NosaConfig


@dataclass
class Question:
    group: str  # what the printout groups answers by: "example 3", "8192 passkey #0"
    label: str  # the key asked (recall) or the task (suite)
    prompt: object  # token ids (recall, /v1/completions) or chat messages (suite, /v1/chat/completions)
    expected: tuple[str, ...]  # the answer token's text (recall) or the suite's references
    max_tokens: int
    prompt_tokens: int
    chat: bool = False  # a suite prompt: asked through the chat API
    scorer: Callable[[str], float] | None = None  # a suite's score of a reply in [0, 1] (None: exact match)
    dense: dict | None = None  # the dense model's {"reply", "right"} on the same prompt (--dense)


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
    return Plan(os.path.abspath(args.checkpoint), cfg, len(nosa_layers(config)) * config["num_key_value_heads"],
                asked, f"{len(asked)} questions from {len(examples)} held-out examples")


def suite_plan(args, work: str) -> Plan:
    """The suite's examples as chat requests (the project's own suite, or NVIDIA's RULER with
    ``--suite ruler``: the prompts of scripts/bench_longctx.py); the checkpoint served at the
    suite's NosaConfig; with ``--dense`` each question also carries the dense model's answer."""
    tokenizer = AutoTokenizer.from_pretrained(args.checkpoint)
    cfg = budget_config(args.length, args.share, args.picks)
    config = model_config(args.checkpoint)
    if "nosa" in config:  # its eviction heads at the suite's budget
        serve_path, env, heads = suite_view(args.checkpoint, cfg, os.path.join(work, "checkpoint")), None, "its own"
    else:  # a dense checkpoint: the backend's training-free selection at $NOSA_CONFIG
        serve_path, env, heads = os.path.abspath(args.checkpoint), {"NOSA_CONFIG": cfg.to_json()}, "A = 0"
    try:
        suite = make_suite(args.suite, args.tasks, data_dir=args.ruler_data)
    except ValueError as e:
        raise SystemExit(f"serve_ask: {e}") from None
    seed = SEEDS[suite.name] if args.suite_seed is None else args.suite_seed
    examples = suite.examples(tokenizer, args.checkpoint, args.length, args.per_task, seed)
    dense = [None] * len(examples)
    if args.dense:
        print(f"dense answers: {args.dense} on the same prompts (scripts/bench_longctx.py's dense cache "
              f"{args.cache or 'off'}; computed where it has none)", flush=True)
        dense = dense_answers(args.dense, tokenizer, suite, examples, args.cache)
    asked = [Question(f"{ex.length} {ex.task} #{ex.index}", ex.task, chat_messages(tokenizer, ex.prompt_ids),
                      ex.references, min(ex.max_new_tokens, args.max_tokens or ex.max_new_tokens),
                      len(ex.prompt_ids), chat=True,
                      scorer=lambda reply, ex=ex: float(suite.score(reply, ex)), dense=d)
             for ex, d in zip(examples, dense)]
    name = "NVIDIA's RULER" if suite.name == "ruler" else "the long-context suite"
    return Plan(serve_path, cfg, len(nosa_layers(config)) * config["num_key_value_heads"], asked,
                f"{len(asked)} prompts of {name} at {args.length} tokens ({', '.join(suite.tasks)}), "
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
    """The reply: for the suite the chat reply (nosa.bench.longctx.chat.ask_chat), for recall
    the first generated token's text, through the OpenAI client when SGLang brought it."""
    if question.chat:
        return ask_chat(url, model, question.prompt, question.max_tokens)
    try:
        from openai import OpenAI  # optional: openai (SGLang brings it; else plain HTTP)
    except ImportError:  # plain HTTP: the same request
        body = json.dumps({"model": model, "prompt": question.prompt, "max_tokens": question.max_tokens,
                           "temperature": 0, "logprobs": 1}).encode()
        req = urllib.request.Request(url + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=600) as r:
            return {"reply": json.loads(r.read())["choices"][0]["logprobs"]["tokens"][0]}
    client = OpenAI(base_url=url + "/v1", api_key="none", timeout=600, max_retries=0)
    out = client.completions.create(model=model, prompt=question.prompt, max_tokens=question.max_tokens,
                                    temperature=0, logprobs=1)
    return {"reply": out.choices[0].logprobs.tokens[0]}


def score(question: Question, reply: str) -> float:
    """The reply's score in [0, 1]: the suite's (RULER's partial string_match_all among them), or
    for recall 1 when the first token is the answer."""
    if question.scorer is not None:
        return question.scorer(reply)
    return float(reply.strip() == question.expected[0].strip())


def mark(value: float) -> str:
    return "ok" if value == 1 else ("WRONG" if value == 0 else f"{value:.2f}")


def one_line(reply: str) -> str:
    shown = " ".join(reply.split()) or repr(reply)  # one line: a chat reply may span several
    return shown if len(shown) <= 80 else shown[:77] + "..."


def serve_and_ask(plan: Plan, args, work: str) -> tuple[list[dict], float, dict, str]:
    """(replies in question order, seconds, the server's counters, stats file); the server is
    stopped on return, on an error, on Ctrl-C and on SIGTERM."""
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


def run(args, work: str) -> int:
    """Ask the checkpoint of ``args`` (as scripts/serve_ask.py parses them) its questions, server
    files under ``work``: each answer printed against the expected one, then the accuracy and the
    server's counters; the summary written to ``args.out``, the dashboard to ``args.plot``; returns 0."""
    plan = suite_plan(args, work) if args.suite else recall_plan(args)
    cfg, asked = plan.cfg, plan.questions
    per_request = cfg.topk_blocks * cfg.block_size
    prompt_tokens = max(q.prompt_tokens for q in asked)
    print(f"serving {args.checkpoint}: offloading on, device KV budget {args.device_requests} x {per_request} tokens "
          f"(a request's {cfg.topk_blocks} blocks of {cfg.block_size} per KV head, its prompt up to {prompt_tokens} "
          f"tokens); {plan.note}, {args.concurrency} at once", flush=True)
    got, seconds, served, stats_file = serve_and_ask(plan, args, work)
    lines: dict[str, list[str]] = {}
    answers, scores = [], []
    for q, out in zip(asked, got):
        if out.get("served_prompt_tokens", q.prompt_tokens) != q.prompt_tokens:
            raise SystemExit(f"serve_ask: the server tokenised {q.group}'s chat messages to "
                             f"{out['served_prompt_tokens']} tokens, not the suite's {q.prompt_tokens}")
        reply = out["reply"] or ""
        value = score(q, reply)
        scores.append(value)
        want = " / ".join(e.strip() for e in q.expected)
        line = f"{q.label}->{one_line(reply)}{'' if value == 1 else f' (want {want})'} {mark(value)}"
        if q.dense is not None:  # what the dense model answered to the same prompt
            line += f"\n      dense: {one_line(q.dense['reply'])} {mark(float(q.dense['right']))}"
        lines.setdefault(q.group, []).append(line)
        answers.append({"group": q.group, "label": q.label, "expected": list(q.expected), "right": value == 1,
                        "score": value, "prompt_tokens": q.prompt_tokens, **out,
                        **({"dense": q.dense} if q.dense is not None else {})})
    for group, parts in lines.items():
        print(f"  {group}: " + "  ".join(parts))
    right = sum(v == 1 for v in scores)
    peak_tokens = served["peak_device_slots"] * cfg.block_size // plan.items_per_token
    need = max(q.prompt_tokens + q.max_tokens for q in asked)  # a request's KV at its end in SGLang's own pool
    dense = [float(q.dense["right"]) for q in asked if q.dense is not None]
    summary = {
        "checkpoint": args.checkpoint, "suite": args.suite, "questions": len(asked), "correct": right,
        "accuracy": right / len(asked), "score": sum(scores) / len(scores),
        **({"dense": args.dense, "dense_score": sum(dense) / len(dense)} if dense else {}),
        "seconds": round(seconds, 2), "concurrency": args.concurrency, "prompt_tokens": prompt_tokens,
        "nosa_config": cfg.to_dict(), "device_budget_tokens": args.device_requests * per_request,
        "device_tokens_per_request": per_request, "peak_device_tokens": peak_tokens,
        "torch_native_kv_tokens_per_request": need, **served, "answers": answers,
    }
    partial = f"; mean score {summary['score']:.1%} (RULER's metrics give partial credit)" \
        if args.suite == "ruler" else ""
    print(f"accuracy {right}/{len(asked)} = {right / len(asked):.1%} in {seconds:.1f} s{partial}")
    if dense:
        print(f"dense ({args.dense}, full attention, no offloading) on the same prompts: mean score "
              f"{summary['dense_score']:.1%}, {sum(v == 1 for v in dense)}/{len(dense)} fully right")
    hit = served["warm_hit_rate"]
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
        write_result(args.out, summary)
        print(f"wrote {args.out}")
    if args.plot:
        plot(load_timeline(stats_file), args.plot)
        print(f"wrote {args.plot} (the serving dashboard: scripts/serve_dashboard.py)")
    return 0
