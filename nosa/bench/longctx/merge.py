"""Reports of the long-context suite joined into one (scripts/bench_longctx.py --merge): by lengths, by
variants on the same examples, or by examples of other seeds pooled; and variants left out (--drop)."""

from __future__ import annotations

import math
from collections import Counter

from nosa.bench.longctx.config import PICKS, WINDOWS, windows_name
from nosa.bench.longctx.summary import compare, result_row


def merge(reports: list[dict]) -> dict:
    """One report from reports run with the same model, tasks and prefill, and the first report's
    budgets or fewer:
    - of disjoint lengths with the same variants or fewer (e.g. one process per length, the longest
      with 1/4 alone);
    - of the first report's lengths, or some of them, and the same examples there, with other
      variants (e.g. a checkpoint run later with ``--no-a0``, added to a report that has A = 0, or
      another ``--picks``, which the variants' names carry); dense is in both and must agree;
    - of the same lengths and variants on other examples (each report another ``--seed``: their
      examples pooled, see ``_pool_examples``).
    Perplexity: by lengths, from the report of the longest length that measured it; by variants,
    every variant's, against the first report's dense. "seconds" is the longest part and
    "seconds_parts" lists each part's (a report joined before: its parts')."""
    first = reports[0]
    seeds = [r.get("seed") for r in reports]
    # every report another seed, the same lengths: more examples of the same variants, pooled
    pool = (len(reports) > 1 and len(set(map(str, seeds))) == len(seeds)
            and all(r["lengths"] == first["lengths"] for r in reports))

    def new_variants(r: dict) -> bool:  # some of the first report's lengths, other variants than its
        return (set(r["lengths"]) <= set(first["lengths"])
                and set(_variants(r)) - {"dense"} != set(_variants(first)) - {"dense"})

    by_variants = not pool and len(reports) > 1 and all(new_variants(r) for r in reports[1:])
    # joined by variants, other picks are other variants ("fitted, 1/4, picks 15/64"), named apart
    # (another --windows is other variants too: their names say it)
    same = ("suite", "model", "prefill", "tasks") + (("shares", "picks", "windows") if pool else ("seed",)
                                                     if by_variants else ("seed", "picks", "windows"))
    for r in reports[1:]:
        if pool and _variants(r) != _variants(first):  # before their budgets: the variants say more
            raise SystemExit(f"bench_longctx --merge: reports of other seeds must run the same variants: "
                             f"{_variants(first)} vs {_variants(r)}")
        for key in same:
            if _field(r, key) != _field(first, key):
                raise SystemExit(f"bench_longctx --merge: the reports differ in {key!r}: "
                                 f"{first.get(key)!r} vs {r.get(key)!r}")
        # a later report may run fewer budgets (e.g. only 1/4 at the longest length), not others
        if not set(r.get("shares") or ()) <= set(first.get("shares") or ()):
            raise SystemExit(f"bench_longctx --merge: the reports differ in 'shares': {first.get('shares')!r} vs "
                             f"{r.get('shares')!r} (a later report may leave budgets out, not add one)")
    if pool:
        out = _pool_examples(reports)
    else:
        out = _join_variants(reports) if by_variants else _join_lengths(reports)
    # a report joined before brings its own parts' seconds
    out.update(seconds=max(r["seconds"] for r in reports),
               seconds_parts=[s for r in reports for s in (r.get("seconds_parts") or [r["seconds"]])])
    # where each part came from (the merged report's own provenance is the --merge command's)
    out["parts"] = [p for r in reports for p in (r.get("parts") or [r.get("provenance")]) if p]
    out["paired"] = compare(out)
    return out


def _field(report: dict, key: str):
    """A report's ``key``; reports written before --windows existed ran the default windows."""
    if key == "windows":
        return report.get("windows") or [windows_name(WINDOWS)]
    return report.get(key)


