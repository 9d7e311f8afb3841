"""scripts/bench_longctx.py (nosa.bench.longctx): the suite's NosaConfigs, the Wilson interval, and a
tiny end-to-end run on the real model in which A = 0 with every block in its budget must reply
exactly as dense."""

import argparse
import dataclasses
import json
import math
import os
from fractions import Fraction

import pytest
import torch

from nosa.bench.longctx import config as suite_config
from nosa.bench.longctx.merge import drop_variants, keep_lengths, merge
from nosa.bench.longctx.summary import share as right_share
from nosa.bench.longctx.summary import targets, wilson


def test_budget_config_scales_the_released_structure():
    cfg = suite_config.budget_config(8192, 4, suite_config.RELEASED_PICKS)
    assert (cfg.num_blocks(8192), cfg.topk_blocks, cfg.window_blocks, cfg.query_blocks) == (256, 64, 17, 15)
    cfg = suite_config.budget_config(8192, 4)  # the suite's default split: 1/16 of the budget as picks
    assert (cfg.topk_blocks, cfg.window_blocks, cfg.query_blocks) == (64, 17, 4)
    assert (cfg.sink_blocks, cfg.block_size, cfg.dense_len) == (1, 32, 0)
    for length in (2048, 4096, 8192):
        for share in (4, 8):
            cfg = suite_config.budget_config(length, share)
            assert cfg.topk_blocks * share == length // 32
            assert cfg.window_blocks >= 2 and cfg.topk_blocks >= cfg.sink_blocks + cfg.window_blocks + cfg.query_blocks


def test_budget_config_picks_share():
    cfg = suite_config.budget_config(8192, 4, Fraction(1, 8))
    assert (cfg.topk_blocks, cfg.window_blocks, cfg.query_blocks) == (64, 17, 8)
    assert suite_config.budget_config(2048, 4, Fraction(0)).query_blocks == 0
    assert suite_config.picks_share("1/16") == Fraction(1, 16)
    for bad in ("1", "-1/8", "x", "1/0"):
        with pytest.raises(argparse.ArgumentTypeError, match="fraction|share"):
            suite_config.picks_share(bad)


def test_budget_config_windows():
    """--windows sets the compressed windows and nothing else of the budget; KERNEL/STRIDE is parsed
    and a layout NosaConfig refuses is named before anything runs."""
    base, cfg = suite_config.budget_config(2048, 4), suite_config.budget_config(2048, 4, windows=(16, 16))
    assert (base.compress_kernel, base.compress_stride) == suite_config.WINDOWS == (32, 16)
    assert (cfg.compress_kernel, cfg.compress_stride) == (16, 16)
    assert dataclasses.replace(cfg, compress_kernel=32, compress_stride=16) == base
    assert suite_config.windows_arg("16/8") == (16, 8) and suite_config.windows_name((16, 8)) == "16/8"
    for bad in ("16", "a/b", "0/16", "16/"):
        with pytest.raises(argparse.ArgumentTypeError, match="KERNEL/STRIDE"):
            suite_config.windows_arg(bad)
    with pytest.raises(ValueError, match="compress_stride"):
        suite_config.budget_config(2048, 4, windows=(16, 12))


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


def test_a0_selection_does_not_depend_on_the_picks_share():
    """What --picks's help says: with every eviction head off, picks and ranked blocks are both the
    query's top blocks, so only their sum (the budget) matters."""
    from nosa import nosa_prefill

    torch.manual_seed(0)
    T, hq, hkv, d = 1024, 6, 2, 16
    q, k, v = torch.randn(T, hq, d), torch.randn(T, hkv, d), torch.randn(T, hkv, d)
    cis = torch.zeros(T, hkv)
    sets = []
    for picks in (suite_config.RELEASED_PICKS, Fraction(1, 8), Fraction(0)):
        _, sel = nosa_prefill(q, k, v, cis, suite_config.budget_config(T, 2, picks), d ** -0.5)
        sets.append(sel.sort(dim=-1).values)
    assert sets[0].shape[-1] == 16 and (sets[0] >= 0).any()
    assert torch.equal(sets[0], sets[1]) and torch.equal(sets[0], sets[2])


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


def test_no_a0_needs_a_checkpoint_and_drop_needs_merge(run_script, capsys):
    with pytest.raises(SystemExit):
        run_script("bench_longctx.py", "--no-a0")
    assert "leaves only dense" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        run_script("bench_longctx.py", "--drop", "x")
    assert "--drop and --keep-lengths work with --merge" in capsys.readouterr().err


def test_dense_ckpt_needs_a_label_of_its_own(run_script, capsys):
    for spec in ("runs/x", "dense=runs/x"):
        with pytest.raises(SystemExit):
            run_script("bench_longctx.py", "--dense-ckpt", spec)
        assert "give it a LABEL= of its own" in capsys.readouterr().err


def test_merge_names_an_unreadable_report(run_script, tmp_path):
    with pytest.raises(SystemExit, match="cannot read the report .*missing.json"):
        run_script("bench_longctx.py", "--merge", str(tmp_path / "missing.json"), "--out", str(tmp_path / "o.json"))


