"""The soak's HTTP client (scripts/soak.py; loopback only): POST, streaming POST that may hang up
mid-stream, GET, and the greedy request body every part sends."""

from __future__ import annotations

import http.client
import json


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
