"""Decode attention over the NOSA budget vs dense decode attention over the whole context.

Side by side in one run: per (context, batch), the time of one decode attention call
- dense: torch SDPA over every token (contiguous KV, the best case for dense),
- nosa_ref: the torch reference of the paged sparse kernel (gather of the K selected blocks),
- nosa_triton: the Triton kernel (CUDA only; the interpreter is far too slow to time),
and the ratios dense / nosa. Writes JSON (default results/kernels.json).

    python scripts/bench_kernels.py --quick            # CPU: a few minutes at most
    python scripts/bench_kernels.py --out results/kernels_gpu.json   # on a GPU
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from nosa.kernels.sparse_decode import sparse_decode, sparse_decode_reference  # noqa: E402


def timed(fn, repeats: int, device: str) -> float:
    """Median seconds of fn() over `repeats` runs after one warm-up."""
    fn()
    times = []
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def case(context, batch, hq, hkv, d, block, topk, dtype, device, repeats):
    g = torch.Generator(device="cpu").manual_seed(0)
    pool = batch * context
    k_pool = torch.randn(pool, hkv, d, generator=g).to(device, dtype)
    v_pool = torch.randn(pool, hkv, d, generator=g).to(device, dtype)
    cis_pool = torch.randn(pool, hkv, generator=g).to(device) * 0.1
    table = torch.arange(pool, dtype=torch.int32, device=device).reshape(batch, context)
    q = torch.randn(batch, hq, d, generator=g).to(device, dtype)
    nb = context // block
    # a realistic selection: sink, a local window, and random other blocks
    sel = torch.stack([torch.randperm(nb - 17, generator=g)[: topk - 17] + 1 for _ in range(batch * hkv)])
    window = torch.arange(nb - 16, nb).expand(batch * hkv, 16)
    sel = torch.cat([torch.zeros(batch * hkv, 1, dtype=torch.long), sel, window], 1)
    sel = sel.sort(-1).values.reshape(batch, hkv, topk).to(device, torch.int32)
    lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    args = (q, k_pool, v_pool, cis_pool, table, sel, lens, block, d**-0.5)
    k_dense = k_pool.reshape(batch, context, hkv, d).transpose(1, 2)
    v_dense = v_pool.reshape(batch, context, hkv, d).transpose(1, 2)

    def dense():
        return F.scaled_dot_product_attention(q[:, :, None], k_dense, v_dense, enable_gqa=True)

    row = {"context": context, "batch": batch, "dense_s": timed(dense, repeats, device),
           "nosa_ref_s": timed(lambda: sparse_decode_reference(*args), repeats, device)}
    row["dense_over_nosa_ref"] = row["dense_s"] / row["nosa_ref_s"]
    if device == "cuda":
        row["nosa_triton_s"] = timed(lambda: sparse_decode(*args), repeats, device)
        row["dense_over_nosa_triton"] = row["dense_s"] / row["nosa_triton_s"]
        err = (sparse_decode(*args).float() - sparse_decode_reference(*args).float()).abs().max().item()
        row["triton_max_abs_err_vs_ref"] = err
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="results/kernels.json")
    parser.add_argument("--quick", action="store_true", help="small contexts and few repeats")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    device = args.device
    if device == "cuda":  # a model shaped like Llama-3-8B: GQA 32/8, head dim 128, released budget
        shape = dict(hq=32, hkv=8, d=128, block=64, topk=64, dtype=torch.bfloat16)
        grid = [(16384, 16), (32768, 16), (65536, 16), (131072, 8)]
    else:  # the tiny serving model of the benchmarks (GQA 8/2, head dim 32), fp32
        shape = dict(hq=8, hkv=2, d=32, block=64, topk=64, dtype=torch.float32)
        grid = [(8192, 4), (32768, 4), (65536, 4)]
    if args.quick:
        grid = grid[:2]
    repeats = 5 if args.quick else 20
    rows = []
    for context, batch in grid:
        row = case(context, batch, device=device, repeats=repeats, **shape)
        rows.append(row)
        print(json.dumps(row), flush=True)
    result = {"device": torch.cuda.get_device_name() if device == "cuda" else platform.processor() or "cpu",
              "torch": torch.__version__, "shape": {k: str(v) for k, v in shape.items()}, "rows": rows}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
