"""Training step time, dense vs NOSA, side by side in one run (scripts/bench_train.py): full optimizer
steps of the config's model and of its NOSA conversion (eviction heads on), the serving extend's
attention against dense SDPA, and the crossover of the two CPU paths of the selected-block attention."""

from __future__ import annotations

import copy
import json
import os
import platform
import statistics
import time

import torch

import nosa
from nosa import NosaConfig, nosa_prefill
from nosa.attention.gathered import attend_grouped
from nosa.attention.masked import attend_masked
from nosa.attention.math import dense_attention
from nosa.attention.prefill import prefill_attention
from nosa.bench import REPO
from nosa.bench.results import write_result
from nosa.tiny import build_causal_lm, set_eviction_heads
from nosa.train.config import load_config

# Random-weight stand-ins of real checkpoints' shapes (--like): their config.json's architecture keys
SHAPES = {
    "smollm2-135m": dict(model_type="llama", hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=8192,
                         rope_theta=100000.0, tie_word_embeddings=True, rms_norm_eps=1e-5, vocab_size=49152),
}


def make_step(model, batch: dict, lr: float, device: str = "cpu"):
    """One full optimizer step of ``model`` on ``batch``: (wall seconds, this process's CPU seconds).
    On CUDA in bf16 autocast over float32 weights (mixed precision, as DeepSpeed's bf16 trains), timed
    to the end of the GPU's work."""
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    cuda = device.startswith("cuda")

    def step() -> tuple[float, float]:
        if cuda:
            torch.cuda.synchronize()
        t0, c0 = time.perf_counter(), time.process_time()
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=cuda):
            loss = model(**batch, use_cache=False).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - t0, time.process_time() - c0

    return step


def step_times(dense, sparse, seq_len: int, micro_batch: int, lr: float, warmup: int, steps: int, device: str,
               seed: int) -> dict:
    """Median (and least, and every) step time of the two models on ``micro_batch`` rows of ``seq_len``
    random tokens, alternating step by step so that machine noise hits both alike."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, dense.config.vocab_size, (micro_batch, seq_len), generator=g).to(device)
    batch = {"input_ids": ids, "labels": ids}
    fns = {"dense": make_step(dense, batch, lr, device), "nosa": make_step(sparse, batch, lr, device)}
    times = {name: [] for name in fns}
    cpu = {name: [] for name in fns}
    for i in range(warmup + steps):
        for name, step in fns.items():
            dt, dc = step()
            if i >= warmup:
                times[name].append(dt)
                cpu[name].append(dc)
    out = {"seq_len": seq_len, "micro_batch": micro_batch,
           "step_s": {name: {"median": round(statistics.median(ts), 3), "min": round(min(ts), 3),
                             "all": [round(t, 3) for t in ts]} for name, ts in times.items()},
           # CPU seconds of this process per step (the least of the timed steps): less sensitive to
           # other load on a shared machine than wall time
           "step_cpu_s": {name: round(min(ts), 3) for name, ts in cpu.items()}}
    out["ratio_nosa_over_dense"] = round(out["step_s"]["nosa"]["median"] / out["step_s"]["dense"]["median"], 2)
    out["cpu_ratio_nosa_over_dense"] = round(out["step_cpu_s"]["nosa"] / out["step_cpu_s"]["dense"], 2)
    if device.startswith("cuda"):
        out["peak_memory_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
        torch.cuda.reset_peak_memory_stats()
    return out


def prefill_case(context: int, a_nonzero: bool, hq: int = 8, hkv: int = 2, d: int = 32, repeats: int = 1) -> dict:
    """The serving extend's attention (``prefill_attention``: no selections for the rows within
    dense_len) vs dense causal SDPA (the kernel SGLang's torch_native backend runs) over one
    layer's q/k/v of ``context`` tokens (the serving benchmark's head shapes), eviction scores zero
    (A = 0) or not."""
    cfg = NosaConfig()
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(context, h, d, generator=g) for h in (hq, hkv, hkv))
    cis = torch.rand(context, hkv, generator=g) if a_nonzero else torch.zeros(context, hkv)
    times = {"dense_sdpa": [], "prefill_attention": []}
    cpu = {"dense_sdpa": [], "prefill_attention": []}
    with torch.no_grad():
        for _ in range(repeats):
            for name, fn in (("dense_sdpa", lambda: dense_attention(q, k, v, d**-0.5)),
                             ("prefill_attention", lambda: prefill_attention(q, k, v, cis, cfg, d**-0.5))):
                t0, c0 = time.perf_counter(), time.process_time()
                fn()
                times[name].append(time.perf_counter() - t0)
                cpu[name].append(time.process_time() - c0)
    out = {"context": context, "heads": f"{hq}/{hkv}", "head_dim": d, "nosa_config": cfg.to_dict(),
           "cis": "uniform [0, 1) (A != 0)" if a_nonzero else "0 (A = 0, a dense checkpoint)"}
    for name in times:
        out[f"{name}_s"] = round(min(times[name]), 3)
        out[f"{name}_cpu_s"] = round(min(cpu[name]), 3)
    out["ratio_nosa_over_dense"] = round(out["prefill_attention_s"] / out["dense_sdpa_s"], 2)
    out["cpu_ratio_nosa_over_dense"] = round(out["prefill_attention_cpu_s"] / out["dense_sdpa_cpu_s"], 2)
    return out


def crossover_case(context: int, cfg, training: bool, hq: int, hkv: int, d: int = 32, repeats: int = 3) -> dict:
    """The two CPU paths of ``nosa.attention.prefill.attend_selected`` on one layer's q/k/v of
    ``context`` tokens (eviction scores on): the gathered ``nosa.attention.gathered.attend_grouped``
    and the masked ``nosa.attention.masked.attend_masked``, forward + backward when ``training`` (every row), else
    forward only for the rows past ``cfg.dense_len``. The least CPU time of ``repeats``, alternating."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(context, h, d, generator=g) for h in (hq, hkv, hkv))
    cis = torch.rand(context, hkv, generator=g)
    with torch.no_grad():
        sel = nosa_prefill(q, k, v, cis, cfg, d**-0.5)[1]
    first = 0 if training else min(cfg.dense_len, context - 1)
    positions = torch.arange(first, context)
    q, sel = q[first:], sel[first:]
    if training:
        q, k, v, cis = (t.requires_grad_() for t in (q, k, v, cis))
    cpu = {"gathered": [], "masked": []}
    for _ in range(repeats):
        for name, fn in (("gathered", attend_grouped), ("masked", attend_masked)):
            c0 = time.process_time()
            with torch.set_grad_enabled(training):
                out = fn(q, k, v, cis, sel, positions, cfg, d**-0.5)
                if training:
                    out.sum().backward()
            cpu[name].append(time.process_time() - c0)
    mean_keys = (first + context - 1) / 2 + 1
    out = {"context": context, "training": training, "heads": f"{hq}/{hkv}", "nosa_config": cfg.to_dict(),
           "mean_keys_per_budget": round(mean_keys / cfg.budget_tokens, 2)}
    for name, ts in cpu.items():
        out[f"{name}_cpu_s"] = round(min(ts), 4)
    out["gathered_over_masked"] = round(out["gathered_cpu_s"] / out["masked_cpu_s"], 2)
    return out


