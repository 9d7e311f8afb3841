"""Accuracy benchmark on held-out synthetic long-context tasks: dense vs training-free NOSA
selection (dense weights, A = 0: InfLLM-v2 style) vs NOSA fine-tuned, plus selection churn.

    python scripts/bench_accuracy.py --run runs/tiny                  # 2K, 4K, 8K contexts
    python scripts/bench_accuracy.py --run runs/tiny --quick          # 2K only, few examples
    python scripts/bench_accuracy.py --dense D --nosa N --out results/accuracy.json

Reads the checkpoints that ``python -m nosa.train`` leaves in the run directory (``dense`` = end of
the dense phase, ``nosa`` = end of fine-tuning). The NOSA budget is the fine-tuned checkpoint's
NosaConfig (topk_blocks * block_size tokens); the JSON records the budget as a share of the blocks
at every length. Accuracy: all answer tokens of an example right under teacher forcing (what
greedy decoding would produce). Writes JSON (--out) and a markdown table to stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time

for _var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
    os.environ.setdefault(_var, "1")


def heldout_rows(tokenizer, tasks, length: int, count: int, seed: int):
    """Fresh held-out examples at ``length`` tokens (seeds disjoint from training)."""
    from nosa.train import synthetic
    from nosa.train.data import build_rows
    from nosa.train.tokenizer import token_counter

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "heldout.jsonl")
        examples = synthetic.make_split(list(tasks), count, length, seed, token_counter(tokenizer))
        with open(path, "w") as f:
            for ex in examples:
                f.write(json.dumps(ex) + "\n")
        return build_rows([path], tokenizer, length)


def variants(dense_path: str, nosa_path: str):
    """(name, loader) for the three models; each loader returns a fresh model in eval mode."""
    from transformers import AutoModelForCausalLM

    import nosa
    from nosa.hf import nosa_config_of

    def dense():
        return AutoModelForCausalLM.from_pretrained(dense_path, attn_implementation="sdpa").eval()

    def training_free():
        from transformers import AutoConfig

        cfg = nosa_config_of(AutoConfig.from_pretrained(nosa_path))
        return nosa.convert(dense(), cfg).eval()  # A = 0: query-aware selection only

    def fine_tuned():
        return nosa.from_pretrained(nosa_path).eval()

    return [("dense", dense), ("training_free", training_free), ("nosa_finetuned", fine_tuned)]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", default="runs/tiny", help="run dir holding the dense/ and nosa/ links")
    parser.add_argument("--dense", help="dense checkpoint (default <run>/dense)")
    parser.add_argument("--nosa", help="NOSA checkpoint (default <run>/nosa)")
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8192])
    parser.add_argument("--examples", type=int, default=16, help="held-out examples per length")
    parser.add_argument("--tasks", nargs="+", default=None)
    parser.add_argument("--seed", type=int, default=777_000)
    parser.add_argument("--quick", action="store_true", help="2K only, 8 examples")
    parser.add_argument("--out", default="results/accuracy.json")
    parser.add_argument("--plot", metavar="PNG", help="also draw accuracy and churn per context length")
    args = parser.parse_args(argv)
    if args.quick:
        args.lengths, args.examples = [min(args.lengths)], min(args.examples, 8)
    dense_path = args.dense or os.path.join(args.run, "dense")
    nosa_path = args.nosa or os.path.join(args.run, "nosa")
    for path in (dense_path, nosa_path):
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise SystemExit(
                f"bench_accuracy: no checkpoint at {path!r}; run "
                "`python -m nosa.train --config configs/train/tiny.yaml` first"
            )

    import torch
    from transformers import AutoConfig

    from nosa.hf import nosa_config_of
    from nosa.train import synthetic
    from nosa.train.metrics import evaluate, selection_stats
    from nosa.train.tokenizer import load_tokenizer

    torch.manual_seed(0)
    cfg = nosa_config_of(AutoConfig.from_pretrained(nosa_path))
    if cfg is None:
        raise SystemExit(f"bench_accuracy: {nosa_path} is not a NOSA checkpoint")
    tokenizer = load_tokenizer(nosa_path)
    tasks = args.tasks or list(synthetic.TASKS)
    results = []
    for name, load in variants(dense_path, nosa_path):
        model = load()
        for length in args.lengths:
            if length % cfg.block_size:
                raise SystemExit(f"--lengths: {length} is not a multiple of block_size {cfg.block_size}")
            rows = heldout_rows(tokenizer, tasks, length, args.examples, args.seed + length)
            t0 = time.perf_counter()
            scores = evaluate(model, rows, len(rows))
            entry = {
                "variant": name,
                "length": length,
                "examples": len(rows),
                "acc": scores.get("eval/acc"),
                "loss": scores["eval/loss"],
                "acc_by_task": {k.split("/")[-1]: v for k, v in scores.items() if k.startswith("eval/acc/")},
                "budget_share": cfg.topk_blocks / cfg.num_blocks(length),
                "seconds": round(time.perf_counter() - t0, 1),
            }
            if name != "dense":
                stats = selection_stats(model, rows[0]["input_ids"], cfg)
                entry.update(
                    churn_mean=stats.get("select/churn_mean"),
                    churn_max=stats.get("select/churn_max"),
                    mass_in_selection=stats.get("select/mass"),
                )
            results.append(entry)
            print(
                f"{name:15s} L={length:5d} acc={entry['acc']:.3f} loss={entry['loss']:.3f} ({entry['seconds']}s)",
                file=sys.stderr,
                flush=True,
            )
        del model
    report = {
        "nosa_config": cfg.to_dict(),
        "dense": dense_path,
        "nosa": nosa_path,
        "tasks": tasks,
        "accuracy": "all answer tokens right under teacher forcing (= greedy decoding)",
        "loss": "mean cross-entropy over the answer tokens",
        "results": results,
        "env": {
            "torch": torch.__version__,
            "python": platform.python_version(),
            "machine": platform.machine(),
            "cpus": os.cpu_count(),
            "quick": args.quick,
        },
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    tmp = args.out + ".tmp"
    with open(tmp, "w") as f:
        json.dump(report, f, indent=1)
    os.replace(tmp, args.out)
    print(table(results))
    print(f"\nwrote {args.out}")
    if args.plot:
        plot(results, args.plot)
        print(f"wrote {args.plot}")
    return 0


def table(results) -> str:
    """Markdown: one row per context length: accuracy and answer-token loss per variant, churn and
    dense attention mass inside the selection for the NOSA variants."""
    lengths = sorted({r["length"] for r in results})
    get = {(r["variant"], r["length"]): r for r in results}
    lines = [
        "| context | budget | accuracy: dense / A=0 / NOSA | answer loss: dense / A=0 / NOSA "
        "| churn per step, mean/max: A=0 / NOSA | dense mass in selection: A=0 / NOSA |",
        "|---|---|---|---|---|---|",
    ]
    for length in lengths:
        d, f, n = (get.get((v, length), {}) for v in ("dense", "training_free", "nosa_finetuned"))
        share = (n or f).get("budget_share", float("nan"))
        lines.append(
            f"| {length} | {share:.0%} of blocks | {_pct(d)} / {_pct(f)} / {_pct(n)} "
            f"| {_num(d, 'loss')} / {_num(f, 'loss')} / {_num(n, 'loss')} | {_churn(f)} / {_churn(n)} "
            f"| {_num(f, 'mass_in_selection')} / {_num(n, 'mass_in_selection')} |"
        )
    return "\n".join(lines)


def _num(r, key) -> str:
    return "-" if not r or r.get(key) is None else f"{r[key]:.3f}"


def plot(results, out: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lengths = sorted({r["length"] for r in results})
    names = [("dense", "dense"), ("training_free", "training-free (A=0)"), ("nosa_finetuned", "NOSA fine-tuned")]
    fig, (acc_ax, churn_ax) = plt.subplots(1, 2, figsize=(10, 3.5))
    width = 0.8 / len(names)
    for i, (key, label) in enumerate(names):
        rows = {r["length"]: r for r in results if r["variant"] == key}
        xs = [j + i * width for j in range(len(lengths))]
        acc_ax.bar(xs, [100 * (rows.get(n, {}).get("acc") or 0) for n in lengths], width, label=label)
        if key != "dense":
            churn_ax.bar(xs, [rows.get(n, {}).get("churn_mean") or 0 for n in lengths], width, label=label)
    for ax, title in ((acc_ax, "held-out accuracy (%)"), (churn_ax, "blocks entering per decode step (mean)")):
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(lengths))], [str(n) for n in lengths])
        ax.set_xlabel("context (tokens)")
        ax.set_title(title)
        ax.legend(fontsize=7)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    fig.savefig(out, dpi=100)


def _pct(r) -> str:
    return "-" if not r or r.get("acc") is None else f"{100 * r['acc']:.1f}%"


def _churn(r) -> str:
    if not r or r.get("churn_mean") is None:
        return "-"
    return f"{r['churn_mean']:.2f}/{r['churn_max']:.0f}"


if __name__ == "__main__":
    sys.exit(main())
