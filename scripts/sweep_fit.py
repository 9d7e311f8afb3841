"""Compare settings of the eviction-head fit on the real model without a long-context suite run per
setting: the fit's inputs are captured once, every layer's heads are refitted per setting, and each
setting is scored by answer-block coverage on suite-style examples.

    python scripts/sweep_fit.py --settings rank=0 rank=1,tau=0.02 rank=3,tau=0.05 rank=0,rows=12

Answer-block coverage: the last prompt row is the row that predicts the answer (RULER's answer prefix
ends the prompt). Over every layer and KV head, the dense attention that this row pays to the block
holding the answer's first token, and the share of it that falls inside that head's selection at the
suite's NosaConfig (``budget_config``). 1.0: every head that reads the answer can still read it. The
examples come from another seed than the suite's (default ``--seed 1``, the suite's default is 0), so
a setting chosen here is not fitted to the examples the suite scores.

A setting is ``key=value`` pairs joined by commas: ``rank`` (the window ranking term's weight, the
config's ``distill_rank``; 0: off), ``tau`` (``distill_rank_tau``), ``steps`` (``distill_steps``),
``rows`` (the first N of the captured rows). Unset keys come from ``--config``. Each setting refits
from the same initial weights. Writes JSON (``--out``) and prints a markdown table.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import sys
import time

for _var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
    os.environ.setdefault(_var, "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _suite_config import budget_config  # noqa: E402

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


def answer_block(tokenizer, ex, block_size: int) -> int | None:
    """The block of the first context token of the example's first reference (None if not found)."""
    ids = list(ex.prompt_ids[: ex.context_end])
    for text in (" " + ex.references[0], ex.references[0]):
        sub = tokenizer(text, add_special_tokens=False)["input_ids"]
        for i in range(len(ids) - len(sub) + 1):
            if ids[i : i + len(sub)] == sub:
                return i // block_size
    return None


def write_report(report: dict, out: str) -> None:
    """``report`` with the environment added, written to ``out`` as JSON (whole or not at all)."""
    import torch

    report["env"] = {"torch": torch.__version__, "python": platform.python_version(),
                     "threads": torch.get_num_threads()}
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out + ".tmp", "w") as f:
        json.dump(report, f, indent=1)
    os.replace(out + ".tmp", out)


def capture_examples(model, fit_cfg, examples, tokenizer, block_size: int) -> list[dict]:
    """Per example: the answer block, and per layer the last prompt row's q, the keys and values,
    and the dense attention probabilities of that row (the model runs densely)."""
    import torch

    import nosa
    from nosa.hf import capture_attention_inputs
    from nosa.train.metrics import dense_probs

    out = []
    nosa.convert(model, dataclasses.replace(fit_cfg, dense_len=max(len(ex.prompt_ids) for ex in examples)))
    for ex in examples:
        block = answer_block(tokenizer, ex, block_size)
        if block is None:
            print(f"sweep_fit: {ex.task} example {ex.index} at {ex.length}: answer not found in the context; skipped")
            continue
        ids = torch.tensor(ex.prompt_ids)
        with torch.no_grad(), capture_attention_inputs(model) as captured:
            model(input_ids=ids[None], logits_to_keep=1)
        layers = {}
        for name, (q, k, v) in captured.items():
            probs = dense_probs(q[-1:], k, torch.tensor([len(ids) - 1]), model.get_submodule(name).scaling)[0]
            layers[name] = (q[-1:], k, v, probs)  # probs [Hq, L]
        out.append({"task": ex.task, "length": ex.length, "index": ex.index, "block": block, "layers": layers})
    nosa.convert(model, fit_cfg)
    return out


def coverage(model, example: dict, share: int) -> float:
    """Share of the answer block's dense attention (last prompt row, all layers and KV heads) that
    falls inside the selection of the model's eviction heads at the suite's config."""
    import torch

    from nosa import nosa_prefill
    from nosa.eviction import MODULE_NAME

    cfg = budget_config(example["length"], share)
    b, size = example["block"], cfg.block_size
    total = inside = 0.0
    for name, (q, k, v, probs) in example["layers"].items():
        attn = model.get_submodule(name)
        with torch.no_grad():
            _, sel = nosa_prefill(q, k, v, getattr(attn, MODULE_NAME)(v), cfg, attn.scaling)  # [1, Hkv, K]
        hkv = sel.shape[1]
        mass = probs[:, b * size : (b + 1) * size].sum(-1).reshape(hkv, -1).sum(-1)  # [Hkv]
        chosen = (sel[0] == b).any(-1)
        total += float(mass.sum())
        inside += float(mass[chosen].sum())
    return inside / total if total > 0 else float("nan")


def main(argv=None) -> int:
    parts = __doc__.split("\n\n")
    parser = argparse.ArgumentParser(description=parts[0], epilog="\n\n".join(parts[1:]),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/train/smollm2.yaml",
                        help="training config: the fit's NosaConfig, rows, steps, lr, scale and defaults")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                        help="config overrides, as for python -m nosa.train (e.g. distill_rows=12)")
    parser.add_argument("--settings", type=parse_setting, nargs="+", default=[{}], metavar="SETTING")
    parser.add_argument("--rows", type=int, help="rows to capture (default: the config's distill_rows)")
    parser.add_argument("--tasks", nargs="+", default=["qa", "niah_multikey", "niah_single"])
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096])
    parser.add_argument("--examples", type=int, nargs="+", default=[6, 3], help="per task at each length")
    parser.add_argument("--share", type=int, default=4, help="budget: 1/SHARE of the blocks")
    parser.add_argument("--seed", type=int, default=1, help="the examples' seed (the suite uses 0)")
    parser.add_argument("--out", default="results/fit_sweep.json")
    args = parser.parse_args(argv)
    if len(args.examples) not in (1, len(args.lengths)):
        parser.error(f"--examples needs one number or one per length ({len(args.lengths)})")
    counts = args.examples * len(args.lengths) if len(args.examples) == 1 else args.examples

    from transformers import AutoTokenizer

    import nosa
    from nosa.eviction import MODULE_NAME
    from nosa.train import prose, ruler
    from nosa.train.config import load_config
    from nosa.train.data import build_rows, prepare_ruler
    from nosa.train.distill import capture_fit_inputs, fit_heads
    from nosa.train.model import load_model

    cfg = load_config(args.config, args.overrides)
    if cfg.data.ruler is None or not cfg.model.path:
        raise SystemExit(f"sweep_fit: {args.config} has no data.ruler rows or no model.path")
    if not os.path.isfile(os.path.join(cfg.model.path, "config.json")):
        raise SystemExit(f"sweep_fit: no checkpoint at {cfg.model.path!r}; write it with "
                         "`python -m nosa.models smollm2 --out models/smollm2-135m`")
    train_file = os.path.join(prepare_ruler(cfg.data.ruler, cfg.seq_len, cfg.model.path, 0), "train.jsonl")
    n_rows = args.rows or cfg.distill_rows
    fit_cfg = cfg.nosa_config
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
        s = {"rank": cfg.distill_rank, "tau": cfg.distill_rank_tau, "steps": cfg.distill_steps, "rows": n_rows,
             **setting}
        t1 = time.perf_counter()
        model.load_state_dict(initial, strict=False)
        subset = {name: items[: s["rows"]] for name, items in data.items()}
        first, last = fit_heads(model, subset, fit_cfg, s["steps"], cfg.distill_lr, cfg.distill_scale, s["rank"],
                                s["tau"])
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


if __name__ == "__main__":
    sys.exit(main())
