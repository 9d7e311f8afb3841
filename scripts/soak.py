"""Bounded soak of a local SGLang server with the nosa plugin: mixed load plus malformed requests.

    .venv/bin/python scripts/soak.py [--quick] [--model-path CKPT] [--out results/soak.json]
        [--server-args "--attention-backend nosa ..."] [--env KEY=VAL ...]

Starts one server on 127.0.0.1 (a tiny NOSA checkpoint built with tests/serve/sglang_tiny unless
--model-path is given), then:
1. probes: a few greedy prompts (short, past dense_len, long) after /flush_cache;
2. the malformed list (each must get HTTP 400 with a message; the server must stay up);
3. ``--clients`` threads for ``--duration`` seconds or ``--max-requests`` requests: mixed prompt
   lengths, streaming, client disconnects mid-stream, /abort_request, prefix reuse, /v1/completions,
   /v1/chat/completions and malformed requests mixed in;
4. 100 one-token requests at once;
5. the malformed list again, idle accounting (NOSA_SERVE_STATS_FILE: ``requests``, ``layer_states``
   and every ``*_in_use`` counter back to 0), the probes again (identical tokens).
Asserts: no 5xx, no connection error, the server process alive, probes identical, idle counters at
0. Reports the server's RSS (process tree) after start-up and at the end. Writes JSON to --out and
exits 1 when a check fails. Stops by itself: bounded in time and in request count.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import shlex
import shutil
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests", "serve"))

DEFAULT_ARGS = ["--attention-backend", "nosa", "--dtype", "float32", "--skip-server-warmup", "--sleep-on-idle",
                "--mem-fraction-static", "0.3", "--max-total-tokens", "65536", "--chunked-prefill-size", "1024"]
MODES = {  # quick: CI (about 2 minutes with start-up); full: the benchmark (about 8 minutes)
    "quick": dict(clients=4, duration=45.0, max_requests=400, max_prompt=1000, context=4096),
    "full": dict(clients=6, duration=390.0, max_requests=5000, max_prompt=6000, context=8192),
}
BURST = 100  # one-token requests sent at once


# ---- HTTP (loopback only) --------------------------------------------------------------------
class Client:
    def __init__(self, port: int, timeout: float = 600.0):
        self.port, self.timeout = port, timeout

    def _conn(self):
        return http.client.HTTPConnection("127.0.0.1", self.port, timeout=self.timeout)

    def post(self, path: str, body) -> tuple[int, str]:
        """(status, body text); ``body`` str is sent as is (malformed JSON)."""
        data = body if isinstance(body, str) else json.dumps(body)
        conn = self._conn()
        try:
            conn.request("POST", path, body=data, headers={"Content-Type": "application/json"})
            resp = conn.getresponse()
            return resp.status, resp.read().decode(errors="replace")
        finally:
            conn.close()

    def stream(self, path: str, body: dict, stop_after: int | None = None) -> tuple[int, int, str]:
        """(status, data events read, last event); ``stop_after`` events: close the socket (a
        client that goes away mid-stream)."""
        conn = self._conn()
        try:
            conn.request("POST", path, body=json.dumps(body), headers={"Content-Type": "application/json"})
            resp = conn.getresponse()
            events, last = 0, ""
            for line in resp:
                line = line.strip()
                if line.startswith(b"data:") and line != b"data: [DONE]":
                    events, last = events + 1, line.decode(errors="replace")
                    if stop_after is not None and events >= stop_after:
                        break
            return resp.status, events, last
        finally:
            conn.close()

    def get(self, path: str) -> tuple[int, str]:
        conn = self._conn()
        try:
            conn.request("GET", path)
            resp = conn.getresponse()
            return resp.status, resp.read().decode(errors="replace")
        finally:
            conn.close()


def greedy(ids: list[int], new: int, **extra) -> dict:
    return {"input_ids": ids, "sampling_params": {"temperature": 0.0, "max_new_tokens": new, "ignore_eos": True},
            **extra}


# ---- the malformed list ----------------------------------------------------------------------
def malformed_requests(vocab: int, context: int, bos: bool) -> list[tuple[str, str, object, int]]:
    """(name, path, body, wanted status): a 400 with a message, never a crash. An empty text is one
    token long with a tokenizer that adds BOS (``bos``): then it must be served."""
    sp = {"max_new_tokens": 4}
    empty_text = 200 if bos else 400
    return [
        ("empty text", "/generate", {"text": "", "sampling_params": sp}, empty_text),
        ("text batch with an empty text", "/generate", {"text": ["ab", ""], "sampling_params": sp}, empty_text),
        ("empty input_ids", "/generate", {"input_ids": [], "sampling_params": sp}, 400),
        ("batch with an empty row", "/generate", {"input_ids": [[]], "sampling_params": sp}, 400),
        ("batch: good row + empty row", "/generate", {"input_ids": [[1, 2, 3], []], "sampling_params": sp}, 400),
        ("id = vocab_size", "/generate", {"input_ids": [5, vocab], "sampling_params": sp}, 400),
        ("negative id", "/generate", {"input_ids": [5, -1, 7], "sampling_params": sp}, 400),
        ("huge id", "/generate", {"input_ids": [2**40], "sampling_params": sp}, 400),
        ("batch row out of vocabulary", "/generate",
         {"input_ids": [[1, 2], [3, vocab + 7]], "sampling_params": sp}, 400),
        ("invalid JSON", "/generate", '{"input_ids": [1, 2', 400),
        ("input_ids not a list", "/generate", {"input_ids": "abc"}, 400),
        ("text not a string", "/generate", {"text": 5}, 400),
        ("float id", "/generate", {"input_ids": [1, 2.5]}, 400),
        ("negative max_new_tokens", "/generate", {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": -1}}, 400),
        ("negative temperature", "/generate", {"input_ids": [1, 2], "sampling_params": {"temperature": -1}}, 400),
        ("top_p > 1", "/generate", {"input_ids": [1, 2], "sampling_params": {"top_p": 2}}, 400),
        ("prompt over the context", "/generate", {"input_ids": [1] * (context + 10), "sampling_params": sp}, 400),
        ("completions: empty prompt", "/v1/completions", {"model": "m", "prompt": "", "max_tokens": 4}, 400),
        ("completions: id out of vocabulary", "/v1/completions",
         {"model": "m", "prompt": [1, vocab], "max_tokens": 4}, 400),
        ("completions: batch row negative", "/v1/completions",
         {"model": "m", "prompt": [[1, 2], [-3]], "max_tokens": 4}, 400),
        ("chat: no messages", "/v1/chat/completions", {"model": "m", "messages": [], "max_tokens": 4}, 400),
        ("chat: negative max_tokens", "/v1/chat/completions",
         {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": -1}, 400),
    ]


def check_malformed(client: Client, bad: list, vocab: int, failures: list) -> dict:
    """Send the list ``bad`` once; a 400 carries a message and no server path."""
    results = {}
    for name, path, body, want in bad:
        status, text = client.post(path, body)
        results[name] = status
        if status != want:
            failures.append(f"malformed '{name}': HTTP {status} (want {want}): {text[:300]}")
        elif want == 400 and "message" not in text:
            failures.append(f"malformed '{name}': 400 without a message: {text[:300]}")
        elif ROOT in text or "site-packages" in text:
            failures.append(f"malformed '{name}': the 400 body shows a server path: {text[:300]}")
    # Streaming answers 200 before the prompt is checked; the error comes as an event.
    status, _, last = client.stream("/generate", {"input_ids": [vocab], "stream": True})
    results["stream with an out-of-vocabulary id (error event)"] = status
    if status >= 500 or "outside the model's vocabulary" not in last:
        failures.append(f"malformed stream: HTTP {status}, last event {last[:300]}")
    return results


# ---- the load --------------------------------------------------------------------------------
class Load:
    """Client threads choosing actions at random; counts every answer by (action, status)."""

    ACTIONS = {"generate": 26, "stream": 14, "disconnect": 10, "abort": 8, "prefix": 16,
               "completions": 8, "chat": 6, "malformed": 12}

    def __init__(self, client: Client, bad: list, mode: dict, seed: int):
        self.client, self.bad, self.mode, self.seed = client, bad, mode, seed
        self.counts: dict[str, dict[str, int]] = {}
        self.latency: dict[str, list[float]] = {}
        self.failures: list[str] = []
        self.issued = 0
        self.lock = threading.Lock()
        rng = random.Random(seed)
        lengths = (400, 900, min(2000, mode["max_prompt"] - 100))
        self.prefixes = [[rng.randrange(256) for _ in range(n)] for n in lengths]

    def _record(self, action: str, status: int, seconds: float, detail: str = "") -> None:
        with self.lock:
            per = self.counts.setdefault(action, {})
            per[str(status)] = per.get(str(status), 0) + 1
            self.latency.setdefault(action, []).append(seconds)
            if status >= 500 or status == 0:
                self.failures.append(f"{action}: HTTP {status} {detail[:300]}")

    def _prompt(self, rng: random.Random) -> list[int]:
        n = int(round(50 * (self.mode["max_prompt"] / 50) ** rng.random()))  # log-uniform 50..max
        return [rng.randrange(256) for _ in range(n)]

    def _one(self, rng: random.Random, worker: int, n: int) -> None:
        action = rng.choices(list(self.ACTIONS), weights=list(self.ACTIONS.values()))[0]
        new = rng.randint(1, 48)
        c = self.client
        t0 = time.perf_counter()
        try:
            if action == "generate":
                status, text = c.post("/generate", greedy(self._prompt(rng), new))
            elif action == "prefix":
                base = rng.choice(self.prefixes)
                suffix = [rng.randrange(256) for _ in range(rng.randint(1, 80))]
                status, text = c.post("/generate", greedy(base + suffix, new))
            elif action == "stream":
                status, events, text = c.stream("/generate", {**greedy(self._prompt(rng), new), "stream": True})
            elif action == "disconnect":
                status, events, text = c.stream("/generate", {**greedy(self._prompt(rng), 200), "stream": True},
                                                stop_after=rng.randint(1, 5))
            elif action == "abort":
                rid = f"soak-abort-{self.seed}-{worker}-{n}"
                out = {}
                body = greedy(self._prompt(rng), 300, rid=rid)
                th = threading.Thread(target=lambda: out.update(r=c.post("/generate", body)))
                th.start()
                time.sleep(rng.uniform(0.05, 1.0))
                abort_status, _ = c.post("/abort_request", {"rid": rid})
                th.join()
                status, text = out.get("r", (0, "no answer"))
                if abort_status >= 500:
                    status, text = abort_status, "/abort_request failed"
            elif action == "completions":
                status, text = c.post("/v1/completions", {"model": "m", "prompt": self._prompt(rng), "max_tokens": new,
                                                          "temperature": 0})
            elif action == "chat":
                words = " ".join(rng.choice(["alpha", "beta", "gamma", "delta"]) for _ in range(rng.randint(1, 300)))
                status, text = c.post("/v1/chat/completions", {"model": "m", "max_tokens": new, "temperature": 0,
                                                               "messages": [{"role": "user", "content": words}]})
            else:
                name, path, body, want = rng.choice(self.bad)
                status, text = c.post(path, body)
                if status != want:
                    with self.lock:
                        self.failures.append(f"malformed '{name}' under load: HTTP {status} (want {want})")
        except (OSError, http.client.HTTPException) as err:  # refused / reset: the server went away
            status, text = 0, f"{type(err).__name__}: {err}"
        self._record(action, status, time.perf_counter() - t0, text if status >= 500 or status == 0 else "")
        if action in ("generate", "prefix", "completions", "chat", "stream") and status != 200:
            with self.lock:
                self.failures.append(f"{action}: HTTP {status} for a valid request: {text[:300]}")

    def run(self, alive) -> float:
        deadline = time.time() + self.mode["duration"]
        start = time.perf_counter()

        def worker(i: int) -> None:
            rng = random.Random(self.seed * 1000 + i)
            n = 0
            while time.time() < deadline and alive():
                with self.lock:
                    if self.issued >= self.mode["max_requests"]:
                        return
                    self.issued += 1
                self._one(rng, i, n)
                n += 1

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(self.mode["clients"])]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return time.perf_counter() - start


# ---- checks ----------------------------------------------------------------------------------
def probes(client: Client, failures: list) -> list[list[int]]:
    client.post("/flush_cache", {})
    rng = random.Random(7)
    outs = []
    for n in (20, 300, 1200):
        status, text = client.post("/generate", greedy([rng.randrange(256) for _ in range(n)], 16))
        if status != 200:
            failures.append(f"probe of {n} tokens: HTTP {status} {text[:200]}")
            outs.append([])
        else:
            outs.append(json.loads(text)["output_ids"])
    return outs


def burst(client: Client, failures: list) -> dict:
    rng = random.Random(11)
    bodies = [greedy([rng.randrange(256) for _ in range(rng.randint(1, 40))], 1) for _ in range(BURST)]
    t0 = time.perf_counter()
    with ThreadPoolExecutor(BURST) as pool:
        answers = list(pool.map(lambda b: client.post("/generate", b), bodies))
    seconds = time.perf_counter() - t0
    statuses = [s for s, _ in answers]
    ok = sum(s == 200 and len(json.loads(t)["output_ids"]) == 1 for s, t in answers)
    if ok != BURST:
        failures.append(f"burst: {ok}/{BURST} one-token requests answered 200 with one token; "
                        f"statuses {sorted(set(statuses))}")
    return {"requests": BURST, "ok": ok, "seconds": round(seconds, 2)}


def idle_counters(stats_path: str | None, failures: list, timeout: float = 60.0) -> dict | None:
    """The backend's accounting once idle: requests, layer_states and every *_in_use at 0."""
    if not stats_path:
        return None

    def busy(stats: dict) -> dict:
        keys = ["requests", "layer_states"] + [k for k in stats if k.endswith("_in_use")]
        return {k: stats.get(k) for k in keys if stats.get(k) != 0}

    deadline = time.time() + timeout
    stats = {}
    while time.time() < deadline:
        if os.path.exists(stats_path):
            try:
                with open(stats_path) as f:
                    stats = json.load(f)
            except (OSError, json.JSONDecodeError):
                stats = {}
            if stats and not busy(stats):
                return stats
        time.sleep(0.5)
    failures.append(f"not idle after the load: {busy(stats) if stats else 'no stats file written'} ({stats})")
    return stats


