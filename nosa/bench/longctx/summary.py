"""The long-context suite's report (scripts/bench_longctx.py): per-variant summaries, the issue's
targets, markdown tables, the plot, and the report written (reports joined: nosa.bench.longctx.merge)."""

from __future__ import annotations

import math
import os

from nosa import models
from nosa.bench.longctx.config import WINDOWS, WINDOWS_TAG, windows_name
from nosa.bench.results import write_result
from nosa.config import NosaConfig


def wilson(right: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """Wilson score interval (95% by default) of a share of right answers."""
    if n == 0:
        return 0.0, 1.0
    p = right / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def share(right: int, n: int) -> dict:
    lo, hi = wilson(right, n)
    return {"right": right, "n": n, "acc": right / n if n else 0.0, "lo": lo, "hi": hi}


def paired(records: list[dict], variant: str, reference: str, z: float = 1.96) -> dict:
    """Two variants on the same examples: the mean score difference (variant - reference, in points
    of a 0-100 score) with a normal 95% interval over the examples' differences, and every example
    where they differ."""
    both = [r for r in records if variant in r["right"] and reference in r["right"]]
    diffs = [float(r["right"][variant]) - float(r["right"][reference]) for r in both]
    n = len(diffs)
    mean = sum(diffs) / n if n else 0.0
    sd = math.sqrt(sum((d - mean) ** 2 for d in diffs) / (n - 1)) if n > 1 else 0.0
    half = z * sd / math.sqrt(n) if n else 0.0
    return {"variant": variant, "vs": reference, "n": n, "points": 100 * mean,
            "lo": 100 * (mean - half), "hi": 100 * (mean + half),
            "better": sum(d > 0 for d in diffs), "worse": sum(d < 0 for d in diffs),
            "differ": [{"task": r["task"], "index": r["index"], variant: r["right"][variant],
                        reference: r["right"][reference]} for r, d in zip(both, diffs) if d]}


def compare(report: dict) -> list[dict]:
    """The report's paired comparisons, per length: each sparse variant with dense and with every
    other dense-attention checkpoint (--dense-ckpt, e.g. dense-FT), each NOSA checkpoint with A = 0
    at its budget, and each other dense-attention checkpoint with dense."""
    out = []
    for length in report["lengths"]:
        rows = [r for r in report["results"] if r["length"] == length]
        records = [r for r in report["examples"] if r["length"] == length]
        names = {r["variant"] for r in rows}
        # dense-attention checkpoints other than dense (share None; reports merged by the tests carry no share)
        dense_ckpts = [r["variant"] for r in rows if "share" in r and r["share"] is None and r["variant"] != "dense"]
        for r in rows:
            if r.get("share") is None:
                references = ["dense"] if r["variant"] in dense_ckpts else []
            else:  # A = 0 at the budget, and A = 0 of the variant's own --windows where that is another
                a0s = dict.fromkeys([f"A = 0, 1/{r['share']}", a0_name(r["variant"], r["share"], names)])
                references = ["dense", *dense_ckpts] + [a0 for a0 in a0s if r["variant"] != a0 and a0 in names]
            for reference in references:
                out.append(dict(paired(records, r["variant"], reference), length=length))
    return out


def result_row(name: str, length: int, budget_share: int | None, nosa_config: dict | None, tasks, records: list[dict],
               seconds: float) -> dict:
    """One variant's result at one length from its examples (``records`` of that length): the score per
    task and over all, and for a sparse variant (``nosa_config`` given) its budget and what its
    selection recalled (blocks entering per step, the hit rate of a cache of the budget, the dense
    attention mass inside the selection)."""
    done = [r for r in records if name in r["right"]]
    by_task = {t: share(sum(r["right"][name] for r in done if r["task"] == t),
                        sum(1 for r in done if r["task"] == t)) for t in tasks}
    row = {"variant": name, "length": length, "share": budget_share, "tasks": by_task,
           "all": share(sum(r["right"][name] for r in done), len(done)),
           "task_mean": sum(t["acc"] for t in by_task.values()) / len(by_task), "seconds": round(seconds, 1)}
    if nosa_config is not None:
        cfg = NosaConfig.from_dict(nosa_config)
        sel = [r["select"][name] for r in done if name in r["select"]]
        total = {k: sum(s[k] for s in sel) for k in ("entering", "transitions", "selected", "mass", "layers")}
        row.update(
            nosa_config=nosa_config, budget_blocks=cfg.topk_blocks, context_blocks=cfg.num_blocks(length),
            entering_mean=total["entering"] / max(1, total["transitions"]),
            entering_max=max((s["entering_max"] for s in sel), default=0),
            hit_rate=1 - total["entering"] / max(1, total["selected"]),
            mass=total["mass"] / max(1, total["layers"]),
        )
    return row


def summarise(args, suite, counts, variants, records, perplexity, seconds, env, seconds_total) -> dict:
    """The report written to --out: configuration, one result per (variant, length), the paired
    comparisons, perplexity and every example's replies."""
    results = []
    for length in counts:
        at = [r for r in records if r["length"] == length]
        for v in variants:
            cfg = v.config(length) if v.share is not None else None
            results.append(result_row(v.name, length, v.share, cfg and cfg.to_dict(), suite.tasks, at,
                                      seconds.get((v.name, length), 0.0)))
    dense_nll = next((p["nll"] for p in perplexity if p["variant"] == "dense"), None)
    for p in perplexity:
        p["ppl"] = math.exp(p["nll"])
        p["ratio_to_dense"] = math.exp(p["nll"] - dense_nll) if dense_nll is not None else None
    report = {
        "suite": suite.name,
        "model": args.model,
        "model_source": models.source(args.model),
        "prefill": args.prefill,
        "lengths": list(counts),
        "examples_per_task": {str(k): v for k, v in counts.items()},
        "tasks": list(suite.tasks),
        "shares": list(args.shares),
        "picks": [str(p) for p in args.picks],
        "windows": [windows_name(getattr(args, "windows", WINDOWS))],
        "seed": args.seed,
        "scoring": suite.scoring,
        "spread": ("Wilson 95% interval of each mean score (for partial scores, RULER's string_match_all, it "
                   "treats the mean as a share of right answers, which overstates the spread); paired: normal "
                   "95% interval of the mean per-example difference"),
        "decode_steps": "the last prompt row, then each generated token; per layer and KV head",
        "context_prefill_seconds": {str(n): round(s, 1) for (name, n), s in seconds.items()
                                    if name == "context prefill"},
        "results": results,
        "perplexity": perplexity,
        "examples": records,
        "env": env,
        "seconds": round(seconds_total, 1),
    }
    report["paired"] = compare(report)
    return report


def a0_name(variant: str, share: int | None, names: set[str]) -> str | None:
    """The A = 0 row among ``names`` that a sparse variant's targets and tables compare it with: the one
    of its own --windows where there is one (an A = 0 row of other windows itself: the suite's A = 0)."""
    if not share:
        return None
    layout = WINDOWS_TAG.search(variant)
    own = f"A = 0, 1/{share}{layout[0]}" if layout else None
    return own if own in names and own != variant else f"A = 0, 1/{share}"


def targets(report: dict) -> list[dict]:
    """The issue's targets per NOSA variant and length, against dense and against A = 0 at the same
    budget: the accuracy gap to dense in points, averaged over the tasks where dense scores at least
    50%; the tasks where the variant answered fewer than A = 0; the hit rate; blocks entering per
    step over A = 0's; perplexity over dense (at the perplexity's length)."""
    get = {(r["variant"], r["length"]): r for r in report["results"]}
    ppl = {p["variant"]: p for p in report["perplexity"]}
    rows = []
    for r in report["results"]:
        if r["share"] is None or r["variant"].startswith("A = 0"):
            continue
        names = {v for v, length in get if length == r["length"]}
        n, dense, a0 = r["length"], get[("dense", r["length"])], get.get((a0_name(r["variant"], r["share"], names),
                                                                          r["length"]))
        kept = [t for t, d in dense["tasks"].items() if d["n"] and d["acc"] >= 0.5]
        dense_acc, acc = ((sum(x["tasks"][t]["acc"] for t in kept) / len(kept) for x in (dense, r)) if kept
                          else (None, None))
        row = {"variant": r["variant"], "length": n, "share": r["share"], "dense_tasks": kept,
               "dense_acc": dense_acc, "acc": acc,
               "points_below_dense": 100 * (dense_acc - acc) if kept else None, "hit_rate": r["hit_rate"]}
        if a0 is not None:
            row["tasks_below_a0"] = [t for t, x in r["tasks"].items() if x["right"] < a0["tasks"][t]["right"]]
            row["entering_over_a0"] = r["entering_mean"] / a0["entering_mean"] if a0["entering_mean"] else None
        p = ppl.get(r["variant"])
        if p is not None and p["length"] == n:
            row["ppl_over_dense"] = p["ratio_to_dense"]
        rows.append(row)
    return rows


def targets_table(report: dict) -> str:
    """Markdown of ``targets``."""
    out = ["| context | variant | dense's >= 50% tasks | dense | variant | points below dense | tasks below A = 0 "
           "| hit rate | entering / A = 0 | perplexity / dense |", "|---|---|---|---|---|---|---|---|---|---|"]
    for t in targets(report):
        acc = (f"{100 * t['dense_acc']:.1f}% | {100 * t['acc']:.1f}% | {t['points_below_dense']:.1f}"
               if t["dense_tasks"] else "- | - | -")
        below = (", ".join(t["tasks_below_a0"]) or "none") if "tasks_below_a0" in t else "-"  # "-": no A = 0 run
        ratio = f"{t['entering_over_a0']:.2f}x" if t.get("entering_over_a0") is not None else "-"
        ppl = f"{t['ppl_over_dense']:.4f}" if "ppl_over_dense" in t else "-"
        out.append(f"| {t['length']} | {t['variant']} | {', '.join(t['dense_tasks']) or 'none'} | {acc} | {below} "
                   f"| {t['hit_rate']:.1%} | {ratio} | {ppl} |")
    return "\n".join(out)


def _pct(s: dict) -> str:
    return f"{s['right']:.4g}/{s['n']} [{s['lo']:.0%}, {s['hi']:.0%}]"


def paired_table(report: dict) -> str:
    """Markdown of the report's paired comparisons (the examples themselves are in the JSON)."""
    out = ["| context | variant | vs | difference, points [95%] | examples better / worse |", "|---|---|---|---|---|"]
    for p in report.get("paired", []):
        out.append(f"| {p['length']} | {p['variant']} | {p['vs']} | {p['points']:+.1f} "
                   f"[{p['lo']:+.1f}, {p['hi']:+.1f}] | {p['better']} / {p['worse']} of {p['n']} |")
    return "\n".join(out)


def tables(report: dict) -> str:
    """Markdown: accuracy per task and length (right/n [Wilson 95%]); selection statistics and time
    per variant and length; perplexity."""
    results = report["results"]
    names = list(dict.fromkeys(r["variant"] for r in results))
    get = {(r["variant"], r["length"]): r for r in results}
    out = ["| context | task | " + " | ".join(names) + " |", "|---|---|" + "---|" * len(names)]
    for n in report["lengths"]:
        for task in report["tasks"]:
            out.append(f"| {n} | {task} | " + " | ".join(_pct(get[(v, n)]["tasks"][task]) if (v, n) in get else "-"
                                                         for v in names) + " |")
        out.append(f"| {n} | **all** | " + " | ".join(f"**{_pct(get[(v, n)]['all'])}**" if (v, n) in get else "-"
                                                      for v in names) + " |")
    out += ["", "| context | variant | budget | accuracy, all tasks | blocks entering per step, mean (max) "
            "| hit rate, cache = budget | dense mass in selection | seconds |", "|---|---|---|---|---|---|---|---|"]
    for n in report["lengths"]:
        for v in [v for v in names if (v, n) in get]:  # a merged report may leave a variant out at a length
            r = get[(v, n)]
            if r["share"] is None:
                out.append(f"| {n} | {v} | all | {r['all']['acc']:.1%} | - | - | - | {r['seconds']:.0f} |")
            else:
                out.append(f"| {n} | {v} | {r['budget_blocks']} of {r['context_blocks']} | {r['all']['acc']:.1%} | "
                           f"{r['entering_mean']:.2f} ({r['entering_max']}) | {r['hit_rate']:.1%} | {r['mass']:.3f} "
                           f"| {r['seconds']:.0f} |")
    if report.get("paired"):
        out += ["", paired_table(report)]
    if any(r["share"] is not None and not r["variant"].startswith("A = 0") for r in results):
        out += ["", targets_table(report)]
    if report["perplexity"]:
        p0 = report["perplexity"][0]
        out += ["", f"| perplexity, last {p0['tokens'] // p0['windows']} tokens of {p0['windows']} held-out "
                f"window(s) of {p0['length']} | ppl | / dense |", "|---|---|---|"]
        for p in report["perplexity"]:
            out.append(f"| {p['variant']} | {p['ppl']:.3f} | {p['ratio_to_dense']:.4f} |")
    return "\n".join(out)


def plot(report: dict, path: str) -> None:
    """Three panels per length: accuracy over all tasks (Wilson 95% whiskers), blocks entering per
    decode step, and the hit rate of a device cache of exactly the budget."""
    import matplotlib  # optional: matplotlib (the train extra)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # optional: matplotlib

    results = report["results"]
    names = list(dict.fromkeys(r["variant"] for r in results))
    sparse = [v for v in names if any(r["variant"] == v and r["share"] is not None for r in results)]
    lengths = report["lengths"]
    get = {(r["variant"], r["length"]): r for r in results}
    fig, axes = plt.subplots(1, 3, figsize=(14, 4.2))
    panels = [(axes[0], names, "accuracy, all tasks (%)", lambda r: 100 * r["all"]["acc"]),
              (axes[1], sparse, "blocks entering per decode step", lambda r: r["entering_mean"]),
              (axes[2], sparse, "hit rate, device cache = budget (%)", lambda r: 100 * r["hit_rate"])]
    for ax, variants, title, value in panels:
        width = 0.8 / max(1, len(variants))
        for i, v in enumerate(variants):
            at = [(j, get[(v, n)]) for j, n in enumerate(lengths) if (v, n) in get]  # not run at every length
            rows = [r for _, r in at]
            xs = [j + i * width for j, _ in at]
            heights = [value(r) for r in rows]
            err = None
            if ax is axes[0]:
                err = [[h - 100 * r["all"]["lo"] for h, r in zip(heights, rows)],
                       [100 * r["all"]["hi"] - h for h, r in zip(heights, rows)]]
            ax.bar(xs, heights, width, yerr=err, capsize=3, label=v, color=f"C{names.index(v)}")  # same in every panel
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(lengths))], [str(n) for n in lengths])
        ax.set_xlabel("context (tokens)")
        ax.set_title(title, fontsize=9)
    handles, labels = axes[0].get_legend_handles_labels()  # every variant, in the same colours as elsewhere
    fig.legend(handles, labels, loc="lower center", ncol=min(len(names), 4), fontsize=8, frameon=False)
    source = report.get("model_source") or {}
    fig.suptitle(f"{source.get('name', report['model'])} ({source.get('quantization', '?')} dequantized), "
                 f"{report['prefill']} context prefill; whiskers: Wilson 95%", fontsize=9)
    rows = -(-len(names) // 4)
    fig.tight_layout(rect=(0, 0.06 * rows, 1, 1))
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=100)


def write_report(report: dict, out: str, png: str | None) -> int:
    """Write the JSON (``write_result``), print the tables, draw the plot; returns 0."""
    write_result(out, report)
    print(tables(report))
    print(f"\nwrote {out} ({report['seconds'] / 60:.1f} min)")
    if png:
        plot(report, png)
        print(f"wrote {png}")
    return 0
