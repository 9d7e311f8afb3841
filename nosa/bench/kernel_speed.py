"""NOSA kernels vs dense attention, timed side by side in one run (scripts/bench_kernels.py): the
decode over the device block cache (offloading on), the paged sparse decode (offloading off), the
block-sparse prefill forward + backward; each row with the kernel's error against its torch reference on CUDA."""

from __future__ import annotations

import json
import platform
import statistics
import time

import torch
import torch.nn.functional as F

from nosa import ops
from nosa.bench.results import write_result
from nosa.kernels.flashinfer_decode import slot_decode_flashinfer
from nosa.kernels.slot_decode import slot_decode as triton_slot_decode
from nosa.kernels.slot_decode import slot_decode_reference
from nosa.kernels.sparse_decode import sparse_decode, sparse_decode_reference
from nosa.kernels.sparse_prefill import sparse_prefill_reference

DEVICE = "cpu"
CUDA_SHAPE = dict(hq=32, hkv=8, d=128, block=64, topk=64, dtype=torch.bfloat16)  # Llama-3-8B heads, the released budget
CUDA_PREFILL_CONTEXT = 32768  # the prefill row on CUDA (scripts/tune_sparse_prefill.py sweeps its launch)
WARMUP_S = 0.2  # CUDA: seconds of untimed calls before each timing (the clocks ramp up)


def randn(*shape, dtype=torch.float32) -> torch.Tensor:
    """Random inputs made on the benchmark's device (CPU randn of GiBs would take minutes)."""
    return torch.randn(shape, device=DEVICE).to(dtype)


def timed(fn, repeats: int, device: str) -> float:
    """Median seconds of fn() over `repeats` runs after a warm-up: one call on CPU; on CUDA calls for
    at least WARMUP_S, so that an idle GPU's clocks have ramped up before the first timed call (an H200
    idles at a few hundred MHz, and a one-call warm-up let two quick runs of one kernel differ 1.8x)."""
    fn()
    if device == "cuda":
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < WARMUP_S:
            fn()
            torch.cuda.synchronize()
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


def selection(batch_heads: int, nb: int, topk: int, g) -> torch.Tensor:
    """A realistic decode selection per (sequence, KV head): sink, a 16-block window, random others."""
    sel = torch.stack([torch.randperm(nb - 17, generator=g)[: topk - 17] + 1 for _ in range(batch_heads)])
    window = torch.arange(nb - 16, nb).expand(batch_heads, 16)
    return torch.cat([torch.zeros(batch_heads, 1, dtype=torch.long), sel, window], 1).sort(-1).values


def dense_decode(q, k_dense, v_dense):
    return F.scaled_dot_product_attention(q[:, :, None], k_dense, v_dense, enable_gqa=True)


def decode_slots(context, batch, hq, hkv, d, block, topk, dtype, device, repeats, g):
    """Offloading on: the device cache holds each (request, KV head)'s topk blocks + the tail block."""
    ns = topk + 1
    k_dense, v_dense = randn(batch, hkv, context, d, dtype=dtype), randn(batch, hkv, context, d, dtype=dtype)
    q = randn(batch, hq, d, dtype=dtype)
    slots_total = batch * hkv * ns
    k_dev, v_dev = randn(slots_total, block, d, dtype=dtype), randn(slots_total, block, d, dtype=dtype)
    cis_dev = randn(slots_total, block) * 0.1
    slots = torch.randperm(slots_total, generator=g).view(batch, hkv, ns).to(device)
    fill = torch.full((batch, hkv, ns), block, dtype=torch.int32, device=device)
    fill[..., -1] = block // 2
    args = (q, k_dev, v_dev, cis_dev, slots, fill, d**-0.5)
    row = {"context": context, "batch": batch, "slots_per_head": ns,
           "dense_s": timed(lambda: dense_decode(q, k_dense, v_dense), repeats, device),
           "nosa_s": timed(lambda: ops.slot_decode(*args), repeats, device), "nosa_backend": ops.backend(q),
           "decode_impl": ops.decode_impl()}
    row["dense_over_nosa"] = row["dense_s"] / row["nosa_s"]
    if device == "cuda":
        want = slot_decode_reference(*args)[0].float()
        row["max_abs_err_vs_ref"] = (ops.slot_decode(*args)[0].float() - want).abs().max().item()
        row.update(flashinfer_column(args, want, row, repeats))
    else:
        row["flashinfer"] = "CUDA only"
    return row


def flashinfer_column(args, want, row, repeats) -> dict:
    """The FlashInfer option beside the Triton kernel on the same inputs: seconds, ratios, error;
    or why it could not run (not installed, JIT build failed, ...)."""
    triton_s = timed(lambda: triton_slot_decode(*args), repeats, "cuda")
    try:
        got = slot_decode_flashinfer(*args)[0].float()  # first call: plan (and the JIT build if not cached)
        fi_s = timed(lambda: slot_decode_flashinfer(*args), repeats, "cuda")
    except Exception as e:  # a missing package or a failed build is a result to report, not a crash
        return {"triton_s": triton_s, "flashinfer": f"unavailable: {e!r}"[:500]}
    return {"triton_s": triton_s, "flashinfer_s": fi_s, "dense_over_flashinfer": row["dense_s"] / fi_s,
            "triton_over_flashinfer": triton_s / fi_s, "faster": "flashinfer" if fi_s < triton_s else "triton",
            "flashinfer_max_abs_err_vs_ref": (got - want).abs().max().item()}