def test_targets_against_dense_and_a0():
    def row(variant, s, rights, entering=None, hit=None):
        tasks = {t: right_share(r, 4) for t, r in zip(("passkey", "qa", "vt"), rights)}
        return {"variant": variant, "length": 2048, "share": s, "tasks": tasks, "entering_mean": entering,
                "hit_rate": hit}
    report = {"results": [row("dense", None, (4, 2, 1)), row("A = 0, 1/4", 4, (4, 1, 1), 2.0, 0.85),
                          row("fitted, 1/4", 4, (3, 2, 0), 0.5, 0.97)],
              "perplexity": [{"variant": "fitted, 1/4", "length": 2048, "ratio_to_dense": 1.02}]}
    (t,) = targets(report)
    assert t["dense_tasks"] == ["passkey", "qa"]  # vt: dense 1/4 < 50%
    assert t["points_below_dense"] == pytest.approx(12.5)  # (100 + 50) / 2 - (75 + 50) / 2
    assert t["tasks_below_a0"] == ["passkey", "vt"]
    assert t["entering_over_a0"] == 0.25 and t["hit_rate"] == 0.97 and t["ppl_over_dense"] == 1.02
    # a variant run with other windows is held to A = 0 of its own windows where that ran, else the suite's
    layout = ", windows 16/16"
    report["results"] += [row("A = 0, 1/4" + layout, 4, (2, 2, 0), 1.0, 0.85),
                          row("fitted, 1/4" + layout, 4, (3, 1, 0), 0.5, 0.97)]
    by = {t["variant"]: t for t in targets(report)}
    own = by["fitted, 1/4" + layout]
    assert own["tasks_below_a0"] == ["qa"] and own["entering_over_a0"] == 0.5
    report["results"] = [r for r in report["results"] if not r["variant"].startswith("A = 0")]
    assert all("tasks_below_a0" not in t for t in targets(report))  # no A = 0 ran: nothing to hold it to


def test_wilson_interval():
    lo, hi = wilson(5, 10)
    assert lo == pytest.approx(0.2366, abs=1e-4) and hi == pytest.approx(0.7634, abs=1e-4)
    assert wilson(0, 4)[0] == 0 and wilson(4, 4)[1] == 1


@pytest.mark.real
def test_tiny_run_full_budget_replies_as_dense_and_dense_is_cached(real_checkpoint, run_script, tmp_path, capsys):
    common = ["--model", real_checkpoint, "--lengths", "512", "--examples", "1", "--tasks", "niah_single",
              "--cache", str(tmp_path / "cache"), "--out", str(tmp_path / "r.json")]
    assert run_script("bench_longctx.py", *common, "--shares", "1", "4", "--ppl-windows", "1",
                      "--dense-ckpt", f"same={real_checkpoint}") == 0
    report = json.loads((tmp_path / "r.json").read_text())
    assert "| 512 | **all** |" in capsys.readouterr().out
    assert [r["variant"] for r in report["results"]] == ["dense", "A = 0, 1/1", "A = 0, 1/4", "same"]
    # a dense-attention checkpoint (here the same weights): dense's replies, paired with dense, and
    # every sparse variant paired with it
    assert [e["reply"]["same"] for e in report["examples"]] == [e["reply"]["dense"] for e in report["examples"]]
    pairs = {(p["variant"], p["vs"]) for p in report["paired"]}
    assert {("same", "dense"), ("A = 0, 1/4", "same"), ("A = 0, 1/4", "dense")} <= pairs
    full = report["results"][1]
    assert full["budget_blocks"] == full["context_blocks"] == 16
    assert full["mass"] == pytest.approx(1.0, abs=1e-5)  # every block selected: all the dense mass
    for ex in report["examples"]:
        assert ex["reply"]["A = 0, 1/1"] == ex["reply"]["dense"]
    sparse = report["results"][2]
    assert 0 <= sparse["hit_rate"] <= 1 and sparse["mass"] < 1
    ppl = {p["variant"]: p for p in report["perplexity"]}
    assert ppl["A = 0, 1/1"]["ratio_to_dense"] == pytest.approx(1.0, abs=1e-4)
    assert ppl["same"]["ratio_to_dense"] == pytest.approx(1.0, abs=1e-4)
    # a second run (of the full budget only) reads dense from the cache: no dense decoding time
    assert run_script("bench_longctx.py", *common, "--shares", "1", "--ppl-windows", "0") == 0
    again = json.loads((tmp_path / "r.json").read_text())
    assert again["results"][0]["seconds"] == 0
    assert [e["reply"]["dense"] for e in again["examples"]] == [e["reply"]["dense"] for e in report["examples"]]
    assert [e["reply"]["A = 0, 1/1"] for e in again["examples"]] == [e["reply"]["dense"] for e in report["examples"]]


