"""Bounded soak of a local SGLang server with the nosa plugin: mixed load plus malformed requests.

    .venv/bin/python scripts/soak.py [--quick] [--model-path CKPT] [--out results/soak.json]
        [--server-args "--attention-backend nosa ..."] [--env KEY=VAL ...]

Starts one server on 127.0.0.1 (a tiny NOSA checkpoint built with nosa.bench.tiny_checkpoint
unless --model-path is given), then:
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
import os
import sys

from nosa.bench.soak.run import run

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="the CI mode: about 1 minute")
    ap.add_argument("--model-path", help="serve this checkpoint (default: a tiny NOSA checkpoint built here)")
    ap.add_argument("--server-args", default="", help="extra sglang.launch_server flags (override the defaults)")
    ap.add_argument("--env", action="append", default=[], metavar="KEY=VAL", help="server environment (repeatable)")
    ap.add_argument("--out", default=os.path.join(ROOT, "results", "soak.json"))
    ap.add_argument("--duration", type=float, help="seconds of mixed load (default: by mode)")
    ap.add_argument("--clients", type=int)
    ap.add_argument("--max-requests", type=int)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