def tree_rss_mb(pid: int) -> float:
    import psutil

    try:
        proc = psutil.Process(pid)
        procs = [proc, *proc.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0.0
    total = 0
    for p in procs:
        try:
            total += p.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return round(total / 2**20, 1)


def validation_cost_us(length: int, vocab: int) -> float:
    """Median time of nosa.serve.validate.validate_prompt on a ``length``-token prompt, here."""
    import timeit

    from nosa.serve.validate import validate_prompt

    ids = [random.randrange(vocab) for _ in range(length)]
    runs = [timeit.timeit(lambda: validate_prompt(ids, vocab), number=200) / 200 for _ in range(5)]
    return round(statistics.median(runs) * 1e6, 1)


# ---- main ------------------------------------------------------------------------------------
def build_checkpoint(path: str, context: int) -> str:
    import sglang_tiny

    import nosa

    sglang_tiny.make_checkpoint(path, nosa.NosaConfig.tiny(dense_len=64), seed=0, evict_scale=1.0)
    cfg_path = os.path.join(path, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg["max_position_embeddings"] = max(cfg["max_position_embeddings"], context)  # RoPE has no limit
    with open(cfg_path, "w") as f:
        json.dump(cfg, f, indent=2)
    return path


def parse_env(items: list[str]) -> dict:
    env = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"--env {item!r}: expected KEY=VAL")
        env[key] = value
    return env


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="the CI mode: about 2 minutes")
    ap.add_argument("--model-path", help="serve this checkpoint (default: a tiny NOSA checkpoint built here)")
    ap.add_argument("--server-args", default="", help="extra sglang.launch_server flags (override the defaults)")
    ap.add_argument("--env", action="append", default=[], metavar="KEY=VAL", help="server environment (repeatable)")
    ap.add_argument("--out", default=os.path.join(ROOT, "results", "soak.json"))
    ap.add_argument("--duration", type=float, help="seconds of mixed load (default: by mode)")
    ap.add_argument("--clients", type=int)
    ap.add_argument("--max-requests", type=int)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    from nosa.serve.process import ServerProcess

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
    from transformers import AutoTokenizer

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
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
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


if __name__ == "__main__":
    sys.exit(main())
