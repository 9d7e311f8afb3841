"""The fit sweep (scripts/sweep_fit.py): the fit's inputs captured once, every layer's eviction heads
refitted per setting from the same initial weights, each setting scored by answer-block coverage."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time

from transformers import AutoTokenizer

import nosa
from nosa.bench.longctx.coverage import capture_examples, coverage, write_report
from nosa.eviction import MODULE_NAME
from nosa.train import prose, ruler
from nosa.train.config import load_config
from nosa.train.data import build_rows, prepare_ruler
from nosa.train.distill import capture_fit_inputs, fit_heads
from nosa.train.model import load_model

KEYS = {"rank": float, "tau": float, "steps": int, "rows": int}


def parse_setting(text: str) -> dict:
    """``rank=1,tau=0.02`` -> {"rank": 1.0, "tau": 0.02}; a clear error for anything else."""
    out = {}
    for part in text.split(","):
        key, eq, value = part.partition("=")
        if not eq or key not in KEYS:
            raise argparse.ArgumentTypeError(f"{text!r}: expected key=value pairs joined by commas, keys {list(KEYS)}")
        try:
            out[key] = KEYS[key](value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r}: {key}={value!r} is not a {KEYS[key].__name__}") from None
    return out


def run(args, counts: list[int]) -> int:
    """The sweep of ``args.settings`` (as scripts/sweep_fit.py parses them) over ``counts[i]``
    examples per task at ``args.lengths[i]``: one JSON row printed per setting, the report written
    to ``args.out``, a markdown table printed; returns 0."""
    cfg = load_config(args.config, args.overrides)
    if cfg.data.ruler is None or not cfg.model.path:
        raise SystemExit(f"sweep_fit: {args.config} has no data.ruler rows or no model.path")
    if not os.path.isfile(os.path.join(cfg.model.path, "config.json")):
        raise SystemExit(f"sweep_fit: no checkpoint at {cfg.model.path!r}; write it with "
                         "`python -m nosa.models smollm2 --out models/smollm2-135m`")
    train_file = os.path.join(prepare_ruler(cfg.data.ruler, cfg.seq_len, cfg.model.path, 0), "train.jsonl")
    n_rows = args.rows or cfg.distill.rows
    fit_cfg = cfg.nosa
    t0 = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
    model = load_model(cfg.model.path).eval()
    nosa.convert(model, fit_cfg)
    initial = {k: v.clone() for k, v in model.state_dict().items() if f".{MODULE_NAME}." in k}
    rows = build_rows([train_file], tokenizer, cfg.seq_len, cfg.data.text_field, targets_only=True)
    rows = rows.select(range(min(n_rows, len(rows))))
    data = capture_fit_inputs(model, rows, fit_cfg, cfg.data.answer_weight, progress=True)
    _, heldout = prose.split(prose.documents(prose.FIXED_SOURCES))
    haystack = ruler.Haystack(tokenizer, [d.text for d in heldout])
    examples = [ex for length, n in zip(args.lengths, counts) for task in args.tasks
                for ex in ruler.make_examples(tokenizer, haystack, task, length, n, args.seed)]
    captured = capture_examples(model, fit_cfg, examples, tokenizer, fit_cfg.block_size)
    capture_seconds = time.perf_counter() - t0

    results = []
    for setting in args.settings:
        s = {"rank": cfg.distill.rank_weight, "tau": cfg.distill.rank_tau, "steps": cfg.distill.steps, "rows": n_rows,
             **setting}
        t1 = time.perf_counter()
        model.load_state_dict(initial, strict=False)
        subset = {name: items[: s["rows"]] for name, items in data.items()}
        fit = dataclasses.replace(cfg.distill, steps=s["steps"], rank_weight=s["rank"], rank_tau=s["tau"])
        first, last = fit_heads(model, subset, fit_cfg, fit)
        by = {}
        for ex in captured:
            by.setdefault(f"{ex['task']}@{ex['length']}", []).append(coverage(model, ex, args.share))
        row = {"setting": ",".join(f"{k}={v}" for k, v in s.items()), **s, "token_loss": [first, last],
               "coverage": {k: sum(v) / len(v) for k, v in by.items()},
               "mean": sum(x for v in by.values() for x in v) / sum(len(v) for v in by.values()),
               "seconds": round(time.perf_counter() - t1, 1)}
        results.append(row)
        print(json.dumps(row), flush=True)

    report = {"config": args.config, "model": cfg.model.path, "fit_config": fit_cfg.to_dict(),
              "captured_rows": len(rows), "share": args.share, "seed": args.seed, "tasks": args.tasks,
              "examples_per_task": dict(zip(map(str, args.lengths), counts)),
              "examples": [{k: ex[k] for k in ("task", "length", "index", "block")} for ex in captured],
              "metric": "answer-block coverage (module docstring)", "results": results,
              "capture_seconds": round(capture_seconds, 1)}
    write_report(report, args.out)
    keys = list(results[0]["coverage"]) if results else []
    print("\n| setting | " + " | ".join(keys) + " | mean |\n|---|" + "---|" * (len(keys) + 1))
    for r in results:
        print(f"| {r['setting']} | " + " | ".join(f"{r['coverage'][k]:.3f}" for k in keys) + f" | {r['mean']:.3f} |")
    print(f"\nwrote {args.out} ({(time.perf_counter() - t0) / 60:.1f} min)")
    return 0
