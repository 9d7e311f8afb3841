"""The soak's run (scripts/soak.py): one local server with the nosa plugin (a tiny NOSA checkpoint
unless one is given), the probes, the malformed list, the mixed load, the burst and the idle checks,
and the report with every failure."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import statistics
import sys
import tempfile
import threading
import time

from transformers import AutoTokenizer

import nosa
from nosa.bench.results import write_result
from nosa.bench.server.process import ServerProcess
from nosa.bench.soak.checks import (
    burst,
    check_malformed,
    idle_counters,
    malformed_requests,
    probes,
    tree_rss_mb,
    validation_cost_us,
)
from nosa.bench.soak.client import Client
from nosa.bench.soak.load import Load
from nosa.bench.tiny_checkpoint import make_checkpoint

DEFAULT_ARGS = ["--attention-backend", "nosa", "--dtype", "float32", "--skip-server-warmup", "--sleep-on-idle",
                "--mem-fraction-static", "0.3", "--max-total-tokens", "65536", "--chunked-prefill-size", "1024"]
MODES = {  # quick: CI (about 1 minute with start-up); full: the benchmark (about 8 minutes)
    "quick": dict(clients=4, duration=15.0, max_requests=400, max_prompt=1000, context=4096),
    "full": dict(clients=6, duration=390.0, max_requests=5000, max_prompt=6000, context=8192),
}


def build_checkpoint(path: str, context: int) -> str:
    """The tiny NOSA checkpoint (random eviction heads, A = 1) at ``path``, its positions raised to ``context``."""
    make_checkpoint(path, nosa.NosaConfig.tiny(dense_len=64), seed=0, evict_scale=1.0)
    cfg_path = os.path.join(path, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg["max_position_embeddings"] = max(cfg["max_position_embeddings"], context)  # RoPE has no limit
    with open(cfg_path, "w") as f:
        json.dump(cfg, f, indent=2)
    return path


def parse_env(items: list[str]) -> dict:
    """--env KEY=VAL items -> {KEY: VAL}; SystemExit naming a malformed item."""
    env = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"--env {item!r}: expected KEY=VAL")
        env[key] = value
    return env


def run(args) -> int:
    """The soak of ``args`` (as scripts/soak.py parses them): the report written to ``args.out``, its
    summary printed; returns 1 when a check failed (the server's log and checkpoint kept), else 0."""
    mode = dict(MODES["quick" if args.quick else "full"])
    for key in ("duration", "clients", "max_requests"):
        if getattr(args, key) is not None:
            mode[key] = getattr(args, key)
    env = parse_env(args.env)
    work = tempfile.mkdtemp(prefix="nosa-soak-")
    env.setdefault("NOSA_SERVE_STATS_FILE", os.path.join(work, "stats.json"))
    env.setdefault("OMP_NUM_THREADS", "1")  # the clients share the machine: no oversubscribed torch threads
    model = args.model_path or build_checkpoint(os.path.join(work, "ckpt"), mode["context"])
    with open(os.path.join(model, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]

    bos = len(AutoTokenizer.from_pretrained(model)("")["input_ids"]) > 0
    bad = malformed_requests(vocab, mode["context"], bos)
    server_args = [*DEFAULT_ARGS, "--context-length", str(mode["context"]), *shlex.split(args.server_args)]
    failures: list[str] = []
    report = {"mode": "quick" if args.quick else "full", "model_path": args.model_path or "tiny NOSA (built)",
              "server_args": server_args, "env": env, "load": mode, "vocab_size": vocab, "tokenizer_adds_bos": bos}
    server = ServerProcess(model, server_args, os.path.join(work, "server.log"), env=env)
    t_start = time.time()
    phases = report["phase_seconds"] = {}

    def phase(name: str, since: list = [t_start]) -> None:  # noqa: B006  (the clock of the previous phase)
        now = time.time()
        phases[name] = round(now - since[0], 1)
        since[0] = now

    try:
        server.wait_ready()
        phase("start-up")
        client = Client(server.port)
        alive = lambda: server.proc.poll() is None  # noqa: E731
        before = probes(client, failures)
        report["rss_mb_start"] = tree_rss_mb(server.proc.pid)
        report["malformed_first"] = check_malformed(client, bad, vocab, failures)
        phase("probes and malformed list")
        load = Load(client, bad, mode, args.seed)
        samples, sampling = [], threading.Event()  # RSS through the load: warm-up plateaus, a leak climbs

        def sample() -> None:
            while not sampling.wait(mode["duration"] / 8):
                samples.append(tree_rss_mb(server.proc.pid))

        sampler = threading.Thread(target=sample)
        sampler.start()
        seconds = load.run(alive)
        sampling.set()
        sampler.join()
        report["rss_mb_during_load"] = samples
        failures.extend(load.failures)
        phase("load")
        report["load_seconds"] = round(seconds, 1)
        report["requests"] = load.counts
        report["requests_total"] = sum(sum(v.values()) for v in load.counts.values())
        report["latency_s"] = {a: {"median": round(statistics.median(v), 3), "max": round(max(v), 3)}
                               for a, v in load.latency.items()}
        report["burst"] = burst(client, failures) if alive() else None
        phase("burst")
        report["malformed_last"] = check_malformed(client, bad, vocab, failures) if alive() else None
        report["idle_stats"] = idle_counters(env["NOSA_SERVE_STATS_FILE"], failures) if alive() else None
        if report["idle_stats"] is None and alive():
            report["idle_stats_note"] = "no NOSA_SERVE_STATS_FILE written (not the nosa backend?)"
        after = probes(client, failures) if alive() else []
        phase("malformed list, idle check, probes")
        report["probes_identical"] = before == after
        if before != after:
            failures.append(f"probe outputs changed: before {before}, after {after}")
        health = client.get("/health")[0] if alive() else 0
        if not alive() or health != 200:
            failures.append(f"server not alive at the end (exit {server.proc.poll()}, /health {health})")
        report["rss_mb_end"] = tree_rss_mb(server.proc.pid)
        report["rss_growth_mb"] = round(report["rss_mb_end"] - report["rss_mb_start"], 1)
        med = statistics.median(load.latency.get("generate", [0.0]) or [0.0])
        cost = validation_cost_us(mode["max_prompt"], vocab)
        report["validation_us_longest_prompt"] = cost
        report["validation_fraction_of_median_generate"] = round(cost * 1e-6 / med, 6) if med else None
    except Exception as err:  # start-up failure or a bug here: still write the report
        failures.append(f"{type(err).__name__}: {err}")
    finally:
        if server.proc.poll() is not None and not any("server not alive" in f for f in failures):
            failures.append(f"server exited with {server.proc.returncode}")
        report["server_log_tail"] = server.log_tail(3000) if failures else None
        server.stop()
    report["wall_seconds"] = round(time.time() - t_start, 1)
    report["failures"] = failures
    report["passed"] = not failures
    write_result(args.out, report)
    summary = {k: report.get(k) for k in ("passed", "requests_total", "load_seconds", "probes_identical",
                                          "rss_mb_start", "rss_mb_end", "rss_growth_mb", "burst")}
    print(json.dumps(summary))
    for line in failures:
        print("FAIL:", line, file=sys.stderr)
    if failures:
        print(f"server log and checkpoint kept in {work}", file=sys.stderr)
        return 1
    shutil.rmtree(work, ignore_errors=True)
    return 0
