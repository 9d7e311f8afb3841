"""KV offloading benchmarks of the "nosa" SGLang backend ($NOSA_OFFLOAD=1), each side by side in one run.

    .venv/bin/python scripts/bench_offload.py [--quick] [--parts hitrate capacity decode] [--out results/offload.json]

- ``hitrate``: recall traffic and hit rate on the same long prompts and the same device slots
  (exactly the budget per request and KV head), NOSA with its fine-tuned eviction heads
  (``--checkpoint``, default the quickstart's runs/tiny/nosa) vs the same weights with A = 0
  (training-free, InfLLM-v2-style selection). Prompts are the checkpoint's synthetic tasks at its
  training length and 2x, 4x; counted over warm decode steps (the cache in steady state).
- ``capacity``: a fixed device KV budget (``--device-tokens``, default 8192): the longest context
  torch_native serves with that many KV tokens (its pool is the device memory) vs the nosa backend
  with offloading (host pool ``--host-tokens``), which serves a ``--capacity-context`` prompt
  (default 131072, --quick 32768). Tiny random Llama (bench_serve's), released NosaConfig.
- ``decode``: decode step time with offloading on vs off at ``--contexts`` (default 32768), batch 4,
  bench_serve's streamed measurement (median interval between streamed tokens while the whole
  batch decodes), without the recall scheduler (the ``schedule`` part adds it).
- ``schedule``: the same decode step with offloading off, on, and on with the recall scheduler
  ($NOSA_RECALL_SCHEDULER=1: the next layer's predicted blocks prefetched while a layer computes),
  the stall share of the step and the prefetch hit rate per layer (demand misses avoided), from
  the server's per-step timeline (nosa.serve.offload.stats). The three servers are up at once and
  ``--repeats`` off / on + scheduler pairs interleave (a shared machine's load drifts): each
  repeat's ratio and the median are reported.
- ``trace``: Poisson arrivals of requests of mixed lengths (log-uniform in ``--trace-lengths``,
  default 1K-64K; --quick: 512-8K, 8 requests, at least 0.3 arrivals/s) under one device
  budget, with the scheduler, admission off vs
  on ($NOSA_ADMISSION=1): throughput and p50/p99 time per output token. The admission-on
  server's timeline is saved (``--timeline``) and plotted (``--dashboard``, scripts/serve_dashboard.py).
Not a test: nothing is asserted. Writes JSON (and prints each row).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys

from nosa.bench.offload.parts import run

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", nargs="+", default=["hitrate", "capacity", "decode"],
                    choices=["hitrate", "capacity", "decode", "schedule", "trace"])
    ap.add_argument("--checkpoint", default=os.path.join(ROOT, "runs", "tiny", "nosa"),
                    help="a NOSA checkpoint with fine-tuned eviction heads (hitrate)")
    ap.add_argument("--train-length", type=int, default=None, help="its training length (default: from the run)")
    ap.add_argument("--prompts", type=int, default=4, help="prompts per length (hitrate)")
    ap.add_argument("--device-tokens", type=int, default=8192, help="device KV budget (capacity)")
    ap.add_argument("--capacity-context", type=int, default=131072)
    ap.add_argument("--contexts", type=int, nargs="+", default=[32768], help="decode part")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=64, help="tokens generated per request (hitrate, capacity)")
    ap.add_argument("--decode-tokens", type=int, default=160,
                    help="tokens per request in the decode part (enough steps with the whole batch decoding)")
    ap.add_argument("--threads", type=int, default=None, help="OMP_NUM_THREADS of the servers")
    ap.add_argument("--repeats", type=int, default=3,
                    help="schedule: off / on + scheduler pairs, interleaved (--quick: 1)")
    ap.add_argument("--trace-lengths", type=int, nargs=2, default=[1024, 65536], help="trace: prompt lengths lo hi")
    ap.add_argument("--trace-requests", type=int, default=16)
    ap.add_argument("--trace-rate", type=float, default=0.1,
                    help="trace: Poisson arrivals per second (0.1: the prefill work outlasts the arrivals)")
    ap.add_argument("--trace-new-tokens", type=int, default=48)
    ap.add_argument("--trace-budget-requests", type=int, default=8, help="trace: device budget in requests' budgets")
    ap.add_argument("--trace-extra-slots", type=int, default=4, help="trace: NOSA_DEVICE_EXTRA_SLOTS with admission")
    ap.add_argument("--timeline", default=os.path.join(ROOT, "results", "serve_timeline.json"),
                    help="trace: the admission-on server's per-step timeline")
    ap.add_argument("--dashboard", default=os.path.join(ROOT, "results", "serve_dashboard.png"))
    ap.add_argument("--quick", action="store_true", help="hitrate at 1x/2x, capacity at 32K, decode at 8K")
    ap.add_argument("--out", default=os.path.join(ROOT, "results", "offload.json"))
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if args.quick:
        args.new_tokens = min(args.new_tokens, 32)
    if "hitrate" in args.parts and args.train_length is None:
        run_file = os.path.join(args.checkpoint, "nosa_train.json")
        args.train_length = 2048
        if os.path.exists(run_file):
            with open(run_file) as f:
                args.train_length = int(json.load(f).get("seq_len", 2048))
    run(args)


if __name__ == "__main__":
    main()
