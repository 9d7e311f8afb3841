"""NOSA kernels vs dense attention, side by side in one run (ratios, not absolute claims).

Sections (``--only`` picks some):
- decode_slots: one decode step over the device block cache (offloading on): nosa.ops.slot_decode
  (Triton on CUDA, the torch reference on CPU) over NS = topk + 1 slots per (request, KV head) vs
  dense SDPA decode over the whole contiguous context; on CUDA also the Triton kernel and the
  FlashInfer option (nosa.kernels.flashinfer_decode) side by side ("faster" says which should be
  the NOSA_DECODE_IMPL default; "flashinfer" holds the reason when it could not run);
- decode_paged: the paged sparse decode (offloading off): reference and, on CUDA, Triton vs dense;
- prefill: block-sparse prefill forward + backward (nosa.ops.sparse_prefill_attention) vs dense
  causal SDPA forward + backward over the same context;
Shapes: on CUDA Llama-3-8B heads (Hq 32, Hkv 8, D 128, bf16, block 64, top-k 64 blocks); on CPU the
tiny serving model's heads (Hq 8, Hkv 2, D 32, fp32). Each row also records the kernel's max error
against the torch reference on the same inputs (CUDA). Writes JSON (default results/kernels.json).

    python scripts/bench_kernels.py --quick                          # CPU: about a minute
    python scripts/bench_kernels.py --out results/gpu/kernels_gpu.json  # on a GPU (gpu_check.sh)
"""

from __future__ import annotations

import argparse

import torch

from nosa.bench.kernel_speed import run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="results/kernels.json")
    parser.add_argument("--quick", action="store_true", help="fewer sizes and repeats")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--only", default="decode_slots,decode_paged,prefill", help="comma-separated sections")
    parser.add_argument("--threads", type=int, default=0,
                        help="torch intra-op threads (0: torch's default); on a CPU shared with other busy "
                             "processes 1 avoids OpenMP regions waiting on a descheduled thread")
    args = parser.parse_args()
    run(args)


if __name__ == "__main__":
    main()