def decode_paged(context, batch, hq, hkv, d, block, topk, dtype, device, repeats, g):
    """Offloading off: selected blocks read from SGLang's paged token pool through the token table."""
    pool = batch * context
    k_pool, v_pool = randn(pool, hkv, d, dtype=dtype), randn(pool, hkv, d, dtype=dtype)
    cis_pool = randn(pool, hkv) * 0.1
    table = torch.arange(pool, dtype=torch.int32, device=device).reshape(batch, context)
    q = randn(batch, hq, d, dtype=dtype)
    sel = selection(batch * hkv, context // block, topk, g).reshape(batch, hkv, topk).to(device, torch.int32)
    lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    args = (q, k_pool, v_pool, cis_pool, table, sel, lens, block, d**-0.5)
    k_dense = k_pool.reshape(batch, context, hkv, d).transpose(1, 2)
    v_dense = v_pool.reshape(batch, context, hkv, d).transpose(1, 2)
    row = {"context": context, "batch": batch, "dense_s": timed(lambda: dense_decode(q, k_dense, v_dense), repeats,
                                                                 device),
           "nosa_ref_s": timed(lambda: sparse_decode_reference(*args), repeats, device)}
    row["dense_over_nosa_ref"] = row["dense_s"] / row["nosa_ref_s"]
    if device == "cuda":
        row["nosa_triton_s"] = timed(lambda: sparse_decode(*args), repeats, device)
        row["dense_over_nosa_triton"] = row["dense_s"] / row["nosa_triton_s"]
        row["max_abs_err_vs_ref"] = (sparse_decode(*args).float() - sparse_decode_reference(*args).float()
                                     ).abs().max().item()
    return row


def prefill_selection(context, hkv, block, topk, window, device, g):
    """Per row: sink, the window (current block and window-1 before), a per-head static top set
    (fixed per KV head, as the eviction ranking is) and per-row query-aware picks drawn from a pool
    shared by the rows of a block; -1 where too few blocks."""
    nb = context // block
    rank = torch.rand(hkv, nb, device=device)
    cur = torch.arange(context, device=device) // block  # [n]
    free = topk - 1 - window
    picks = free // 2
    static_n = free - picks
    # static part per distinct current block: the best-ranked blocks in [1, cur - window]
    static = torch.full((nb, hkv, static_n), -1, dtype=torch.long, device=device)
    blocks = torch.arange(nb, device=device)
    for c in range(window + 1, nb):
        allowed = (blocks >= 1) & (blocks <= c - window)
        top = rank.masked_fill(~allowed, -1).topk(min(static_n, int(allowed.sum())), dim=-1)
        static[c, :, : top.indices.shape[1]] = top.indices
    rows = static[cur]  # [n, Hkv, static_n]
    win = cur[:, None] - torch.arange(window, device=device)  # [n, window]
    win = torch.where(win >= 1, win, -1)[:, None].expand(-1, hkv, -1)
    # query-aware picks: neighbouring queries want similar blocks, so each row draws its picks from a
    # pool of 2 x picks candidates per current block (rows of one block overlap, but differ)
    pool = 1 + (torch.rand(nb, hkv, 2 * picks, device=device) * (blocks - window).clamp(min=1)[:, None, None]).long()
    choice = torch.randint(0, max(1, 2 * picks), (context, hkv, picks), device=device)
    rand = pool[cur].gather(-1, choice)
    rand = torch.where(cur[:, None, None] > window, rand, -1)
    sink = torch.zeros(context, hkv, 1, dtype=torch.long, device=device)
    return torch.cat([sink, win, rows, rand], -1)  # [n, Hkv, topk]; duplicates only cost time


def prefill_inputs(context, hq, hkv, d, block, topk, dtype, device, g):
    """The prefill section's inputs (also scripts/tune_sparse_prefill.py's): q, k, v (leaves), cis
    (a leaf), sel, positions, dout."""
    q, k, v = (torch.randn(n, h, d, device=device).to(dtype).requires_grad_()
               for n, h in ((context, hq), (context, hkv), (context, hkv)))
    cis = (torch.randn(context, hkv, device=device) * 0.1).requires_grad_()
    sel = prefill_selection(context, hkv, block, topk, min(17, topk - 2), device, g)
    positions = torch.arange(context, device=device)
    dout = torch.randn(context, hq, d, device=device).to(dtype)
    return q, k, v, cis, sel, positions, dout


def dense_prefill_inputs(q, k, v, dout, group: int):
    """The dense baseline's (q, k, v, dout) as SDPA takes them [1, Hq, n, D]: K/V heads repeated for
    the group (leaves), so that SDPA takes its flash kernel."""
    qd = q.detach().transpose(0, 1)[None].requires_grad_()
    kd, vd = (x.detach().repeat_interleave(group, dim=1).transpose(0, 1)[None].requires_grad_() for x in (k, v))
    return qd, kd, vd, dout.transpose(0, 1)[None]


def prefill(context, hq, hkv, d, block, topk, dtype, device, repeats, g):
    q, k, v, cis, sel, positions, dout = prefill_inputs(context, hq, hkv, d, block, topk, dtype, device, g)

    def sparse():
        out, _ = ops.sparse_prefill_attention(q, k, v, cis, sel, positions, block, d**-0.5)
        out.backward(dout)

    def sparse_fwd():
        with torch.no_grad():
            ops.sparse_prefill_attention(q, k, v, cis, sel, positions, block, d**-0.5)

    qd, kd, vd, dd = dense_prefill_inputs(q, k, v, dout, hq // hkv)

    def dense():
        F.scaled_dot_product_attention(qd, kd, vd, is_causal=True).backward(dd)

    def dense_fwd():
        with torch.no_grad():
            F.scaled_dot_product_attention(qd, kd, vd, is_causal=True)

    row = {"context": context, "topk_blocks": topk, "nosa_backend": ops.backend(q),
           "dense_fwd_s": timed(dense_fwd, repeats, device), "nosa_fwd_s": timed(sparse_fwd, repeats, device),
           "dense_fwd_bwd_s": timed(dense, repeats, device), "nosa_fwd_bwd_s": timed(sparse, repeats, device)}
    row["dense_over_nosa_fwd"] = row["dense_fwd_s"] / row["nosa_fwd_s"]
    row["dense_over_nosa_fwd_bwd"] = row["dense_fwd_bwd_s"] / row["nosa_fwd_bwd_s"]
    if device == "cuda":  # error against the reference on the last 32 rows (the reference gathers per row)
        rows = slice(context - 32, context)
        with torch.no_grad():
            out = ops.sparse_prefill_attention(q, k, v, cis, sel, positions, block, d**-0.5)[0][rows]
            want = sparse_prefill_reference(q[rows], k, v, cis, sel[rows], positions[rows], block, d**-0.5)[0]
        row["fwd_max_abs_err_vs_ref"] = (out.float() - want.float()).abs().max().item()
    return row


def guarded(fn, key: dict, **kwargs) -> dict:
    """fn(**key, **kwargs), or the error it raised (one failing size must not lose the others)."""
    try:
        return fn(**key, **kwargs)
    except Exception as e:  # e.g. out of memory at the largest size: record it and go on
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return dict(key, error=repr(e)[:500])


def run(args) -> None:
    """The sections of ``args.only`` (as scripts/bench_kernels.py parses them) at the device's shapes,
    each row printed as it is measured; the result written to ``args.out``."""
    if args.threads:
        torch.set_num_threads(args.threads)
    global DEVICE
    device = DEVICE = args.device
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    if device == "cuda":
        shape = CUDA_SHAPE
        decode_grid = [(32768, 16), (131072, 8)] if args.quick else [(32768, 16), (65536, 16), (131072, 8)]
        prefill_grid = [CUDA_PREFILL_CONTEXT]
    else:  # the tiny serving model's heads, fp32
        shape = dict(hq=8, hkv=2, d=32, block=64, topk=64, dtype=torch.float32)
        decode_grid = [(8192, 4), (32768, 4)] if args.quick else [(8192, 4), (32768, 4), (65536, 4)]
        prefill_grid = [2048]
    repeats = 5 if args.quick else 20
    if device == "cuda":  # a GPU call is cheap next to a CPU one: more repeats, the median steadier
        repeats *= 5
    sections = [s for s in args.only.split(",") if s]
    result = {"device": torch.cuda.get_device_name() if device == "cuda" else platform.processor() or "cpu",
              "threads": torch.get_num_threads(), "repeats": repeats,
              "shape": {k: str(v) for k, v in shape.items()}}
    for section in sections:
        rows = []
        if section in ("decode_slots", "decode_paged"):
            fn = decode_slots if section == "decode_slots" else decode_paged
            for context, batch in decode_grid:
                rows.append(guarded(fn, dict(context=context, batch=batch), device=device, repeats=repeats, g=g,
                                    **shape))
                print(section, json.dumps(rows[-1]), flush=True)
        elif section == "prefill":
            pshape = dict(shape, topk=8) if device == "cpu" else shape  # CPU: the reference gathers per row
            for context in prefill_grid:
                rows.append(guarded(prefill, dict(context=context), device=device, repeats=max(2, repeats // 4), g=g,
                                    **pshape))
                print(section, json.dumps(rows[-1]), flush=True)
        else:
            raise SystemExit(f"--only: unknown section {section!r} (decode_slots, decode_paged, prefill)")
        result[section] = rows
    write_result(args.out, result)
    print(f"wrote {args.out}")
