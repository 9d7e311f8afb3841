"""Recall bandwidth (scripts/bench_recall.py): the batched gather-scatter of missed (block, KV head)
items vs one copy per block vs one large copy of the same bytes, and the write-back; on CUDA also
the link and SGLang HiCache's transfer kernel."""

from __future__ import annotations

import json
import os
import platform
import statistics
import time

import torch

from nosa import ops
from nosa.bench.results import write_result
from nosa.kvquant import QuantizedItems, dequantize, key_factors, quantize

HKV = 8  # KV heads of the host pool's items (Llama-3-8B's), for the int8 keys' factors


def timed(fn, repeats: int, cuda: bool) -> float:
    """Median seconds of fn() over `repeats` runs after one warm-up."""
    fn()
    times = []
    for _ in range(repeats):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def host_tensor(shape, dtype, cuda: bool, g) -> torch.Tensor:
    t = torch.randn(shape, generator=g).to(dtype)
    return t.pin_memory() if cuda else t


def case(items: int, host_items: int, slots: int, block: int, d: int, dtype, cuda: bool, repeats: int, g) -> dict:
    dev = "cuda" if cuda else "cpu"
    k_host = host_tensor((host_items, block, d), dtype, cuda, g)
    v_host = host_tensor((host_items, block, d), dtype, cuda, g)
    c_host = host_tensor((host_items, block), torch.float32, cuda, g)
    k_dev = torch.zeros(slots, block, d, dtype=dtype, device=dev)
    v_dev = torch.zeros(slots, block, d, dtype=dtype, device=dev)
    c_dev = torch.zeros(slots, block, dtype=torch.float32, device=dev)
    src_idx = torch.randperm(host_items, generator=g)[:items]
    dst_idx = torch.randperm(slots, generator=g)[:items]
    dst, src = (k_dev, v_dev, c_dev), (k_host, v_host, c_host)
    nbytes = sum(t[:1].numel() * t.element_size() for t in src) * items
    s_i, d_i = src_idx.to(dev), dst_idx.to(dev)

    def batched():
        ops.copy_items(dst, src, d_i, s_i)

    def writeback():
        ops.copy_items(src, dst, s_i, d_i)

    pairs = list(zip(dst_idx.tolist(), src_idx.tolist()))

    def per_block():
        for d_, s_ in pairs:
            for a, b in zip(dst, src):
                a[d_].copy_(b[s_], non_blocking=cuda)

    def one_copy():
        for a, b in zip(dst, src):
            a[:items].copy_(b[:items], non_blocking=cuda)

    batched()  # correctness of what is timed: the batched call equals the per-block loop
    expect = [t.clone() for t in dst]
    for t in dst:
        t.zero_()
    per_block()
    if cuda:
        torch.cuda.synchronize()
    exact = all(torch.equal(a, b) for a, b in zip(expect, dst))
    row = {"items": items, "item_kib_kv": block * d * torch.empty((), dtype=dtype).element_size() / 1024,
           "bytes": nbytes, "batched_equals_per_block": exact}
    for name, fn in (("batched", batched), ("per_block", per_block), ("one_copy", one_copy),
                     ("writeback", writeback)):
        row[f"{name}_s"] = timed(fn, repeats, cuda)
        row[f"{name}_gbps"] = nbytes / row[f"{name}_s"] / 1e9
    if cuda:  # SGLang HiCache's per-layer K+V transfer kernel, when sgl_kernel is installed (K and V only)
        try:
            from sgl_kernel.kvcacheio import transfer_kv_per_layer  # optional: sgl_kernel (SGLang GPU wheels)

            item_bytes = k_host[0].numel() * k_host.element_size()
            kv_bytes = 2 * item_bytes * items
            seconds = timed(lambda: transfer_kv_per_layer(k_host, k_dev, v_host, v_dev, s_i, d_i, item_bytes),
                            repeats, cuda)
            row["sgl_transfer_kv_gbps"] = kv_bytes / seconds / 1e9
        except Exception as e:  # not installed (the usual case off SGLang's GPU wheels) or another API
            row["sgl_transfer_kv"] = repr(e)[:200]
    row["batched_over_per_block"] = row["per_block_s"] / row["batched_s"]
    row["batched_fraction_of_one_copy"] = row["one_copy_s"] / row["batched_s"]
    return row