def drop_variants(report: dict, texts: list[str]) -> dict:
    """The report without the variants whose name contains any of ``texts`` (dense stays)."""
    def gone(name: str) -> bool:
        return name != "dense" and any(t in name for t in texts)

    if not texts:
        return report
    out = dict(report)
    out["results"] = [r for r in report["results"] if not gone(r["variant"])]
    if report.get("shares"):  # the budgets and picks some variant still runs at
        out["shares"] = [s for s in report["shares"] if any(r.get("share") == s for r in out["results"])]
    if report.get("picks"):  # other picks than the default are in the variants' names
        plain = any(r.get("share") and "picks " not in r["variant"] for r in out["results"])
        out["picks"] = [p for p in report["picks"] if any(f"picks {p}" in r["variant"] for r in out["results"])
                        or (plain and p == str(PICKS))]
    out["perplexity"] = [p for p in report["perplexity"] if not gone(p["variant"])]
    out["examples"] = [dict(ex, **{key: {v: x for v, x in ex[key].items() if not gone(v)}
                                   for key in ("reply", "right", "select")}) for ex in report["examples"]]
    out["paired"] = compare(out)
    return out


def keep_lengths(report: dict, lengths: list[int]) -> dict:
    """The report at ``lengths`` only (e.g. one length of a joined report, to pool with another
    seed's run of that length); SystemExit when it has none of them."""
    keep = [n for n in report["lengths"] if n in lengths]
    if not keep:
        raise SystemExit(f"bench_longctx --merge: the report has none of the lengths {lengths} "
                         f"(it has {report['lengths']})")
    out = dict(report, lengths=keep)
    out["results"] = [r for r in report["results"] if r["length"] in keep]
    out["examples"] = [ex for ex in report["examples"] if ex["length"] in keep]
    out["perplexity"] = [p for p in report["perplexity"] if p["length"] in keep]
    for key in ("examples_per_task", "context_prefill_seconds"):
        out[key] = {k: v for k, v in report.get(key, {}).items() if int(k) in keep}
    out["paired"] = compare(out)
    return out


def _variants(report: dict) -> list[str]:
    return [v["variant"] for v in report["results"] if v["length"] == report["lengths"][0]]


def _join_lengths(reports: list[dict]) -> dict:
    """Reports of disjoint lengths. The first has every variant; the others may leave some out
    (e.g. a checkpoint not run at the longest length): their tables show nothing for it there."""
    first = reports[0]
    for r in reports[1:]:
        if "dense" not in _variants(r) or not set(_variants(r)) <= set(_variants(first)):
            raise SystemExit("bench_longctx --merge: a report of another length has variants that the first has not "
                             f"(or no dense): {sorted(set(_variants(r)) - set(_variants(first)))}")
    lengths = [n for r in reports for n in r["lengths"]]
    if len(set(lengths)) != len(lengths):
        raise SystemExit(f"bench_longctx --merge: a length is in more than one report: {lengths}")
    reports = sorted(reports, key=lambda r: min(r["lengths"]))
    with_ppl = [r for r in reports if r["perplexity"]]
    out = dict(first)
    out.update(
        lengths=sorted(lengths),
        examples_per_task={k: v for r in reports for k, v in r["examples_per_task"].items()},
        context_prefill_seconds={k: v for r in reports for k, v in r["context_prefill_seconds"].items()},
        results=[row for r in reports for row in r["results"]],
        examples=[ex for r in reports for ex in r["examples"]],
        # the report that measured the most variants (then the longest): the fine-tunes' 2K windows
        # rather than a longer report's of dense and A = 0 alone
        perplexity=max(with_ppl, key=lambda r: (len(r["perplexity"]), r["perplexity"][0]["length"]))["perplexity"]
        if with_ppl else [],
    )
    return out


def _variant_names(results: list[dict], length: int) -> set[str]:
    return {row["variant"] for row in results if row["length"] == length}


