"""The accuracy benchmark on held-out synthetic retrieval (scripts/bench_accuracy.py): fresh examples
drawn like a run's data, dense vs A = 0 vs NOSA fine-tuned measured on them (accuracy under teacher
forcing, answer loss, and what the selection does over the decode steps), over one or more training
seeds; its table and plot."""

from __future__ import annotations

import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from transformers import AutoConfig, AutoModelForCausalLM

import nosa
from nosa.attention.prefill import nosa_prefill
from nosa.bench.results import write_result
from nosa.eviction import MODULE_NAME
from nosa.hf import capture_attention_inputs, nosa_config_of
from nosa.select import blocks_entering
from nosa.train import synthetic
from nosa.train.checkpoint import read_run_config
from nosa.train.metrics import selection_mass
from nosa.train.tokenizer import load_tokenizer, token_counter

VARIANTS = ("dense", "training_free", "nosa_finetuned")
LABELS = {"dense": "dense", "training_free": "A = 0 (training-free)", "nosa_finetuned": "NOSA fine-tuned"}
SPARSE_KEYS = ("entering_mean", "entering_max", "hit_rate", "mass")


def run_config(nosa_path: str) -> dict:
    """The training config saved with the fine-tuned checkpoint (its data, tasks and placement)."""
    try:
        return read_run_config(nosa_path)
    except ValueError as err:
        raise SystemExit(f"bench_accuracy: {err}") from None


def heldout(tokenizer, train_cfg: dict, cfg, length: int, count: int, seed: int) -> list[dict]:
    """Fresh examples at ``length`` tokens: input_ids [L], answer token positions, question start."""
    syn = train_cfg["data"]["synthetic"] or {}
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []  # as training and SGLang
    examples = synthetic.make_split(
        list(syn.get("tasks") or synthetic.TASKS), count, length - len(bos), seed, token_counter(tokenizer),
        split="bench",
        head=cfg.sink_blocks * cfg.block_size, tail=cfg.window_blocks * cfg.block_size,
        depth=tuple(syn.get("depth", (0.0, 1.0))),
    )
    out = []
    for ex in examples:
        enc = tokenizer(ex["text"], add_special_tokens=False, return_offsets_mapping=True)
        answers = [len(bos) + i for i, (s, e) in enumerate(enc["offset_mapping"])
                   if any(a <= s and e <= b for a, b in ex["targets"])]
        out.append({"task": ex["task"], "ids": torch.tensor(bos + enc["input_ids"]), "answers": answers,
                    "question": len(bos) + ex["question"]})
    return out


def loaders(dense_path: str, nosa_path: str, cfg):
    """variant -> a function returning a fresh model in eval mode."""
    def dense():
        return AutoModelForCausalLM.from_pretrained(dense_path, attn_implementation="sdpa").eval()

    return {
        "dense": dense,
        "training_free": lambda: nosa.convert(dense(), cfg).eval(),  # A = 0: query-aware only
        "nosa_finetuned": lambda: nosa.from_pretrained(nosa_path).eval(),
    }


