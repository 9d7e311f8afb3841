"""The decode step with offloading on vs off, with the CPU selection kernel or the torch selection, and
this machine's drift, without SGLang (scripts/bench_resolve.py): the decode harness of each shape
timed in CPU time, the resolve (or the selection) apart, in alternating rounds (eager or compiled),
and one variant in consecutive chunks."""

from __future__ import annotations

import json
import os
import statistics
import time
from unittest import mock

import torch

from nosa import state_pool
from nosa.bench.decode_harness import DecodeHarness
from nosa.bench.longctx.config import budget_config
from nosa.bench.results import write_result
from nosa.config import NosaConfig


def shape(name: str):
    """(NosaConfig, DecodeHarness keyword arguments, prompt lengths) of a shape."""
    if name == "tiny":
        cfg = NosaConfig(block_size=4, compress_kernel=4, compress_stride=4, sink_blocks=1, window_blocks=2,
                         topk_blocks=32, query_blocks=1, dense_len=0)
        return cfg, {"num_layers": 2, "hq": 4, "hkv": 2, "head_dim": 32}, [2048] * 4
    return budget_config(8192, 4), {"num_layers": 30, "hq": 9, "hkv": 3, "head_dim": 64}, [8100]


class Runner:
    """Decode steps of one harness, timed (CPU time of this process): the whole step, the time spent in
    resolve (eager only) and the host half (``begin``)."""

    def __init__(self, cfg, kwargs, lengths, offload: bool, new_tokens: int, compiled: bool = False):
        self.h = DecodeHarness(cfg, lengths, offload=offload, new_tokens=new_tokens, **kwargs)
        self.rows, self.step, self.resolve_s = list(range(1, len(lengths) + 1)), 0, 0.0
        self.forward = self.h.forward
        if compiled:  # as SGLang's CPU graph runner: static buffers, the device half compiled whole
            self.h.init_graph_state()
            self.forward = torch.compile(self.h.forward, fullgraph=True, dynamic=False)
            return
        kv = self.h.decode.kv
        inner = kv.resolve_layer

        def timed(*args, **kw):
            start = time.process_time()
            try:
                return inner(*args, **kw)
            finally:
                self.resolve_s += time.process_time() - start

        kv.resolve_layer = timed

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


SELECT_SHAPE = {"num_layers": 2, "hq": 8, "hkv": 2, "head_dim": 32}  # bench_serve's tiny Llama, batch 4


