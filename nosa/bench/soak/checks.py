"""The soak's checks outside the load (scripts/soak.py): the malformed list and its check, the
greedy probes, the one-token burst, the idle accounting of the stats file, the server's RSS and the
cost of prompt validation."""

from __future__ import annotations

import json
import os
import random
import statistics
import time
import timeit
from concurrent.futures import ThreadPoolExecutor

from nosa.bench import REPO
from nosa.bench.soak.client import Client, greedy
from nosa.serve.validate import validate_prompt

BURST = 100  # one-token requests sent at once


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
        elif REPO in text or "site-packages" in text:
            failures.append(f"malformed '{name}': the 400 body shows a server path: {text[:300]}")
    # Streaming answers 200 before the prompt is checked; the error comes as an event.
    status, _, last = client.stream("/generate", {"input_ids": [vocab], "stream": True})
    results["stream with an out-of-vocabulary id (error event)"] = status
    if status >= 500 or "outside the model's vocabulary" not in last:
        failures.append(f"malformed stream: HTTP {status}, last event {last[:300]}")
    return results


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
    import psutil  # optional: psutil (SGLang brings it)

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
    ids = [random.randrange(vocab) for _ in range(length)]
    runs = [timeit.timeit(lambda: validate_prompt(ids, vocab), number=200) / 200 for _ in range(5)]
    return round(statistics.median(runs) * 1e6, 1)
