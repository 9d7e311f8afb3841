"""The docs' tables of NVIDIA's RULER (scripts/bench_longctx.py --suite ruler) on SmolLM2
(results/ruler.json) and on Gemma 3 270M (results/ruler_gemma3.json), of the fine-tunes scored on
it (results/ruler_ft.json) and of their training runs (results/train_smollm2.json,
scripts/wandb_report.py --summary): registered like ``report_tables``' renderers."""

from __future__ import annotations

from pathlib import Path

from nosa.bench.longctx.summary import a0_name, compare
from nosa.bench.report_tables import load, pct, renders, table

RULER = "results/ruler.json"


def _get(data: dict) -> tuple[list[str], dict]:
    names = list(dict.fromkeys(r["variant"] for r in data["results"]))
    return names, {(r["variant"], r["length"]): r for r in data["results"]}


def _recall(r: dict) -> list[str]:
    """A result's budget, blocks entering per step and hit rate (dense attention: all, -, -)."""
    if r["share"] is None:
        return ["all", "-", "-"]
    return [f"{r['budget_blocks']} of {r['context_blocks']}", f"{r['entering_mean']:.2f}", pct(r["hit_rate"])]


def _counts(data: dict) -> str:
    """The model (its weights), tasks and examples per task of a report, for the line under its table."""
    counts = ", ".join(f"{k} at {n}" for n, k in data["examples_per_task"].items())
    source = data["model_source"]
    seeds = data["seed"] if isinstance(data["seed"], list) else [data["seed"]]  # several: pooled (--merge)
    return (f"{source['name']}, its {source['quantization']} weights dequantized; {len(data['tasks'])} tasks; "
            f"examples per task: {counts} ({'seeds' if len(seeds) > 1 else 'seed'} {', '.join(map(str, seeds))})")


def _score(s: dict) -> str:
    """A mean score (0-100) with its Wilson 95% interval."""
    return f"{100 * s['acc']:.1f} [{100 * s['lo']:.0f}, {100 * s['hi']:.0f}]"


@renders(RULER)
def ruler_summary(root: Path, path: str = RULER) -> str:
    """Per length and variant: RULER's score averaged over the tasks, the paired difference to
    dense, and the selection's recall figures."""
    data = load(root, path)
    names, get = _get(data)
    vs_dense = {(p["variant"], p["length"]): p for p in data["paired"] if p["vs"] == "dense"}
    rows = []
    for n in data["lengths"]:
        for v in [v for v in names if (v, n) in get]:
            r, p = get[(v, n)], vs_dense.get((v, n))
            paired = (f"{p['points']:+.1f} [{p['lo']:+.1f}, {p['hi']:+.1f}]; {p['better']} / {p['worse']}"
                      if p else "-")
            rows.append([n, v, f"{100 * r['task_mean']:.1f}", _score(r["all"]), paired, *_recall(r)])
    header = ["context", "variant", "RULER score, mean of the tasks", "over the examples [Wilson 95%]",
              "vs dense, points [paired 95%]; examples better / worse", "budget (blocks)",
              "blocks entering per step", "hit rate, cache = budget"]
    minutes = ", ".join(f"{s / 60:.1f} min" for s in data.get("seconds_parts") or [data["seconds"]])
    return (table(header, rows) + f"\n\n{_counts(data)}. Scores 0-100 per example, RULER's metrics. "
            f"Wall time: {minutes} (one per run; their commands are in the JSON's `parts`).")


@renders(RULER)
def ruler_tasks(root: Path, path: str = RULER) -> str:
    """Per task and length, every variant's mean score (of how many examples)."""
    data = load(root, path)
    names, get = _get(data)
    rows = []
    for n in data["lengths"]:
        for t in data["tasks"]:
            cells = [get[(v, n)]["tasks"][t] if (v, n) in get else None for v in names]  # None: not run at n
            rows.append([n, t] + [f"{100 * c['acc']:.0f}" if c else "-" for c in cells] + [cells[0]["n"]])
    return table(["context", "task"] + names + ["examples"], rows)


@renders(RULER)
def ruler_differ(root: Path, path: str = RULER) -> str:
    """The examples where a sparse variant and dense score differently."""
    data = load(root, path)
    rows = []
    for p in data["paired"]:
        if p["vs"] != "dense":
            continue
        for d in p["differ"]:
            rows.append([p["length"], p["variant"], f"{d['task']} #{d['index']}",
                         f"{100 * d['dense']:.0f}", f"{100 * d[p['variant']]:.0f}"])
    return table(["context", "variant", "example", "dense", "variant's score"], rows)