def bench_select(contexts: list[int], rounds: int, steps: int, smollm2: bool = True) -> dict:
    """The eager decode step (offloading off) with the CPU selection kernel (nosa.kernels.select_cpu)
    and with the torch selection it replaces (``NOSA_KERNELS=reference``, which changes nothing else
    with offloading off), in alternating rounds: bench_serve's tiny Llama at each of ``contexts``
    (batch 4, the released NosaConfig, A = 0), and with ``smollm2`` SmolLM2-135M's attention at the
    long-context suite's 8K budget (30 layers, eviction heads on). Per case and variant the step's and
    the selection's (``StatePool.select``) CPU ms."""
    kinds = {"kernel": "auto", "torch": "reference"}
    cases = {f"tiny llama, {c // 1024}K" if c % 1024 == 0 else f"tiny llama, {c}": (NosaConfig(), SELECT_SHAPE,
                                                                                     [c] * 4, True) for c in contexts}
    if smollm2:
        cases["smollm2-135m, 8K"] = (*shape("smollm2")[:2], [8100], False)
    spent = {"select": 0.0}
    inner = state_pool.StatePool.select

    def timed(self, *args, **kw):
        start = time.process_time()
        try:
            return inner(self, *args, **kw)
        finally:
            spent["select"] += time.process_time() - start

    runners = {}
    for case, (cfg, kwargs, lengths, a0) in cases.items():
        for kind in kinds:
            r = runners[(case, kind)] = Runner(cfg, kwargs, lengths, False, (rounds + 1) * steps + 8)
            if a0:
                with torch.no_grad():
                    for head in r.h.heads:
                        head.scale.zero_()  # A = 0: the query ranks every block, as bench_serve's default
    per = {key: [] for key in runners}
    state_pool.StatePool.select = timed
    try:
        for k in range(rounds + 1):  # round 0 warms up
            keys = list(runners) if k % 2 == 0 else list(runners)[::-1]
            for key in keys:
                spent["select"] = 0.0
                with mock.patch.dict(os.environ, {"NOSA_KERNELS": kinds[key[1]]}):
                    ms = runners[key].run(steps)[0]
                if k:
                    per[key].append((ms, 1e3 * spent["select"] / steps))
            if k:
                print(json.dumps({"part": "select", "round": k, **{f"{c} {kind}": round(per[(c, kind)][-1][0], 3)
                                                                   for c, kind in runners}}), flush=True)
    finally:
        state_pool.StatePool.select = inner
    rows = [{"case": c, "context": cases[c][2][0], "batch": len(cases[c][2]), "layers": cases[c][1]["num_layers"],
             "variant": kind, "cpu_ms_per_step": round(statistics.median(x[0] for x in per[(c, kind)]), 3),
             "select_ms_per_step": round(statistics.median(x[1] for x in per[(c, kind)]), 3)} for c, kind in per]
    tiny = [c for c in cases if cases[c][3]]
    flat = {kind: [b[0] / a[0] for a, b in zip(per[(tiny[0], kind)], per[(tiny[-1], kind)])] for kind in kinds}
    described = {c: {"nosa_config": cfg.to_dict(), "harness": kwargs, "prompt_lengths": lengths,
                     "eviction_heads": "off (A = 0)" if a0 else "on (random)"}
                 for c, (cfg, kwargs, lengths, a0) in cases.items()}
    return {"cases": described,
            "contexts": contexts, "rounds": rounds, "steps_per_round": steps, "rows": rows,
            "longest_over_shortest": {kind: round(statistics.median(v), 3) for kind, v in flat.items()},
            "longest_over_shortest_by_round": {kind: [round(x, 3) for x in v] for kind, v in flat.items()}}


def bench_drift(name: str, chunks: int, steps: int) -> dict:
    cfg, kwargs, lengths = shape(name)
    runner = Runner(cfg, kwargs, lengths, False, (chunks + 1) * steps + 8)
    runner.run(2)
    times = [round(runner.run(steps)[0], 3) for _ in range(chunks)]
    print(json.dumps({"shape": name, "drift_cpu_ms_per_step": times}), flush=True)
    return {"shape": name, "steps_per_chunk": steps, "cpu_ms_per_step": times,
            "max_over_min": round(max(times) / min(times), 3), "median": round(statistics.median(times), 3)}


def run(args) -> None:
    """The parts and shapes of ``args`` (as scripts/bench_resolve.py parses them) in one torch thread,
    each round printed as it is measured; the report written to ``args.out``, its ratios printed."""
    torch.set_num_threads(1)
    report = {"threads": 1, "resolve": [], "compiled": [], "drift": []}
    with torch.inference_mode():
        if "select" in args.parts:
            report["select"] = bench_select(args.contexts, args.rounds, args.steps or 20)
            print(json.dumps({"select": report["select"]["longest_over_shortest"]}))
        for name in args.shapes:
            steps = args.steps or (40 if name == "tiny" else 8)
            if "resolve" in args.parts:
                report["resolve"].append(bench_resolve(name, args.rounds, steps))
            if "compiled" in args.parts:
                report["compiled"].append(bench_resolve(name, args.rounds, steps, compiled=True))
            if "drift" in args.parts:
                report["drift"].append(bench_drift(name, args.chunks, steps))
    write_result(args.out, report)
    for part in report["resolve"] + report["compiled"]:
        print(json.dumps({"shape": part["shape"], "compiled": part["compiled"], **part["ratios"],
                          "hit_rate": part["hit_rate"]}))
    for part in report["drift"]:
        print(json.dumps({k: part[k] for k in ("shape", "median", "max_over_min")}))
