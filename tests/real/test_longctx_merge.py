"""scripts/bench_longctx.py --merge (nosa.bench.longctx.merge): reports of other lengths, of other
variants on the same examples (other checkpoints, picks or windows) and of other seeds joined into
one, with their paired comparisons; and what a join refuses."""

import math

import pytest

from nosa.bench.longctx import config as suite_config
from nosa.bench.longctx.merge import drop_variants, keep_lengths, merge


def test_merge_joins_other_windows_as_other_variants():
    """A run with --windows 16/16 (its variants named so) joins a report of the default windows on the
    same examples; the joined report lists both layouts; joined by lengths they must agree (a report
    from before --windows ran the default)."""
    old = _run(["dense", "A = 0, 1/4"], {"dense": (1, 1), "A = 0, 1/4": (0, 1)})  # no "windows" key
    new = dict(_run(["dense", "A = 0, 1/4, windows 16/16"], {"dense": (1, 1), "A = 0, 1/4, windows 16/16": (1, 1)}),
               windows=["16/16"])
    for report in (old, new):
        report["results"] = [dict(r, share=None if r["variant"] == "dense" else 4) for r in report["results"]]
    new["results"].append({"variant": "ft, 1/4, windows 16/16", "length": 2048, "share": 4})
    for ex, right in zip(new["examples"], (0, 0)):
        ex["right"]["ft, 1/4, windows 16/16"] = right
    merged = merge([old, new])
    assert merged["windows"] == ["32/16", "16/16"]
    vs = {(p["variant"], p["vs"]): p["points"] for p in merged["paired"]}
    assert vs[("A = 0, 1/4, windows 16/16", "A = 0, 1/4")] == pytest.approx(50.0)
    # a checkpoint run with other windows: paired with A = 0 of both layouts
    assert vs[("ft, 1/4, windows 16/16", "A = 0, 1/4, windows 16/16")] == pytest.approx(-100.0)
    assert vs[("ft, 1/4, windows 16/16", "A = 0, 1/4")] == pytest.approx(-50.0)
    later = dict(new, lengths=[4096], examples=[dict(ex, length=4096) for ex in new["examples"]],
                 results=[dict(r, length=4096) for r in new["results"]], examples_per_task={"4096": 2})
    with pytest.raises(SystemExit, match="'windows'"):
        merge([old, dict(later, results=[dict(r, variant="dense") for r in later["results"][:1]])])


def _report(length, ppl_length=None, variants=("dense", "A = 0, 1/4"), seed=0, shares=(4,)):
    return {"model": "m", "prefill": "dense", "tasks": ["qa"], "shares": list(shares), "picks": ["15/64"], "seed": seed,
            "lengths": [length], "examples_per_task": {str(length): 2}, "context_prefill_seconds": {str(length): 1.0},
            "results": [{"variant": v, "length": length} for v in variants],
            "examples": [{"length": length, "index": i} for i in range(2)], "seconds": length / 1000,
            "perplexity": [{"variant": "dense", "length": ppl_length}] if ppl_length else []}


def test_merge_joins_lengths_and_keeps_the_longest_perplexity():
    merged = merge([_report(8192, ppl_length=8192), _report(2048, ppl_length=2048), _report(4096)])
    assert merged["lengths"] == [2048, 4096, 8192]
    assert [r["length"] for r in merged["results"]] == [2048, 2048, 4096, 4096, 8192, 8192]
    assert len(merged["examples"]) == 6 and set(merged["examples_per_task"]) == {"2048", "4096", "8192"}
    assert merged["perplexity"][0]["length"] == 8192
    assert merged["seconds"] == 8.192 and sorted(merged["seconds_parts"]) == [2.048, 4.096, 8.192]
    with pytest.raises(SystemExit, match="more than one report"):
        merge([_report(2048), _report(2048)])
    with pytest.raises(SystemExit, match="'seed'"):
        merge([_report(2048), _report(4096, seed=1)])
    # a longer length may leave a variant out (not run there); not add one the first report lacks
    fewer = merge([_report(2048), _report(4096, variants=("dense",))])
    assert [(r["variant"], r["length"]) for r in fewer["results"]] == [("dense", 2048), ("A = 0, 1/4", 2048),
                                                                       ("dense", 4096)]
    with pytest.raises(SystemExit, match="variants that the first has not"):
        merge([_report(2048, variants=("dense",)), _report(4096)])
    # and fewer budgets (1/4 alone at the longest length), not another
    assert merge([_report(2048, shares=(4, 8)), _report(4096)])["shares"] == [4, 8]
    with pytest.raises(SystemExit, match="'shares'"):
        merge([_report(2048), _report(4096, shares=(4, 8))])