RULER_GEMMA = "results/ruler_gemma3.json"


@renders(RULER_GEMMA)
def ruler_gemma3_summary(root: Path) -> str:
    """ruler_summary of Gemma 3 270M (docs/real-models.md)."""
    return ruler_summary(root, RULER_GEMMA)


@renders(RULER_GEMMA)
def ruler_gemma3_tasks(root: Path) -> str:
    return ruler_tasks(root, RULER_GEMMA)


@renders(RULER_GEMMA)
def ruler_gemma3_differ(root: Path) -> str:
    return ruler_differ(root, RULER_GEMMA)


RULER_GEMMA_32K = "results/ruler_gemma3_32k.json"


@renders(RULER_GEMMA_32K)
def ruler_gemma3_32k(root: Path) -> str:
    """The documented 32K subset of Gemma 3 270M (three needle tasks, one example each): its summary
    and its per-task scores."""
    return ruler_summary(root, RULER_GEMMA_32K) + "\n\n" + ruler_tasks(root, RULER_GEMMA_32K)


RULER_GEMMA_8K = "results/ruler_gemma3_8k.json"


@renders(RULER_GEMMA_8K)
def ruler_gemma3_8k(root: Path) -> str:
    """Gemma 3 270M at 8K on the examples of two seeds pooled (four per task): dense, A = 0 and the
    heads fitted at 8K, their summary and the examples where two differ."""
    data = load(root, RULER_GEMMA_8K)
    rows = []
    for seed in data["seed"]:  # each seed's examples alone: how far one run's examples move the difference
        part = dict(data, examples=[e for e in data["examples"] if e["seed"] == seed])
        for p in compare(part):
            if p["vs"] == "dense":
                rows.append([seed, p["variant"], f"{p['points']:+.1f} [{p['lo']:+.1f}, {p['hi']:+.1f}]",
                             f"{p['better']} / {p['worse']} of {p['n']}"])
    per_seed = table(["examples of seed", "variant", "vs dense, points [paired 95%]", "examples better / worse"],
                     rows)
    return (ruler_summary(root, RULER_GEMMA_8K) + "\n\nThe same comparison on each seed's examples alone:\n\n"
            + per_seed + "\n\n" + ruler_differ(root, RULER_GEMMA_8K))


PROBE_GEMMA = "results/probe_ranking_gemma3.json"
PROBED = ("dense", "A = 0, 1/4", "fitted-8k, 1/4")  # the bench's variants beside the probe (its checkpoint's last)


@renders(PROBE_GEMMA, RULER_GEMMA)
def probe_ranking_gemma3(root: Path) -> str:
    """Per RULER example (scripts/probe_ranking.py --suite ruler): where the answer's block stands in
    the selection of the probed checkpoint, beside the bench's scores of the same example."""
    probe, bench = load(root, PROBE_GEMMA), load(root, RULER_GEMMA)
    scores = {(e["task"], e["index"]): e["right"] for e in bench["examples"] if e["length"] == probe["length"]}
    rows = []
    for r in probe["examples"]:
        right = scores[(r["task"], r["index"])]
        rows.append([f"{r['task']} #{r['index']}", *(f"{100 * right[v]:.0f}" for v in PROBED), f"{r['forced']:.2f}",
                     f"{r['ranked']:.2f}", f"{r['picked']:.2f}", f"{r['covered']:.2f}", f"{r['above']:.1f}"])
    header = ["example", *PROBED, "forced", "ranked by the heads", "picked by the query", "in the selection",
              "needles the heads rank above it"]
    return (table(header, rows) + f"\n\nScores (0-100) from `{RULER_GEMMA}`; the other columns are shares of the "
            f"answer block's weight at 1/{probe['examples'][0]['share']} (checkpoint `{probe['checkpoint']}`, "
            f"{probe['length']} tokens).")


RULER_FT = "results/ruler_ft.json"


def _pair(data: dict) -> dict:
    return {(p["variant"], p["vs"], p["length"]): p for p in data["paired"]}


def _points(p: dict | None) -> str:
    return f"{p['points']:+.1f} [{p['lo']:+.1f}, {p['hi']:+.1f}]" if p else "-"


