"""Capture the serving backend's decode step in a graph and replay it against eager steps.

    python scripts/graph_check.py --device cuda --out results/gpu/graph_check.json   # CUDA graphs
    python scripts/graph_check.py --device cpu --steps 4 --out /tmp/graph_check.json  # dry run: torch.compile

For offloading off and on: two copies of the decode step of nosa.serve.decode_runner over SGLang-like
pools (nosa.bench.decode_harness: the backend's DecodeRunner, its state pool, its KV sources, the
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
import os
import sys

from nosa.bench.graph_replay import run

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--compile-backend", default="inductor", help="CPU: torch.compile backend (aot_eager is faster)")
    ap.add_argument("--out", default=os.path.join(ROOT, "results", "gpu", "graph_check.json"))
    args = ap.parse_args()
    sys.exit(run(args))


if __name__ == "__main__":
    main()