def dtype_case(items: int, host_items: int, slots: int, block: int, d: int, cuda: bool, repeats: int, g) -> dict:
    """The batched recall of ``items`` items from a host pool in bf16, int8 and fp8 (nosa.kvquant:
    K and V quantized with per-token scales, int8 keys divided by key factors first, cis float32), side
    by side: seconds, bytes over the link (data, scales and cis), and whether the dequantized result
    equals the spec."""
    dev = "cuda" if cuda else "cpu"
    pin = (lambda t: t.pin_memory()) if cuda else (lambda t: t)
    k, v = (torch.randn(host_items, block, d, generator=g).bfloat16() for _ in range(2))
    cis = pin(torch.randn(host_items, block, generator=g))
    src_idx = torch.randperm(host_items, generator=g)[:items].to(dev)
    dst_idx = torch.randperm(slots, generator=g)[:items].to(dev)
    dst = [torch.zeros(slots, block, d, dtype=torch.bfloat16, device=dev) for _ in range(2)]
    dst.append(torch.zeros(slots, block, device=dev))
    row = {"items": items}
    for name, fmt in (("bfloat16", None), ("int8", torch.int8), ("float8_e4m3fn", torch.float8_e4m3fn)):
        if fmt is None:
            src = [pin(k), pin(v), cis]
            want = [k[src_idx.cpu()], v[src_idx.cpu()]]
        else:
            # int8 keys with key factors as a calibrated checkpoint's pool holds them (item m: KV head m % HKV)
            factor = key_factors(torch.rand(HKV, d, generator=g) * 8 + 0.5) if fmt == torch.int8 else None
            item_factor = [None if factor is None else factor[torch.arange(host_items) % HKV, None], None]
            quantized = [quantize(t, fmt, factor=f) for t, f in zip((k, v), item_factor)]
            factors = [None if factor is None else factor.to(dev), None]
            src = [QuantizedItems(pin(q), pin(s), torch.bfloat16, f) for (q, s), f in zip(quantized, factors)] + [cis]
            picked = src_idx.cpu()
            want = [dequantize(q[picked], s[picked], torch.bfloat16, None if f is None else f[picked])
                    for (q, s), f in zip(quantized, item_factor)]
        per_item = sum(getattr(t, "item_bytes", lambda t=t: t[0].numel() * t.element_size())() for t in src)
        ops.copy_items(dst, src, dst_idx, src_idx)
        row[f"{name}_matches_spec"] = all(torch.equal(a[dst_idx].cpu(), w) for a, w in zip(dst, want))
        row[f"{name}_s"] = timed(lambda src=src: ops.copy_items(dst, src, dst_idx, src_idx), repeats, cuda)
        row[f"{name}_bytes"] = per_item * items
        row[f"{name}_gbps"] = per_item * items / row[f"{name}_s"] / 1e9
    for name in ("int8", "float8_e4m3fn"):
        row[f"{name}_bytes_over_bf16"] = row[f"{name}_bytes"] / row["bfloat16_bytes"]
        row[f"{name}_speedup_over_bf16"] = row["bfloat16_s"] / row[f"{name}_s"]
    return row


def link_gbps(cuda: bool, repeats: int) -> float | None:
    """Pinned host -> device bandwidth of one 1 GiB copy (the PCIe link as torch sees it)."""
    if not cuda:
        return None
    host = torch.empty(1 << 30, dtype=torch.uint8).pin_memory()
    dev = torch.empty_like(host, device="cuda")
    return host.numel() / timed(lambda: dev.copy_(host, non_blocking=True), repeats, True) / 1e9


def run(args) -> None:
    """The recall cases of ``args`` (as scripts/bench_recall.py parses them), each row printed as it
    is measured; the result written to ``args.out``."""
    if args.threads:
        torch.set_num_threads(args.threads)
    cuda = args.device == "cuda"
    g = torch.Generator().manual_seed(0)
    # misses per layer and step: (query_blocks + 1) x Hkv x batch, e.g. 16 x 8 x {2, 8, 16}
    grid = [256, 1024, 2048] if not args.quick else [256, 1024]
    host_items = 16384 if not args.quick else 8192  # 256 / 128 MiB per K and V: beyond the caches
    repeats = 10 if not args.quick else 5
    rows = []
    for items in grid:
        row = case(items, host_items, max(grid), args.block, args.head_dim, torch.bfloat16, cuda, repeats, g)
        rows.append(row)
        print(json.dumps(row), flush=True)
    host_dtypes = []
    if not args.no_dtypes:  # NOSA_HOST_KV_DTYPE: the same recall from a quantized host pool
        for items in grid:
            row = dtype_case(items, host_items, max(grid), args.block, args.head_dim, cuda, repeats, g)
            host_dtypes.append(row)
            print(json.dumps(row), flush=True)
    result = {
        "device": torch.cuda.get_device_name() if cuda else (platform.processor() or "cpu"),
        "threads": torch.get_num_threads(), "load_average_1min": os.getloadavg()[0],
        "block": args.block,
        "head_dim": args.head_dim, "dtype": "bfloat16", "host_items": host_items,
        "link_gbps": link_gbps(cuda, repeats), "rows": rows, "host_dtypes": host_dtypes,
        "targets": {"batched_over_per_block": 4.0, "batched_fraction_of_one_copy": 0.8},
    }
    write_result(args.out, result)
    print(f"wrote {args.out}")