def _run(variants, rights, nll=None, digests=("a", "b")):
    """A report of 2 qa examples at 2048: ``rights[v]`` is variant v's verdict on each."""
    examples = [{"length": 2048, "task": "qa", "index": i, "digest": d,
                 "reply": {v: f"{v} {i}" for v in variants}, "right": {v: rights[v][i] for v in variants},
                 "select": {v: {"entering": i} for v in variants if v != "dense"}} for i, d in enumerate(digests)]
    return {"model": "m", "prefill": "dense", "tasks": ["qa"], "shares": [4], "picks": ["1/16"], "seed": 0,
            "lengths": [2048], "examples_per_task": {"2048": 2}, "context_prefill_seconds": {"2048": 1.0},
            "results": [{"variant": v, "length": 2048} for v in variants], "examples": examples, "seconds": 5.0,
            "perplexity": [{"variant": v, "length": 2048, "windows": 1, "nll": x} for v, x in (nll or {}).items()]}


def test_merge_joins_variants_on_the_same_examples():
    old = _run(["dense", "A = 0, 1/4", "fitted, 1/4"], {"dense": (1, 1), "A = 0, 1/4": (0, 1), "fitted, 1/4": (1, 0)},
               nll={"dense": 2.0, "A = 0, 1/4": 2.1})
    new = _run(["dense", "ranked, 1/4"], {"dense": (1, 1), "ranked, 1/4": (1, 1)},
               nll={"dense": 2.0, "ranked, 1/4": 2.05})
    merged = merge([old, new])
    assert [r["variant"] for r in merged["results"]] == ["dense", "A = 0, 1/4", "fitted, 1/4", "ranked, 1/4"]
    assert merged["lengths"] == [2048] and len(merged["examples"]) == 2
    ex = merged["examples"][1]
    assert ex["right"] == {"dense": 1, "A = 0, 1/4": 1, "fitted, 1/4": 0, "ranked, 1/4": 1}
    assert ex["reply"]["ranked, 1/4"] == "ranked, 1/4 1" and ex["select"]["ranked, 1/4"] == {"entering": 1}
    assert old["examples"][1]["right"] == {"dense": 1, "A = 0, 1/4": 1, "fitted, 1/4": 0}  # inputs untouched
    ppl = {p["variant"]: p for p in merged["perplexity"]}
    assert list(ppl) == ["dense", "A = 0, 1/4", "ranked, 1/4"]
    assert ppl["ranked, 1/4"]["ratio_to_dense"] == pytest.approx(math.exp(0.05))
    kept = drop_variants(merged, ["fitted", "A = 0"])
    assert [r["variant"] for r in kept["results"]] == ["dense", "ranked, 1/4"]
    assert [p["variant"] for p in kept["perplexity"]] == ["dense", "ranked, 1/4"]
    assert kept["examples"][1]["right"] == {"dense": 1, "ranked, 1/4": 1}
    assert drop_variants(merged, ["dense"])["results"][0]["variant"] == "dense"  # dense stays
    with pytest.raises(SystemExit, match="other examples"):
        merge([old, _run(["dense", "x, 1/4"], {"dense": (1, 1), "x, 1/4": (1, 1)}, digests=("a", "c"))])
    with pytest.raises(SystemExit, match="dense answers differently"):
        merge([old, _run(["dense", "x, 1/4"], {"dense": (0, 1), "x, 1/4": (1, 1)})])
    with pytest.raises(SystemExit, match="other windows"):
        merge([old, _run(["dense", "x, 1/4"], {"dense": (1, 1), "x, 1/4": (1, 1)}, nll={"dense": 2.5})])
    # the same windows measured on another CPU: the dense loss agrees to float rounding, not bit for bit
    assert merge([old, _run(["dense", "x, 1/4"], {"dense": (1, 1), "x, 1/4": (1, 1)}, nll={"dense": 2.0 + 1e-8})])