@renders(RULER_FT)
def ruler_finetunes(root: Path) -> str:
    """The fine-tunes on RULER (docs/training.md): per length and variant, the mean of the task
    scores, the paired differences to dense-FT and to A = 0 at the same budget, the recall figures,
    and perplexity on held-out prose over the original model's."""
    data = load(root, RULER_FT)
    names, get = _get(data)
    pair = _pair(data)
    ppl = {p["variant"]: p for p in data["perplexity"]}
    rows = []
    for n in data["lengths"]:
        for v in [v for v in names if (v, n) in get]:
            r = get[(v, n)]
            a0 = a0_name(v, r["share"], {x for x, m in get if m == n})
            p = ppl.get(v) if ppl.get(v, {}).get("length") == n else None  # measured at one length
            rows.append([n, v, f"{100 * r['task_mean']:.1f}", _points(pair.get((v, "dense", n))),
                         _points(pair.get((v, "dense-FT", n))),
                         _points(pair.get((v, a0, n))) if a0 and a0 != v else "-", *_recall(r),
                         f"{p['ratio_to_dense']:.4f}" if p else "-"])
    header = ["context", "variant", "RULER score, mean of the tasks", "vs dense, points [paired 95%]",
              "vs dense-FT", "vs A = 0 at its budget", "budget (blocks)", "blocks entering per step",
              "hit rate, cache = budget", "perplexity / original"]
    p0 = data["perplexity"][0] if data["perplexity"] else None
    where = (f"; perplexity: the last {p0['tokens'] // p0['windows']} tokens of {p0['windows']} held-out prose "
             f"windows of {p0['length']}, each variant's own attention (dense-attention rows: dense)" if p0 else "")
    return table(header, rows) + f"\n\n{_counts(data)}{where}."


@renders(RULER_FT)
def ruler_ft_tasks(root: Path) -> str:
    """Per task and length, every fine-tune's and reference's mean score."""
    return ruler_tasks(root, RULER_FT)


TRAIN_RUNS = "results/train_smollm2.json"


@renders(TRAIN_RUNS)
def train_runs(root: Path) -> str:
    """The fine-tunes' runs: steps, wall time, learning rate and loss weights, and the loss terms
    and selection statistics at their start and end (means of the first and last logged values)."""
    data = load(root, TRAIN_RUNS)
    rows = []
    for r in data["runs"]:
        def both(key: str, digits: int = 3) -> str:
            if key not in r["first"]:
                return "-"
            return f"{r['first'][key]:.{digits}f} -> {r['last'][key]:.{digits}f}"
        rows.append([r["label"], r["steps"], f"{r['run_seconds'] / 60:.1f} min",
                     f"{r['step_seconds'] / max(1, r['steps'] - 1):.0f} s", f"{r['lr']:g}",
                     f"{r['kl_weight']:g} / {r['select_weight']:g}", both("train/ce"), both("train/kl"),
                     both("train/select"), both("select/mass"), both("select/churn_mean", 2)])
    header = ["run", "steps", "wall time (load, fit, steps, saves)", "per step", "lr", "KL / selection weight",
              "token loss", "KL to the original", "selection loss", "dense mass in selection",
              "blocks entering per row"]
    m = data["provenance"]["machine"]
    return (table(header, rows) + f"\n\nStart -> end: means of the first and last logged values (up to 10 steps; "
            f"the rows alternate between tasks and prose, so single steps jump). {m['cpu']}, {m['cores']} cores.")



RULER_HOST_KV = "results/ruler_host_kv.json"
HOST_KV_TASKS = ("cwe", "fwe")  # the extraction-heavy tasks lossy KV paths are known to hurt (issue 35)


