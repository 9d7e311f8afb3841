"""The decode step with offloading on vs off (where the gap is), and this machine's drift, without SGLang.

    .venv/bin/python scripts/bench_resolve.py [--quick] [--shapes tiny smollm2] [--out results/resolve.json]

Runs nosa.serve.tools.decode_harness (the backend's decode step over SGLang-like pools: select ->
resolve -> attend per layer, no model around it) in one process, one torch thread, inference mode:

- ``resolve``: the same step with offloading off (the resolve reads SGLang's pool in place) and on
  (the device block cache's slot diff, recall, write-through and counters), measured in
  ``--rounds`` rounds of ``--steps`` decode steps each, the two one after the other, the other
  first every other round. Reports per variant the median CPU ms per step and CPU ms in the resolve
  (``kv.resolve``, all layers), and per round the paired ratio of the two (on / off speed): in one
  process seconds apart, so this machine's drift (below) mostly cancels.
- ``compiled``: the same pair with each harness's device half (``DecodeHarness.forward``: what
  SGLang's CPU graph runner compiles) under ``torch.compile(fullgraph=True, dynamic=False)``, in
  alternating rounds as ``resolve``; the host half (``begin``: the step's metadata, the block cache's
  stale drops) is timed apart. Compiling takes minutes at the smollm2 shape.
- ``drift``: the "off" step timed in ``--chunks`` consecutive chunks of ``--steps`` steps inside one
  process, the same work each time: how much this machine's speed moves over seconds.

Shapes: ``tiny``, the quickstart checkpoint's (2 layers, 4/2 heads of 32, blocks of 4, budget 32,
4 requests at 2K); ``smollm2``, SmolLM2-135M's attention (30 layers, 9/3 heads of 64) at the long-
context suite's 8K NosaConfig (_suite_config.budget_config(8192, 4): 64 of 256 blocks of 32 =
1 + 17 + 4 picks + 42 ranked), one request. Random K/V and eviction heads
(hit rates differ from a trained model's). Not a test: nothing is asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def shape(name: str):
    """(NosaConfig, DecodeHarness keyword arguments, prompt lengths) of a shape."""
    from nosa.config import NosaConfig

    if name == "tiny":
        cfg = NosaConfig(block_size=4, compress_kernel=4, compress_stride=4, sink_blocks=1, window_blocks=2,
                         topk_blocks=32, query_blocks=1, dense_len=0)
        return cfg, {"num_layers": 2, "hq": 4, "hkv": 2, "head_dim": 32}, [2048] * 4
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    from _suite_config import budget_config

    return budget_config(8192, 4), {"num_layers": 30, "hq": 9, "hkv": 3, "head_dim": 64}, [8100]


class Runner:
    """Decode steps of one harness, timed (CPU time of this process): the whole step, the time spent in
    resolve (eager only) and the host half (``begin``)."""

    def __init__(self, cfg, kwargs, lengths, offload: bool, new_tokens: int, compiled: bool = False):
        import torch

        from nosa.serve.tools.decode_harness import DecodeHarness

        self.h = DecodeHarness(cfg, lengths, offload=offload, new_tokens=new_tokens, **kwargs)
        self.rows, self.step, self.resolve_s = list(range(1, len(lengths) + 1)), 0, 0.0
        self.forward = self.h.forward
        if compiled:  # as SGLang's CPU graph runner: static buffers, the device half compiled whole
            self.h.init_graph_state()
            self.forward = torch.compile(self.h.forward, fullgraph=True, dynamic=False)
            return
        kv = self.h.decode.kv
        inner = kv.resolve

        def timed(*args, **kw):
            start = time.process_time()
            try:
                return inner(*args, **kw)
            finally:
                self.resolve_s += time.process_time() - start

        kv.resolve = timed

    def run(self, steps: int) -> tuple[float, float, float]:
        """(CPU ms per step, CPU ms in resolve per step, CPU ms in the host half per step) over ``steps``."""
        self.resolve_s, host = 0.0, 0.0
        start = time.process_time()
        for _ in range(steps):
            t0 = time.process_time()
            self.h.begin(self.rows)
            host += time.process_time() - t0
            self.forward(*self.h.new_tokens(self.step))
            self.step += 1
        return 1e3 * (time.process_time() - start) / steps, 1e3 * self.resolve_s / steps, 1e3 * host / steps


def bench_resolve(name: str, rounds: int, steps: int, compiled: bool = False) -> dict:
    cfg, kwargs, lengths = shape(name)
    total = (rounds + 1) * steps + 8
    runners = {v: Runner(cfg, kwargs, lengths, v == "on", total, compiled) for v in ("off", "on")}
    for v, runner in runners.items():
        t0 = time.perf_counter()
        runner.run(2)  # first calls (compiled: the compilation)
        print(json.dumps({"shape": name, "compiled": compiled, "variant": v,
                          "first_steps_s": round(time.perf_counter() - t0, 1)}), flush=True)
    per = {v: [] for v in runners}
    for k in range(rounds):
        for v in ("off", "on") if k % 2 == 0 else ("on", "off"):
            per[v].append(runners[v].run(steps))
        last = {v: [round(x, 3) for x in per[v][-1]] for v in per}
        print(json.dumps({"shape": name, "compiled": compiled, "round": k, **last}),
              flush=True)
    rows = {v: {"cpu_ms_per_step": round(statistics.median(x[0] for x in per[v]), 3),
                "host_half_ms_per_step": round(statistics.median(x[2] for x in per[v]), 3)} for v in per}
    if not compiled:
        for v in per:
            rows[v]["resolve_ms_per_step"] = round(statistics.median(x[1] for x in per[v]), 3)
    paired = {"on_over_off_speed": [a[0] / b[0] for a, b in zip(per["off"], per["on"])],
              "on_minus_off_ms": [b[0] - a[0] for a, b in zip(per["off"], per["on"])],
              "on_minus_off_host_half_ms": [b[2] - a[2] for a, b in zip(per["off"], per["on"])]}
    if not compiled:
        paired["on_minus_off_resolve_ms"] = [b[1] - a[1] for a, b in zip(per["off"], per["on"])]
    stats = runners["on"].h.engine.cache.stats
    hit_rate = sum(stats["hits"]) / max(1, sum(stats["selected"]))
    return {"shape": name, "compiled": compiled, "nosa_config": cfg.to_dict(),
            "harness": {**kwargs, "prompt_lengths": lengths},
            "rounds": rounds, "steps_per_round": steps, "variants": rows, "hit_rate": round(hit_rate, 4),
            "ratios": {k: round(statistics.median(v), 3) for k, v in paired.items()},
            "ratios_by_round": {k: [round(x, 3) for x in v] for k, v in paired.items()}}


def bench_drift(name: str, chunks: int, steps: int) -> dict:
    cfg, kwargs, lengths = shape(name)
    runner = Runner(cfg, kwargs, lengths, False, (chunks + 1) * steps + 8)
    runner.run(2)
    times = [round(runner.run(steps)[0], 3) for _ in range(chunks)]
    print(json.dumps({"shape": name, "drift_cpu_ms_per_step": times}), flush=True)
    return {"shape": name, "steps_per_chunk": steps, "cpu_ms_per_step": times,
            "max_over_min": round(max(times) / min(times), 3), "median": round(statistics.median(times), 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", nargs="+", default=["resolve", "drift"], choices=["resolve", "compiled", "drift"])
    ap.add_argument("--shapes", nargs="+", default=["tiny", "smollm2"], choices=["tiny", "smollm2"])
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
    import torch

    torch.set_num_threads(1)
    report = {"command": " ".join(sys.argv), "threads": 1, "cpus": os.cpu_count(), "resolve": [], "compiled": [],
              "drift": []}
    with torch.inference_mode():
        for name in args.shapes:
            steps = args.steps or (40 if name == "tiny" else 8)
            if "resolve" in args.parts:
                report["resolve"].append(bench_resolve(name, args.rounds, steps))
            if "compiled" in args.parts:
                report["compiled"].append(bench_resolve(name, args.rounds, steps, compiled=True))
            if "drift" in args.parts:
                report["drift"].append(bench_drift(name, args.chunks, steps))
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    for part in report["resolve"] + report["compiled"]:
        print(json.dumps({"shape": part["shape"], "compiled": part["compiled"], **part["ratios"],
                          "hit_rate": part["hit_rate"]}))
    for part in report["drift"]:
        print(json.dumps({k: part[k] for k in ("shape", "median", "max_over_min")}))


if __name__ == "__main__":
    main()
