"""The serving backend's decode step captured in a graph and replayed against eager steps
(scripts/graph_check.py): two copies of the decode harness with the same requests, one captured as
SGLang's decode graph runner captures (CUDA graph, or torch.compile on CPU), compared step by step."""

from __future__ import annotations

import json
import time

import torch

from nosa import NosaConfig
from nosa.bench.decode_harness import DecodeHarness
from nosa.bench.results import write_result


def check(offload: bool, device: str, steps: int, compile_backend: str,
          host_kv_dtype: torch.dtype | None = None) -> dict:
    cfg = NosaConfig(block_size=64, compress_kernel=32, compress_stride=16, sink_blocks=1, window_blocks=4,
                     topk_blocks=16, query_blocks=4, dense_len=1024)  # the released ratios, smaller budget
    prompts = [700, 3000, 5200, 9000]  # one within dense_len, three sparse
    shape = dict(num_layers=2, hq=32, hkv=8, head_dim=128, new_tokens=steps + 2, seed=5)
    shape["host_kv_dtype"] = host_kv_dtype  # a quantized host pool (NOSA_HOST_KV_DTYPE), offloading only
    eager = DecodeHarness(cfg, prompts, offload=offload, device=device, **shape)
    graph = DecodeHarness(cfg, prompts, offload=offload, device=device, **shape)
    for h in (eager, graph):
        h.init_graph_state()
    n = len(prompts)
    cuda = device == "cuda"
    graph.begin([0] * n)  # the capture batch: padding rows only, as SGLang's runner captures
    static = [t.clone() for t in graph.new_tokens(10_000)]
    if cuda:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                graph.forward(*static)  # warm-up: kernels compiled, allocator primed
        torch.cuda.current_stream().wait_stream(side)
        cuda_graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(cuda_graph):
            static_out = graph.forward(*static)

        def replay():
            cuda_graph.replay()
            return static_out
    else:
        compiled = torch.compile(graph.forward, fullgraph=True, dynamic=False, backend=compile_backend)
        compiled(*static)

        def replay():
            return compiled(*static)

    def timed(fn):
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        out = fn()
        if cuda:
            torch.cuda.synchronize()
        return out, time.perf_counter() - start

    worst, same, eager_s, graph_s = 0.0, True, [], []
    for step in range(steps):
        rows = list(range(1, n + 1)) if step % 3 else [2, 3, 4, 0]  # a padding row every third step
        q, k, v = eager.new_tokens(step)
        eager.begin(rows)
        graph.begin(rows)
        for dst, src in zip(static, (q, k, v)):
            dst.copy_(src)
        want, seconds = timed(lambda: eager.forward(q, k, v))
        eager_s.append(seconds)
        got, seconds = timed(replay)
        graph_s.append(seconds)
        real = [i for i, r in enumerate(rows) if r]
        worst = max(worst, float((got[real] - want[real]).abs().max()))
        pairs = zip(graph.states.pool.selection, eager.states.pool.selection)
        same = same and all(torch.equal(a[1:], b[1:]) for a, b in pairs)
    ms = lambda xs: round(1000 * sorted(xs)[len(xs) // 2], 3)  # noqa: E731  median
    host = str(host_kv_dtype or "model").removeprefix("torch.")
    return {"offload": offload, "host_kv_dtype": host, "device": device,
            "graph": "cuda graph" if cuda else f"torch.compile {compile_backend}",
            "steps": steps, "batch": n, "prompts": prompts, "max_abs_diff": worst, "selections_equal": same,
            "eager_ms": ms(eager_s), "replay_ms": ms(graph_s), "ok": same and worst < 1e-3}


def run(args) -> int:
    """The check of ``args`` (as scripts/graph_check.py parses them) with offloading off, on, and on
    with int8 and fp8 host pools, each
    mode's result printed; the results written to ``args.out``. Returns 0 when both are ok, else 1."""
    results = []
    modes = [(False, None), (True, None), (True, torch.int8), (True, torch.float8_e4m3fn)]
    for offload, host_dtype in modes:
        try:
            results.append(check(offload, args.device, args.steps, args.compile_backend, host_dtype))
        except Exception as err:  # recorded, so the other mode still runs and the JSON says why
            results.append({"offload": offload, "host_kv_dtype": str(host_dtype), "device": args.device, "ok": False,
                            "error": repr(err)})
        print(json.dumps(results[-1]), flush=True)
    write_result(args.out, {"results": results,
                            "ok": all(r.get("ok") for r in results)})
    return 0 if all(r.get("ok") for r in results) else 1