def test_merge_adds_other_picks_at_one_of_the_lengths():
    """A run at 8K alone with ``--picks 15/64`` (its variants named so) joins a report of 2K and 8K:
    its variant at 8K, paired there with dense and A = 0, nothing at 2K; the picks listed."""
    def at(length, variants, rights, picks, digests=("a", "b")):
        r = _run(variants, rights, digests=digests)
        for ex in r["examples"]:
            ex["length"] = length
        r["results"] = [{"variant": v, "length": length, "share": None if v == "dense" else 4} for v in variants]
        return dict(r, lengths=[length], picks=[picks], examples_per_task={str(length): 2})

    both = merge([at(2048, ["dense", "A = 0, 1/4"], {"dense": (1, 0), "A = 0, 1/4": (1, 0)}, "1/16", ("c", "d")),
                  at(8192, ["dense", "A = 0, 1/4"], {"dense": (1, 1), "A = 0, 1/4": (0, 1)}, "1/16")])
    later = at(8192, ["dense", "fitted, 1/4, picks 15/64"], {"dense": (1, 1), "fitted, 1/4, picks 15/64": (1, 1)},
               "15/64")
    merged = merge([both, later])
    assert merged["seconds_parts"] == [5.0, 5.0, 5.0]  # the earlier join's two parts, then the new one
    assert merged["picks"] == ["1/16", "15/64"] and merged["lengths"] == [2048, 8192]
    assert [(r["variant"], r["length"]) for r in merged["results"]] == [
        ("dense", 2048), ("A = 0, 1/4", 2048), ("dense", 8192), ("A = 0, 1/4", 8192),
        ("fitted, 1/4, picks 15/64", 8192)]
    assert [set(ex["right"]) for ex in merged["examples"]] == [{"dense", "A = 0, 1/4"}] * 2 + [
        {"dense", "A = 0, 1/4", "fitted, 1/4, picks 15/64"}] * 2
    vs = {(p["variant"], p["vs"]): p for p in merged["paired"] if p["length"] == 8192}
    assert vs[("fitted, 1/4, picks 15/64", "A = 0, 1/4")]["points"] == pytest.approx(50.0)
    assert vs[("fitted, 1/4, picks 15/64", "dense")]["points"] == 0.0
    with pytest.raises(SystemExit, match="other examples"):  # 8K's examples must be the first report's
        merge([both, at(8192, ["dense", "x, 1/4"], {"dense": (1, 1), "x, 1/4": (1, 1)}, "15/64", ("a", "z"))])
    with pytest.raises(SystemExit, match="'picks'"):  # joined by lengths, the picks must agree
        merge([at(2048, ["dense"], {"dense": (1, 0)}, "1/16"), at(8192, ["dense"], {"dense": (1, 1)}, "15/64")])


def _seeded(seed, rights, entering):
    """A report of 2 qa examples at 2048 with dense and A = 0 at 1/4, run with ``seed``: ``rights[v]`` are
    variant v's verdicts, ``entering`` A = 0's blocks entering per example (one transition each)."""
    cfg = suite_config.budget_config(2048, 4).to_dict()
    report = _run(["dense", "A = 0, 1/4"], rights, digests=(f"{seed}a", f"{seed}b"))
    for ex, n in zip(report["examples"], entering):
        ex["select"]["A = 0, 1/4"] = {"entering": n, "transitions": 1, "selected": 16, "mass": 0.5, "layers": 1,
                                      "entering_max": n}
    report["results"] = [{"variant": "dense", "length": 2048, "share": None, "seconds": 1.0},
                         {"variant": "A = 0, 1/4", "length": 2048, "share": 4, "nosa_config": cfg, "seconds": 2.0}]
    return dict(report, seed=seed)