def run(args) -> None:
    """The timings of ``args`` (as scripts/bench_train.py parses them), printed as they are measured;
    the result written to ``args.out``."""
    if args.threads:
        torch.set_num_threads(args.threads)
    like = getattr(args, "like", None)
    # with --like only the config's NosaConfig, seed, rows and learning rate count: its model (a checkpoint
    # path, absent on a GPU machine) and its data (that checkpoint's chat turns) are not read
    cfg = load_config(args.config, args.overrides, validate=not like)
    device = getattr(args, "device", "cpu")
    torch.manual_seed(cfg.seed)
    if like:
        spec = dict(SHAPES[like])
    else:
        spec = dict(cfg.model.build)
        spec.setdefault("vocab_size", cfg.tokenizer.vocab_size)
    dense = build_causal_lm(seed=cfg.seed, **spec).train()
    sparse = nosa.convert(copy.deepcopy(dense), cfg.nosa).train()
    set_eviction_heads(sparse, scale=args.evict_scale, seed=cfg.seed)
    dense, sparse = dense.to(device), sparse.to(device)
    lengths = getattr(args, "seq_lens", None) or [cfg.seq_len]
    by_length = []
    for seq_len in lengths:
        try:
            by_length.append(step_times(dense, sparse, seq_len, cfg.micro_batch, cfg.optim.lr, args.warmup, args.steps,
                                   device, cfg.seed))
        except Exception as e:  # e.g. out of memory at the longest length: record it and go on
            if device.startswith("cuda"):
                torch.cuda.empty_cache()
            by_length.append({"seq_len": seq_len, "error": repr(e)[:500]})
        print(json.dumps({k: v for k, v in by_length[-1].items() if k != "micro_batch"}), flush=True)
    result = {
        "config": os.path.relpath(args.config, REPO), "overrides": args.overrides,
        "device": torch.cuda.get_device_name() if device.startswith("cuda") else "cpu",
        "cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
        "seq_len": lengths[0], "micro_batch": cfg.micro_batch, "nosa_config": cfg.nosa.to_dict(),
        "model": like or {k: v for k, v in spec.items()},
        "parameters": sum(p.numel() for p in dense.parameters()), "evict_scale": args.evict_scale,
        **{k: v for k, v in by_length[0].items() if k not in ("seq_len", "micro_batch")},
    }
    if len(by_length) > 1:
        result["by_seq_len"] = by_length
    if args.prefill_context and not device.startswith("cuda"):
        result["prefill"] = [prefill_case(args.prefill_context, a) for a in (False, True)]
        for row in result["prefill"]:
            print(json.dumps(row), flush=True)
    if args.crossover:
        heads = (dense.config.num_attention_heads, dense.config.num_key_value_heads)
        d = dense.config.hidden_size // heads[0]
        rows = [crossover_case(cfg.seq_len * m, cfg.nosa, True, *heads, d=d) for m in (1, 2, 4, 8)]
        rows += [crossover_case(c, nosa.NosaConfig(), False, 8, 2, repeats=1) for c in (5120, 6144, 8192, 16384)]
        result["crossover"] = rows
        for row in result["crossover"]:
            print(json.dumps({k: v for k, v in row.items() if k != "nosa_config"}), flush=True)
    write_result(args.out, result)
    print(f"wrote {args.out}")