def measure(model, examples, cfg, sparse: bool) -> dict:
    """Accuracy, answer loss and (sparse) selection statistics of ``model`` over ``examples``."""
    right, losses, by_task, tokens = [], [], {}, []
    entering, selected, step_max, mass = 0, 0, 0, []
    for ex in examples:
        ids, answers = ex["ids"], torch.tensor(ex["answers"])
        with torch.no_grad():
            if sparse:
                with capture_attention_inputs(model) as captured:
                    logits = model(input_ids=ids[None]).logits[0]
            else:
                logits = model(input_ids=ids[None]).logits[0]
        hits = logits[answers - 1].argmax(-1) == ids[answers]
        ok = bool(hits.all())
        right.append(ok)
        tokens += hits.tolist()
        by_task.setdefault(ex["task"], []).append(ok)
        losses.append(float(F.cross_entropy(logits[answers - 1].float(), ids[answers])))
        if not sparse:
            continue
        first = ex["question"] - 1  # the last context row, then one row per decode step
        for name, (q, k, v) in captured.items():
            attn = model.get_submodule(name)
            with torch.no_grad():
                cis = getattr(attn, MODULE_NAME)(v)
                _, sel = nosa_prefill(q[first:], k, v, cis, cfg, attn.scaling)  # [n, Hkv, K]
            enter = blocks_entering(sel[:-1], sel[1:])  # [n - 1, Hkv]
            entering += int(enter.sum())
            selected += int((sel[1:] >= 0).sum())
            step_max = max(step_max, int(enter.max()))
            rows = torch.arange(first + 1, first + sel.shape[0])
            mass.append(selection_mass(q[first + 1 :], k, sel[1:], rows, cfg, attn.scaling))
    out = {
        "acc": sum(tokens) / len(tokens),
        "acc_example": sum(right) / len(right),
        "loss": sum(losses) / len(losses),
        "acc_by_task": {t: sum(v) / len(v) for t, v in sorted(by_task.items())},
    }
    if sparse:
        steps = selected / cfg.topk_blocks  # (row, layer, KV head) decode steps with a full budget
        out.update(
            entering_mean=entering / max(1.0, steps),
            entering_max=step_max,
            hit_rate=1 - entering / max(1, selected),
            mass=sum(mass) / len(mass),
        )
    return out


def summarize(per_seed: list[dict]) -> dict:
    """mean, min, max over training seeds of every number in the per-seed results."""
    out = {}
    for key, value in per_seed[0].items():
        if isinstance(value, (int, float)):
            values = [r[key] for r in per_seed]
            out[key] = {"mean": statistics.fmean(values), "min": min(values), "max": max(values), "seeds": values}
    return out


def run(args) -> int:
    """The benchmark of ``args`` (as scripts/bench_accuracy.py parses them): progress on stderr, the
    report written to ``args.out``, its table printed, ``args.plot`` drawn; returns 0."""
    torch.manual_seed(0)
    runs = []
    for run in args.run:
        dense_path, nosa_path = os.path.join(run, "dense"), os.path.join(run, "nosa")
        for path in (dense_path, nosa_path):
            if not os.path.isfile(os.path.join(path, "config.json")):
                raise SystemExit(
                    f"bench_accuracy: no checkpoint at {path!r}; run "
                    "`python -m nosa.train --config configs/train/tiny.yaml` first"
                )
        cfg = nosa_config_of(AutoConfig.from_pretrained(nosa_path))
        if cfg is None:
            raise SystemExit(f"bench_accuracy: {nosa_path} is not a NOSA checkpoint")
        runs.append((run, dense_path, nosa_path, cfg, run_config(nosa_path)))
    cfg, train_cfg = runs[0][3], runs[0][4]
    for run, *_, other_cfg, other_train in runs[1:]:
        if other_cfg != cfg or other_train["seq_len"] != train_cfg["seq_len"]:
            raise SystemExit(f"bench_accuracy: {run} has another NosaConfig or seq_len than {runs[0][0]}")
    train_len = train_cfg["seq_len"]
    lengths = args.lengths or [train_len, 2 * train_len, 4 * train_len]
    examples = args.examples
    if args.quick:
        lengths, examples = [min(lengths)], min(examples, 8)
    for length in lengths:
        if length % cfg.block_size:
            raise SystemExit(f"bench_accuracy: --lengths {length} is not a multiple of block_size {cfg.block_size}")

    per_seed: dict[tuple[str, int], list[dict]] = {}
    for run, dense_path, nosa_path, run_cfg, _ in runs:
        tokenizer = load_tokenizer(nosa_path)
        data = {n: heldout(tokenizer, train_cfg, cfg, n, examples, args.seed + n) for n in lengths}
        for variant, load in loaders(dense_path, nosa_path, cfg).items():
            model = load()
            for n in lengths:
                t0 = time.perf_counter()
                result = measure(model, data[n], cfg, sparse=variant != "dense")
                result["seconds"] = round(time.perf_counter() - t0, 1)
                per_seed.setdefault((variant, n), []).append(dict(result, run=run))
                print(f"{run} {variant:15s} L={n:5d} acc={result['acc']:.3f} loss={result['loss']:.3f} "
                      + " ".join(f"{k}={result[k]:.3f}" for k in SPARSE_KEYS if k in result)
                      + f" ({result['seconds']}s)", file=sys.stderr, flush=True)
            del model
    results = [
        {"variant": v, "length": n, "budget_share": cfg.topk_blocks / cfg.num_blocks(n), **summarize(rs),
         "per_seed": rs}
        for (v, n), rs in per_seed.items()
    ]
    report = {
        "nosa_config": cfg.to_dict(),
        "runs": [r[0] for r in runs],
        "train_seq_len": train_len,
        "tasks": (train_cfg["data"]["synthetic"] or {}).get("tasks"),
        "examples_per_length": examples,
        "decode_steps": "every token of the question and its answers, per layer and KV head",
        "spread": "mean and [min, max] over the runs (training seeds)",
        "results": results,
        "quick": args.quick,
    }
    write_result(args.out, report)
    print(table(results))
    print(f"\nwrote {args.out}")
    if args.plot:
        plot(results, args.plot, len(runs))
        print(f"wrote {args.plot}")
    return 0


