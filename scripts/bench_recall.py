"""Recall bandwidth: the batched gather-scatter vs one copy per block vs one large copy of the same bytes.

Side by side in one run, per batch of M missed (block, KV head) items of one layer (K, V and cis;
Llama-3-8B-shaped items by default: 64 tokens x 128 dims bf16 = 16 KiB each for K and V):
- batched: nosa.ops.copy_items, ONE call for K, V and cis (CPU: cache-resident staging
  index_select + index_copy_; CUDA: one Triton launch reading the pinned host pool directly);
- per_block: one copy_ per item and tensor (3 M calls; on CUDA non_blocking from pinned memory);
- one_copy: one contiguous copy of the same bytes per tensor (the bandwidth ceiling);
- writeback: the batched call in the other direction (device -> host), as completed blocks go;
- host_dtypes: the batched recall from a bf16, an int8 and an fp8 host pool (nosa.kvquant, dequantized
  into the bf16 device slots on the way): seconds, bytes over the link, and equality with the spec;
- on CUDA also the link itself (one 1 GiB pinned host -> device copy) and, when sgl_kernel is
  installed, SGLang HiCache's transfer_kv_per_layer on the same K and V items.
Items are drawn at random from a host pool larger than the caches, into random device slots.
Targets: batched >= 4x per_block (one call instead of 3 M small copies) and >= 80% of one_copy
(the gather costs little beyond the bytes it moves).

    python scripts/bench_recall.py --quick            # CPU, a few seconds
    python scripts/bench_recall.py --out results/gpu/recall_gpu.json   # on a GPU (gpu_check.sh)
"""

from __future__ import annotations

import argparse

import torch

from nosa.bench.recall_speed import run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="results/recall.json")
    parser.add_argument("--quick", action="store_true", help="fewer sizes and repeats")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--block", type=int, default=64)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--no-dtypes", action="store_true",
                        help="skip the host KV dtypes (bf16 vs int8 vs fp8 pools, NOSA_HOST_KV_DTYPE)")
    parser.add_argument("--threads", type=int, default=0,
                        help="torch intra-op threads (0: torch's default). On a CPU shared with other busy "
                             "processes, 1 avoids OpenMP regions waiting on a descheduled thread")
    args = parser.parse_args()
    run(args)


if __name__ == "__main__":
    main()