def test_merge_pools_the_examples_of_other_seeds():
    """Reports of the same lengths and variants run with other --seed values: their examples pooled, the
    scores, hit rates and paired comparisons computed again over all of them."""
    pooled = merge([_seeded(42, {"dense": (1, 1), "A = 0, 1/4": (1, 0)}, (2, 4)),
                    _seeded(43, {"dense": (1, 0), "A = 0, 1/4": (1, 1)}, (0, 2))])
    assert pooled["seed"] == [42, 43] and pooled["examples_per_task"] == {"2048": 4}
    assert [(ex["seed"], ex["index"]) for ex in pooled["examples"]] == [(42, 0), (42, 1), (43, 2), (43, 3)]
    rows = {r["variant"]: r for r in pooled["results"]}
    assert rows["dense"]["all"]["right"] == 3 and rows["A = 0, 1/4"]["all"]["right"] == 3
    assert rows["A = 0, 1/4"]["tasks"]["qa"]["n"] == 4 and rows["dense"]["seconds"] == 2.0
    assert rows["A = 0, 1/4"]["entering_mean"] == pytest.approx(2.0)  # (2 + 4 + 0 + 2) / 4 transitions
    assert rows["A = 0, 1/4"]["hit_rate"] == pytest.approx(1 - 8 / 64)
    assert rows["A = 0, 1/4"]["budget_blocks"] == 16 and rows["A = 0, 1/4"]["context_blocks"] == 64
    vs = next(p for p in pooled["paired"] if p["variant"] == "A = 0, 1/4" and p["vs"] == "dense")
    assert (vs["n"], vs["better"], vs["worse"]) == (4, 1, 1)
    assert sorted((d["index"], d["dense"]) for d in vs["differ"]) == [(1, 1), (3, 0)]
    with pytest.raises(SystemExit, match="same variants"):
        merge([_seeded(42, {"dense": (1, 1), "A = 0, 1/4": (1, 0)}, (2, 4)),
               drop_variants(_seeded(43, {"dense": (1, 0), "A = 0, 1/4": (1, 1)}, (0, 2)), ["A = 0"])])


def test_one_length_of_a_joined_report_pools_with_another_seeds_run():
    """--keep-lengths and --drop shape each report before the pooling: the 8K part of a report of
    8K and 16K with more variants (other budgets, other picks), pooled with another seed's 8K run of
    dense and A = 0 alone; the budgets and picks no variant runs any more go with their variants."""
    def at(length, seed, rights):
        report = _run(list(rights), rights, digests=(f"{seed}a{length}", f"{seed}b{length}"))
        for ex in report["examples"]:
            ex["length"] = length
            for v in ex["select"]:
                ex["select"][v] = {"entering": 1, "transitions": 1, "selected": 16, "mass": 0.5, "layers": 1,
                                   "entering_max": 1}
        report["results"] = []
        for v in rights:
            share = None if v == "dense" else int(v.split("1/")[1][0])
            cfg = None if share is None else suite_config.budget_config(length, share).to_dict()
            report["results"].append({"variant": v, "length": length, "share": share, "nosa_config": cfg,
                                      "seconds": 1.0})
        shares = sorted({r["share"] for r in report["results"] if r["share"]})
        picks = ["1/16"] + (["15/64"] if any("picks" in v for v in rights) else [])
        return dict(report, seed=seed, lengths=[length], examples_per_task={str(length): 2}, shares=shares,
                    picks=picks, context_prefill_seconds={str(length): 1.0})

    names = ["dense", "A = 0, 1/4", "A = 0, 1/8", "fitted, 1/4, picks 15/64"]
    wide = merge([at(8192, 42, {v: (1, 0) for v in names}), at(16384, 42, {v: (0, 1) for v in names})])
    assert (wide["lengths"], wide["shares"], wide["picks"]) == ([8192, 16384], [4, 8], ["1/16", "15/64"])
    eight = keep_lengths(wide, [8192])
    assert eight["lengths"] == [8192] and {ex["length"] for ex in eight["examples"]} == {8192}
    assert {r["length"] for r in eight["results"]} == {8192} and eight["examples_per_task"] == {"8192": 2}
    assert {p["length"] for p in eight["paired"]} == {8192}
    trimmed = drop_variants(eight, ["1/8", "picks"])
    assert (trimmed["shares"], trimmed["picks"]) == ([4], ["1/16"])
    assert [r["variant"] for r in trimmed["results"]] == ["dense", "A = 0, 1/4"]
    other = at(8192, 43, {"dense": (0, 0), "A = 0, 1/4": (1, 1)})
    with pytest.raises(SystemExit, match="same variants"):  # the other variants not dropped
        merge([eight, other])
    pooled = merge([trimmed, other])
    assert pooled["seed"] == [42, 43] and pooled["examples_per_task"] == {"8192": 4}
    rows = {r["variant"]: r["all"]["right"] for r in pooled["results"]}
    assert rows == {"dense": 1, "A = 0, 1/4": 3}
    with pytest.raises(SystemExit, match="none of the lengths"):
        keep_lengths(wide, [4096])