def _join_variants(reports: list[dict]) -> dict:
    first = reports[0]
    examples = [dict(ex, reply=dict(ex["reply"]), right=dict(ex["right"]), select=dict(ex["select"]))
                for ex in first["examples"]]
    results, perplexity = list(first["results"]), list(first["perplexity"])
    dense_ppl = {p["variant"]: p for p in perplexity}.get("dense")
    for r in reports[1:]:
        mine_here = [ex for ex in examples if ex["length"] in r["lengths"]]  # the later report's lengths
        if [(e["length"], e["task"], e["digest"]) for e in r["examples"]] != \
                [(e["length"], e["task"], e["digest"]) for e in mine_here]:
            raise SystemExit("bench_longctx --merge: the reports have the same lengths but other examples "
                             "(--examples, --tasks or the prompts differ)")
        have = {n: _variant_names(results, n) for n in r["lengths"]}
        known = {row["variant"] for row in results}  # at any length: their perplexity is in already
        for mine, theirs in zip(mine_here, r["examples"]):
            a, b = mine["right"].get("dense"), theirs["right"].get("dense")
            if a is not None and b is not None and a != b:
                raise SystemExit(f"bench_longctx --merge: dense answers differently in the two reports "
                                 f"({theirs['task']} at {theirs['length']}, example {theirs['index']})")
            for key in ("reply", "right", "select"):
                mine[key].update({v: x for v, x in theirs[key].items() if v not in have[mine["length"]]})
        results += [row for row in r["results"] if row["variant"] not in have[row["length"]]]
        for p in r["perplexity"]:
            # the same windows give the same dense loss up to float rounding (another CPU's kernels)
            if p["variant"] == "dense" and dense_ppl is not None and (
                    (p["length"], p.get("windows")) != (dense_ppl["length"], dense_ppl.get("windows"))
                    or not math.isclose(p["nll"], dense_ppl["nll"], rel_tol=1e-6)):
                raise SystemExit("bench_longctx --merge: the reports measured perplexity on other windows")
            if p["variant"] not in known and p["variant"] != "dense":
                if dense_ppl is None:
                    raise SystemExit("bench_longctx --merge: the first report has no dense perplexity")
                perplexity.append(dict(p, ratio_to_dense=math.exp(p["nll"] - dense_ppl["nll"])))
    order = {n: i for i, n in enumerate(first["lengths"])}
    out = dict(first)
    out.update(results=sorted(results, key=lambda row: order[row["length"]]), examples=examples, perplexity=perplexity,
               picks=list(dict.fromkeys(p for r in reports for p in r["picks"])),
               windows=list(dict.fromkeys(w for r in reports for w in _field(r, "windows"))))
    return out


def _pool_examples(reports: list[dict]) -> dict:
    """Reports of the same lengths and variants, each on the examples of another ``--seed``: one
    report over all their examples (more examples per task than one run could afford), its results
    and paired comparisons computed again from the examples. Each example keeps its seed; its index
    counts on from the earlier reports' examples of its task. Perplexity (held-out windows, the same
    for every seed): the first report's."""
    first = reports[0]  # merge checked that they run the same variants
    examples, offset = [], Counter()
    for r in reports:
        counts = Counter()
        for ex in r["examples"]:
            key = (ex["length"], ex["task"])
            examples.append(dict(ex, seed=ex.get("seed", r["seed"]), index=offset[key] + ex["index"]))
            counts[key] = max(counts[key], ex["index"] + 1)
        offset.update(counts)
    seconds = Counter()
    for r in reports:
        for x in r["results"]:
            seconds[(x["variant"], x["length"])] += x["seconds"]
    results = [result_row(row["variant"], row["length"], row["share"], row.get("nosa_config"), first["tasks"],
                          [ex for ex in examples if ex["length"] == row["length"]],
                          seconds[(row["variant"], row["length"])]) for row in first["results"]]
    out = dict(first)
    out.update(
        seed=[r["seed"] for r in reports],
        examples_per_task={k: sum(r["examples_per_task"][k] for r in reports) for k in first["examples_per_task"]},
        context_prefill_seconds={k: round(sum(r["context_prefill_seconds"].get(k, 0.0) for r in reports), 1)
                                 for k in first["context_prefill_seconds"]},
        results=results, examples=examples,
    )
    return out
