"""The decode step with offloading on vs off (where the gap is), and this machine's drift, without SGLang.

    .venv/bin/python scripts/bench_resolve.py [--quick] [--shapes tiny smollm2] [--out results/resolve.json]
    .venv/bin/python scripts/bench_resolve.py --parts select --contexts 4096 65536 --out results/select_kernel.json

Runs nosa.bench.decode_harness (the backend's decode step over SGLang-like pools: select ->
resolve -> attend per layer, no model around it) in one process, one torch thread, inference mode:

- ``resolve``: the same step with offloading off (the resolve reads SGLang's pool in place) and on
  (the device block cache's slot diff, recall, write-through and counters), measured in
  ``--rounds`` rounds of ``--steps`` decode steps each, the two one after the other, the other
  first every other round. Reports per variant the median CPU ms per step and CPU ms in the resolve
  (``kv.resolve_layer``, all layers), and per round the paired ratio of the two (on / off speed): in one
  process seconds apart, so this machine's drift (below) mostly cancels.
- ``compiled``: the same pair with each harness's device half (``DecodeHarness.forward``: what
  SGLang's CPU graph runner compiles) under ``torch.compile(fullgraph=True, dynamic=False)``, in
  alternating rounds as ``resolve``; the host half (``begin``: the step's metadata, the block cache's
  stale drops) is timed apart. Compiling takes minutes at the smollm2 shape.
- ``select``: the eager step with the CPU selection kernel (nosa.kernels.select_cpu) and with the
  torch selection it replaces, offloading off, in alternating rounds: bench_serve's tiny Llama (2
  layers, 8/2 heads of 32, batch 4, the released NosaConfig, A = 0) at each of ``--contexts``, and
  SmolLM2-135M's attention at the suite's 8K budget (30 layers, one request); per case and variant
  the step's and the selection's CPU ms, and the tiny Llama's longest context's step over its
  shortest's per variant (how flat the step is in context).
- ``drift``: the "off" step timed in ``--chunks`` consecutive chunks of ``--steps`` steps inside one
  process, the same work each time: how much this machine's speed moves over seconds.

Shapes: ``tiny``, the quickstart checkpoint's (2 layers, 4/2 heads of 32, blocks of 4, budget 32,
4 requests at 2K); ``smollm2``, SmolLM2-135M's attention (30 layers, 9/3 heads of 64) at the long-
context suite's 8K NosaConfig (nosa.bench.longctx.config.budget_config(8192, 4): 64 of 256 blocks of 32 =
1 + 17 + 4 picks + 42 ranked), one request. Random K/V and eviction heads
(hit rates differ from a trained model's). Not a test: nothing is asserted.
"""

from __future__ import annotations

import argparse
import os

from nosa.bench.resolve_speed import run

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", nargs="+", default=["resolve", "drift"],
                    choices=["resolve", "compiled", "select", "drift"])
    ap.add_argument("--shapes", nargs="+", default=["tiny", "smollm2"], choices=["tiny", "smollm2"],
                    help="the shapes of resolve, compiled and drift")
    ap.add_argument("--contexts", nargs="+", type=int, default=[4096, 65536],
                    help="select: prompt tokens per request")
    ap.add_argument("--rounds", type=int, default=8, help="resolve: rounds of off and on")
    ap.add_argument("--chunks", type=int, default=24, help="drift: consecutive chunks timed")
    ap.add_argument("--steps", type=int, default=None,
                    help="decode steps per round or chunk (default 40 for tiny, 8 for smollm2)")
    ap.add_argument("--quick", action="store_true", help="3 rounds, 8 chunks")
    ap.add_argument("--out", default=os.path.join(ROOT, "results", "resolve.json"))
    args = ap.parse_args()
    if args.quick:
        args.rounds, args.chunks = 3, 8
    if args.rounds < 1 or args.chunks < 2:
        ap.error("--rounds must be at least 1 and --chunks at least 2")
    if any(c < 1 for c in args.contexts):
        ap.error("--contexts must be positive token counts")
    run(args)


if __name__ == "__main__":
    main()
