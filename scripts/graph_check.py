"""Capture the serving backend's decode step in a graph and replay it against eager steps.

    python scripts/graph_check.py --device cuda --out results/gpu/graph_check.json   # CUDA graphs
    python scripts/graph_check.py --device cpu --steps 4 --out /tmp/graph_check.json  # dry run: torch.compile

For offloading off and on: two copies of the decode step of nosa.serve.decode_runner over SGLang-like
pools (nosa.serve.tools.decode_harness: the backend's DecodeRunner, its state pool, its KV sources, the
block cache and the recall kernel reading pinned host memory when offloading), the same requests in
each. One is captured the way SGLang's decode graph runner captures it: warm-up, then capture on a
batch of padding rows only (CUDA: torch.cuda.CUDAGraph; CPU: torch.compile with fullgraph=True,
dynamic=False, SGLang's CPU graph runner's mode). Then every step, for both copies, the host half
runs eagerly (states caught up, pages, metadata) and the device half runs eagerly in one copy and
by replay in the other, with a padding row in every third step. Written to ``--out``: per mode the
largest difference between the two outputs, whether every selection was the same, the eager and
replay times of the device half, and ``ok``. Runs without SGLang. Not a test: the GPU check
(scripts/gpu_check.sh) calls it where a GPU is lent.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def check(offload: bool, device: str, steps: int, compile_backend: str) -> dict:
    import torch

    from nosa import NosaConfig
    from nosa.serve.tools.decode_harness import DecodeHarness

    cfg = NosaConfig(block_size=64, compress_kernel=32, compress_stride=16, sink_blocks=1, window_blocks=4,
                     topk_blocks=16, query_blocks=4, dense_len=1024)  # the released ratios, smaller budget
    prompts = [700, 3000, 5200, 9000]  # one within dense_len, three sparse
    shape = dict(num_layers=2, hq=32, hkv=8, head_dim=128, new_tokens=steps + 2, seed=5)
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
    return {"offload": offload, "device": device, "graph": "cuda graph" if cuda else f"torch.compile {compile_backend}",
            "steps": steps, "batch": n, "prompts": prompts, "max_abs_diff": worst, "selections_equal": same,
            "eager_ms": ms(eager_s), "replay_ms": ms(graph_s), "ok": same and worst < 1e-3}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--compile-backend", default="inductor", help="CPU: torch.compile backend (aot_eager is faster)")
    ap.add_argument("--out", default=os.path.join(ROOT, "results", "gpu", "graph_check.json"))
    args = ap.parse_args()
    results = []
    for offload in (False, True):
        try:
            results.append(check(offload, args.device, args.steps, args.compile_backend))
        except Exception as err:  # recorded, so the other mode still runs and the JSON says why
            results.append({"offload": offload, "device": args.device, "ok": False, "error": repr(err)})
        print(json.dumps(results[-1]), flush=True)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"command": " ".join(sys.argv), "results": results,
                   "ok": all(r.get("ok") for r in results)}, f, indent=1)
    sys.exit(0 if all(r.get("ok") for r in results) else 1)


if __name__ == "__main__":
    main()
