"""scripts/bench_longctx.py (nosa.bench.longctx): the suite's NosaConfigs, the Wilson interval, and a
tiny end-to-end run on the real model in which A = 0 with every block in its budget must reply
exactly as dense."""

import argparse
import dataclasses
import json
import os
from fractions import Fraction

import pytest
import torch

from nosa.bench.longctx import config as suite_config
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
    assert suite_config.windows_tag(suite_config.WINDOWS) == ""
    assert suite_config.windows_tag((16, 8)) == ", windows 16/8"
    assert suite_config.WINDOWS_TAG.search("ft, 1/4" + suite_config.windows_tag((16, 8)))
    for bad in ("16", "a/b", "0/16", "16/"):
        with pytest.raises(argparse.ArgumentTypeError, match="KERNEL/STRIDE"):
            suite_config.windows_arg(bad)
    with pytest.raises(ValueError, match="compress_stride"):
        suite_config.budget_config(2048, 4, windows=(16, 12))


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
