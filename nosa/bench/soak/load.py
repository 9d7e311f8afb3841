"""The soak's mixed load (scripts/soak.py): client threads sending random actions (generate,
stream, disconnect, abort, prefix reuse, OpenAI endpoints, malformed) and counting every answer."""

from __future__ import annotations

import http.client
import random
import threading
import time

from nosa.bench.soak.client import Client, greedy


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

    def _action(self, rng: random.Random, issued: int) -> str:
        """Each kind once, in order, then kinds drawn by weight: a short run still sends every kind."""
        kinds = list(self.ACTIONS)
        if issued < len(kinds):
            return kinds[issued]
        return rng.choices(kinds, weights=list(self.ACTIONS.values()))[0]

    def _one(self, rng: random.Random, worker: int, n: int, action: str) -> None:
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
                    action = self._action(rng, self.issued)
                    self.issued += 1
                self._one(rng, i, n, action)
                n += 1

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(self.mode["clients"])]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return time.perf_counter() - start
