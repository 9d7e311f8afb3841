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


def make_step(model, batch: dict, lr: float):
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)

    def step() -> tuple[float, float]:
        t0, c0 = time.perf_counter(), time.process_time()
        loss = model(**batch, use_cache=False).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return time.perf_counter() - t0, time.process_time() - c0

    return step


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
    cfg = load_config(args.config, args.overrides)
    torch.manual_seed(cfg.seed)
    spec = dict(cfg.model.build)
    spec.setdefault("vocab_size", cfg.tokenizer.vocab_size)
    dense = build_causal_lm(seed=cfg.seed, **spec).train()
    sparse = nosa.convert(copy.deepcopy(dense), cfg.nosa).train()
    set_eviction_heads(sparse, scale=args.evict_scale, seed=cfg.seed)
    g = torch.Generator().manual_seed(cfg.seed)
    ids = torch.randint(3, dense.config.vocab_size, (cfg.micro_batch, cfg.seq_len), generator=g)
    batch = {"input_ids": ids, "labels": ids}
    steps = {"dense": make_step(dense, batch, cfg.optim.lr), "nosa": make_step(sparse, batch, cfg.optim.lr)}
    times = {name: [] for name in steps}
    cpu = {name: [] for name in steps}
    for i in range(args.warmup + args.steps):
        for name, step in steps.items():
            dt, dc = step()
            if i >= args.warmup:
                times[name].append(dt)
                cpu[name].append(dc)
    result = {
        "config": os.path.relpath(args.config, REPO), "overrides": args.overrides,
        "device": "cpu", "cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
        "seq_len": cfg.seq_len, "micro_batch": cfg.micro_batch, "nosa_config": cfg.nosa.to_dict(),
        "model": {k: v for k, v in spec.items()}, "evict_scale": args.evict_scale,
        "step_s": {name: {"median": round(statistics.median(ts), 3), "min": round(min(ts), 3),
                          "all": [round(t, 3) for t in ts]} for name, ts in times.items()},
        # CPU seconds of this process per step (the least of the timed steps): less sensitive to
        # other load on a shared machine than wall time
        "step_cpu_s": {name: round(min(ts), 3) for name, ts in cpu.items()},
    }
    result["ratio_nosa_over_dense"] = round(result["step_s"]["nosa"]["median"] / result["step_s"]["dense"]["median"], 2)
    result["cpu_ratio_nosa_over_dense"] = round(result["step_cpu_s"]["nosa"] / result["step_cpu_s"]["dense"], 2)
    print(json.dumps({k: result[k] for k in ("step_s", "ratio_nosa_over_dense", "step_cpu_s",
                                              "cpu_ratio_nosa_over_dense")}), flush=True)
    if args.prefill_context:
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