def _cell(r, key, fmt="{:.1%}") -> str:
    if not r or key not in r:
        return "-"
    s = r[key]
    if s["min"] == s["max"]:
        return fmt.format(s["mean"])
    return f"{fmt.format(s['mean'])} [{fmt.format(s['min'])}, {fmt.format(s['max'])}]"


def table(results) -> str:
    """Markdown: one row per context length (mean [min, max] over seeds)."""
    get = {(r["variant"], r["length"]): r for r in results}
    lines = [
        "| context | budget | accuracy: dense | A = 0 | NOSA | blocks entering per step, mean (max): A = 0 | NOSA "
        "| hit rate, cache = budget: A = 0 | NOSA | dense mass in selection: A = 0 | NOSA |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for n in sorted({r["length"] for r in results}):
        d, f, s = (get.get((v, n)) for v in VARIANTS)
        share = (s or f or d)["budget_share"]
        cells = [_cell(d, "acc"), _cell(f, "acc"), _cell(s, "acc")]
        for r in (f, s):
            cells.append("-" if not r else f"{_cell(r, 'entering_mean', '{:.2f}')} ({r['entering_max']['max']:.0f})")
        cells += [_cell(f, "hit_rate"), _cell(s, "hit_rate"), _cell(f, "mass", "{:.3f}"), _cell(s, "mass", "{:.3f}")]
        lines.append(f"| {n} | {share:.0%} of blocks | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(results, out: str, seeds: int) -> None:
    import matplotlib  # optional: matplotlib (the train extra)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # optional: matplotlib

    lengths = sorted({r["length"] for r in results})
    get = {(r["variant"], r["length"]): r for r in results}
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    panels = [
        (axes[0], "acc", VARIANTS, 100, "held-out exact-answer accuracy (%)"),
        (axes[1], "entering_mean", VARIANTS[1:], 1, "blocks entering per decode step (recalls)"),
        (axes[2], "hit_rate", VARIANTS[1:], 100, "hit rate, device cache = budget (%)"),
    ]
    for ax, key, variants, scale, title in panels:
        width = 0.8 / len(variants)
        for i, v in enumerate(variants):
            rows = [get.get((v, n), {}).get(key) for n in lengths]
            mean = [scale * r["mean"] if r else 0 for r in rows]
            err = [[scale * (r["mean"] - r["min"]) if r else 0 for r in rows],
                   [scale * (r["max"] - r["mean"]) if r else 0 for r in rows]]
            ax.bar([j + i * width for j in range(len(lengths))], mean, width, yerr=err, capsize=3, label=LABELS[v])
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(lengths))], [str(n) for n in lengths])
        ax.set_xlabel("context (tokens)")
        ax.set_title(title, fontsize=9)
        ax.legend(fontsize=7)
    fig.suptitle(f"tiny model, {seeds} training seed(s): bars = mean, whiskers = min..max", fontsize=9)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    fig.savefig(out, dpi=100)