def test_sweep_fit_settings_are_parsed_with_clear_errors():
    from nosa.bench.longctx.sweep import parse_setting

    assert parse_setting("rank=1,tau=0.02,rows=12") == {"rank": 1.0, "tau": 0.02, "rows": 12}
    for bad in ("rank", "depth=3", "rows=1.5"):
        with pytest.raises(argparse.ArgumentTypeError, match="rank|depth|rows"):
            parse_setting(bad)


@pytest.mark.real
def test_sweep_fit_end_to_end_on_the_real_model(real_checkpoint, real_tokenizer, run_script, tmp_path):
    """Two settings refitted from one capture; at a budget of every block the coverage is exactly 1,
    and the answer block found for each example holds the answer's text."""
    from nosa.train import prose, ruler

    config = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                          "configs", "train", "smollm2.yaml")
    common = ["--config", config, f"model.path={real_checkpoint}",
              f"data.ruler.dir={tmp_path}/data", "seq_len=512", "data.ruler.tasks=[qa, niah_single]",
              "data.ruler.train_examples=1", "distill.rows=2", "--tasks", "qa", "niah_single", "--lengths", "512",
              "--examples", "1", "--settings", "rank=0,steps=5", "rank=1,steps=5"]
    assert run_script("sweep_fit.py", *common, "--share", "1", "--out", str(tmp_path / "full.json")) == 0
    full = json.loads((tmp_path / "full.json").read_text())
    assert [r["setting"].split(",")[0] for r in full["results"]] == ["rank=0.0", "rank=1.0"]
    assert full["captured_rows"] == 2 and len(full["examples"]) == 2
    for r in full["results"]:
        assert r["mean"] == pytest.approx(1.0)
    _, heldout = prose.split(prose.documents(prose.FIXED_SOURCES))
    haystack = ruler.Haystack(real_tokenizer, [d.text for d in heldout])
    for found in full["examples"]:
        (ex,) = ruler.make_examples(real_tokenizer, haystack, found["task"], 512, 1, 1)
        b = found["block"]
        text = real_tokenizer.decode(ex.prompt_ids[b * 32: (b + 2) * 32])
        assert ruler.normalise(ex.references[0]) in ruler.normalise(text)


def test_probe_ranking_static_order_is_the_selections():
    """probe_ranking's order of the heads (pooled score, block mean, lower index) picks exactly the
    blocks select_blocks ranks into the budget, ties included."""
    from nosa.bench.longctx.probe import static_order
    from nosa.config import NosaConfig
    from nosa.select import select_blocks

    gen = torch.Generator().manual_seed(0)
    cfg = NosaConfig(block_size=4, compress_kernel=4, compress_stride=2, sink_blocks=1, window_blocks=2,
                     topk_blocks=7, query_blocks=0, dense_len=0)
    nb = 20
    for trial in range(50):
        # few distinct values: ties in the pooled score and in the block mean
        evict = torch.randint(0, 3, (1, 2, nb, 2), generator=gen).float()
        position = torch.tensor([nb * 4 - 1])
        chosen = select_blocks(torch.zeros(1, 2, nb), evict, position, cfg)[0]
        forced = {0, nb - 2, nb - 1}
        for h in range(2):
            order = [b for b in static_order(evict[0, h]) if b not in forced]
            assert set(order[: cfg.topk_blocks - len(forced)]) | forced == set(chosen[h].tolist()), trial


@pytest.mark.real
def test_probe_ranking_end_to_end_on_the_real_model(dense_model_once, real_checkpoint, run_script, tmp_path):
    """At a budget of every block the answer is always inside the selection; at any budget, what the
    heads rank into the budget and what the picks find is inside it (the locality theorem's part of
    the selection that is fixed before the rest is filled)."""
    import copy

    import nosa
    from nosa.bench.longctx.config import budget_config
    from nosa.tiny import set_eviction_heads

    model = copy.deepcopy(dense_model_once)
    nosa.convert(model, budget_config(512, 1))
    set_eviction_heads(model, scale=0.5, std=0.3, seed=0, bias_std=0.3)
    model.save_pretrained(tmp_path / "ckpt")
    out = tmp_path / "probe.json"
    assert run_script("probe_ranking.py", "--checkpoint", str(tmp_path / "ckpt"), "--tokenizer", real_checkpoint,
                      "--length", "512", "--shares", "1", "2", "--examples", "1", "--tasks", "qa", "niah_multikey",
                      "--out", str(out)) == 0
    rows = json.loads(out.read_text())["rows"]
    assert sorted((r["task"], r["share"]) for r in rows) == [("niah_multikey", 1), ("niah_multikey", 2),
                                                             ("qa", 1), ("qa", 2)]
    for r in rows:
        assert all(0 <= r[k] <= 1 + 1e-6 for k in ("forced", "ranked", "picked", "covered"))
        assert r["covered"] >= r["forced"] + r["ranked"] - 1e-6 and r["covered"] >= r["forced"] + r["picked"] - 1e-6
        if r["share"] == 1:
            assert r["covered"] == pytest.approx(1.0)
    with pytest.raises(SystemExit, match="no checkpoint"):
        run_script("probe_ranking.py", "--checkpoint", str(tmp_path / "missing"), "--out", str(out))