@renders(RULER_HOST_KV)
def ruler_host_kv(root: Path) -> str:
    """NOSA (A = 0) at 1/4 with the host pool in the model's dtype, int8 and fp8 (nosa.hf.host_kv_dtype,
    what a server with NOSA_HOST_KV_DTYPE computes): scores, the paired difference to the model's
    dtype, and cwe / fwe apart."""
    data = load(root, RULER_HOST_KV)
    names, get = _get(data)
    base = next(v for v in names if v.startswith("A = 0") and "host KV" not in v)
    pairs = {(p["variant"], p["length"]): p for p in data["paired"] if p["vs"] == base}
    rows = []
    for n in data["lengths"]:
        for v in [v for v in names if (v, n) in get and v != "dense"]:
            r, p = get[(v, n)], pairs.get((v, n))
            tasks = {t: s for t, s in (r["tasks"].items() if isinstance(r["tasks"], dict) else r["tasks"])}
            extract = " / ".join(f"{100 * tasks[t]['acc']:.1f}" for t in HOST_KV_TASKS if t in tasks)
            paired = (f"{p['points']:+.1f} [{p['lo']:+.1f}, {p['hi']:+.1f}]; {p['better']} / {p['worse']}"
                      if p else "(the reference)")
            rows.append([n, v, f"{100 * r['task_mean']:.1f}", paired, extract, pct(r["hit_rate"])])
    header = ["context", "variant", "RULER score, mean of the tasks", f"vs {base}, points [paired 95%]; "
              "examples better / worse", " / ".join(HOST_KV_TASKS), "hit rate, cache = budget"]
    dense = " / ".join(f"{n}: {100 * get[('dense', n)]['task_mean']:.1f}" for n in data["lengths"]
                       if ("dense", n) in get)
    return (table(header, rows) + f"\n\n{_counts(data)}. Dense attention on the same examples: {dense}. "
            "The context prefill is dense and exact (`--prefill dense`); every decode step attends over the "
            "whole context's K and V as the host pool gives them back.")


KV_FORMATS = "results/kv_formats.json"
KV_FORMATS_GEMMA = "results/kv_formats_gemma3.json"


@renders(KV_FORMATS)
def kv_formats(root: Path, path: str = KV_FORMATS) -> str:
    """scripts/bench_kv_formats.py: per host KV format, K and V apart, how far it moves the model's
    next-token distribution on held-out prose."""
    data = load(root, path)
    rows = []
    for r in data["formats"]:
        size = f"{r['bytes_per_token_vs_bf16']:.2f}x" if "bytes_per_token_vs_bf16" in r else "-"
        label = {"served": "", "apart": " (the other exact)", "what-if": " (what-if, not served)",
                 "unfactored": " (served on a checkpoint without them)"}[r["kind"]]
        if r["kind"] == "served" and r["format"] == "int8" and data.get("key_factors"):
            label = ", K divided by the checkpoint's key factors"
        rows.append([r["format"] + label, f"{r['kl']:.5f}",
                     pct(r["greedy_agreement"]), f"{r['ppl_ratio']:.4f}", size])
    header = ["K and V as the host pool returns them", "KL(exact ‖ format), mean per position",
              "greedy token unchanged", "perplexity / exact", "host bytes per token / bf16"]
    layers = (f" K and V of {data['layers_quantized']} of its {data['layers']} layers (those a server offloads)"
              if "layers" in data else "")
    return (table(header, rows) + f"\n\n`{data['model']}`,{layers}; {data['windows']} held-out prose windows of "
            f"{data['length']} tokens, scored on the last half of each ({data['scored_positions']} positions; "
            f"exact perplexity {data['exact_ppl']:.2f}). Every token's K and V go through the format, the current "
            "block's too (a server keeps that one exact): an upper bound on a served request's.")


@renders(KV_FORMATS_GEMMA)
def kv_formats_gemma3(root: Path) -> str:
    """kv_formats of Gemma 3 270M (its full-attention layers)."""
    return kv_formats(root, KV_FORMATS_GEMMA)


PROBE_WINDOWS = "results/probe_windows.json"


@renders(PROBE_WINDOWS)
def probe_windows(root: Path) -> str:
    """Per compressed-window layout (scripts/probe_windows.py): the answer block's dense attention caught
    by the top query-ranked blocks, and how often the top block is the one dense attention weighs most."""
    data = load(root, PROBE_WINDOWS)
    rows = [[f"{r['layout']} ({r['windows_per_block']:g} per block)" if r["windows_per_block"] else
             f"{r['layout']} (every key; not offloadable)", f"{r['top1']:.3f}", f"{r['top2']:.3f}",
             f"{r['top4']:.3f}", f"{r['best']:.3f}"] for r in data["rows"]]
    header = ["windows: kernel / stride, tokens", "answer's weight in the top block", "in the top 2", "in the top 4",
              "top block = dense's heaviest"]
    cfg = data["config"]
    return (table(header, rows) + f"\n\n`{data['model']}`, RULER's niah and qa tasks at {data['length']} tokens, "
            f"{data['examples']} examples (seed {data['seed']}, not the benchmark's), {data['heads']} (example, layer, "
            f"KV head) triples whose answer block is a candidate (neither sink nor in the window of 1/{data['share']}: "
            f"{cfg['sink_blocks']} + {cfg['window_blocks']} blocks of {cfg['block_size']} tokens).")
