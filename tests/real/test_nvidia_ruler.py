"""NVIDIA's RULER as a suite of the long-context benchmark (nosa.bench.longctx.nvidia_ruler): its
scores against the wheel's own metric functions, and examples written by its own generators with the
real model's tokenizer."""

import json
import os
import random

import pytest

from nosa.bench.longctx import nvidia_ruler
from nosa.bench.longctx.summary import paired
from nosa.chat import chat_text


def rulers_metrics():
    root = nvidia_ruler.package_dir()
    return nvidia_ruler._load(os.path.join(root, "eval", "synthetic", "constants.py"))


def test_the_13_task_configurations_come_from_the_wheel():
    configs = nvidia_ruler.task_configs()
    assert tuple(configs) == nvidia_ruler.TASKS
    assert configs["niah_multikey_3"].args["type_needle_k"] == "uuids"
    assert configs["qa_2"].args["dataset"] == "hotpotqa" and configs["qa_2"].metric == "string_match_part"
    assert configs["vt"].metric == "string_match_all" and configs["vt"].tokens_to_generate == 30
    assert all(c.generator in nvidia_ruler.QUESTION_STARTS for c in configs.values())


def test_scores_equal_rulers_own_metric_functions():
    metrics = rulers_metrics()
    own = {"string_match_all": metrics["string_match_all_per_sample"],
           "string_match_part": metrics["string_match_part_per_sample"]}
    rng = random.Random(0)
    words = ["Alpha", "beta", "7120868", "b38a-88c", "France", "the 10th century", "x"]
    for _ in range(300):
        refs = rng.sample(words, rng.randint(1, 4))
        reply = " ".join(rng.choice(words + ["\x01", " \n", "zeta"]) for _ in range(rng.randint(0, 6)))
        reply = reply.upper() if rng.random() < 0.2 else reply
        for metric, fn in own.items():
            expected = fn([nvidia_ruler.postprocess(reply)], [refs])[0] / 100
            assert nvidia_ruler.score(metric, reply, refs) == pytest.approx(expected), (metric, reply, refs)
    two_of_three = nvidia_ruler.score("string_match_all", "ALPHA and 7120868", ["alpha", "7120868", "9"])
    assert two_of_three == pytest.approx(2 / 3)
    with pytest.raises(ValueError, match="unknown RULER metric"):
        nvidia_ruler.score("exact", "a", ["a"])


def test_postprocess_cleans_as_rulers_postprocess_pred():
    # evaluate.py parses its arguments at import, so its postprocess_pred is restated, not imported
    assert nvidia_ruler.postprocess("  The answer\x01is\t 7 \n") == "The answer\nis\n 7"


def test_paired_lists_the_examples_where_two_variants_differ():
    records = [{"task": "t", "index": i, "right": {"a": a, "b": b}} for i, (a, b) in
               enumerate([(1, 1), (1, 0), (0, 1), (0.5, 0), (0, 0), (1, 0)])]
    p = paired(records, "a", "b")
    diffs = [0, 1, -1, 0.5, 0, 1]
    mean = sum(diffs) / 6
    sd = (sum((d - mean) ** 2 for d in diffs) / 5) ** 0.5
    assert p["points"] == pytest.approx(100 * mean)
    assert p["hi"] - p["points"] == pytest.approx(100 * 1.96 * sd / 6 ** 0.5)
    assert (p["better"], p["worse"], p["n"]) == (3, 1, 6)
    assert [d["index"] for d in p["differ"]] == [1, 2, 3, 5]


@pytest.mark.real
def test_ruler_through_the_benchmark_at_the_full_budget_and_its_examples(real_checkpoint, real_tokenizer, run_script,
                                                                        dense_model_once, tmp_path, capsys):
    """scripts/bench_longctx.py --suite ruler at 1K: at a budget of every block A = 0 replies as
    dense does and scores alike; the rows RULER's generators wrote fit, split at the question and
    hide the answers in the context; a second read finds them written. scripts/probe_ranking.py
    --suite ruler on the same rows finds the answer's block, inside the selection at every block."""
    length, tasks = 1024, ("niah_single_1",)  # a repeated haystack
    data = tmp_path / "ruler-data"
    args = ["--suite", "ruler", "--model", real_checkpoint, "--lengths", str(length), "--examples", "1",
            "--tasks", *tasks, "--shares", "1", "--ppl-windows", "0", "--cache", "", "--ruler-data", str(data),
            "--out", str(tmp_path / "r.json")]
    assert run_script("bench_longctx.py", *args) == 0
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["suite"] == "ruler" and report["tasks"] == list(tasks) and report["seed"] == nvidia_ruler.SEED
    assert "| 1024 | A = 0, 1/1 | dense |" in capsys.readouterr().out  # the paired table
    for ex in report["examples"]:
        assert ex["reply"]["A = 0, 1/1"] == ex["reply"]["dense"] and ex["right"]["A = 0, 1/1"] == ex["right"]["dense"]
        assert 0 <= ex["right"]["dense"] <= 1
    (pair,) = report["paired"]
    assert (pair["points"], pair["differ"]) == (0.0, [])

    # vt (its few-shot example) and cwe (its worked example) are only written, not decoded: decoding is the slow part
    suite = nvidia_ruler.RulerSuite((*tasks, "vt", "cwe"), data_dir=str(data))
    examples = suite.examples(real_tokenizer, real_checkpoint, length, 1, nvidia_ruler.SEED)  # niah read back
    assert [e.digest() for e in examples[:1]] == [e["digest"] for e in report["examples"]]
    for ex in examples:
        cfg = suite.configs[ex.task]
        assert len(ex.prompt_ids) + ex.max_new_tokens <= length
        assert ex.max_new_tokens == cfg.tokens_to_generate
        text = real_tokenizer.decode(ex.prompt_ids)
        context = real_tokenizer.decode(ex.prompt_ids[: ex.context_end])
        question = real_tokenizer.decode(ex.prompt_ids[ex.context_end :])
        assert "\u241e" not in text  # the generators' answer-prefix mark is gone
        assert text.startswith(chat_text(real_tokenizer, "")[:30])
        assert question.lstrip("\n").startswith(nvidia_ruler.QUESTION_STARTS[cfg.generator].strip()[:12])
        assert question.rstrip().endswith({"niah_single_1": "mentioned in the provided text is", "vt": "they are:",
                                           "cwe": "appear most often in the list are:"}[ex.task])
        assert all(r in context for r in ex.references), ex.task
        assert not any(r in question for r in ex.references)
    cwe = examples[2]
    assert real_tokenizer.decode(cwe.prompt_ids).count("Question: What are the 10 most common words") == 2
    assert suite.score(" ".join(cwe.references), cwe) == 1.0 and suite.settled(" ".join(cwe.references), cwe)
    assert suite.score(cwe.references[0], cwe) == pytest.approx(0.1)

    # the ranking probe on the same rows (read back, not generated again), heads with A != 0
    import copy

    import nosa
    from nosa.bench.longctx.config import budget_config
    from nosa.tiny import set_eviction_heads

    model = copy.deepcopy(dense_model_once)
    nosa.convert(model, budget_config(length, 1))
    set_eviction_heads(model, scale=0.5, std=0.3, seed=0, bias_std=0.3)
    model.save_pretrained(tmp_path / "ckpt")
    out = tmp_path / "probe.json"
    assert run_script("probe_ranking.py", "--suite", "ruler", "--checkpoint", str(tmp_path / "ckpt"), "--tokenizer",
                      real_checkpoint, "--length", str(length), "--examples", "1", "--tasks", *tasks,
                      "--shares", "1", "4", "--ruler-data", str(data), "--out", str(out)) == 0
    probe = json.loads(out.read_text())
    assert probe["suite"] == "ruler" and probe["seed"] == nvidia_ruler.SEED
    niah, size = examples[0], budget_config(length, 1).block_size
    rows = {r["share"]: r for r in probe["examples"]}
    assert sorted(rows) == [1, 4] and all(r["task"] == "niah_single_1" and r["index"] == 0 for r in rows.values())
    # the block where the answer starts (the text before the block is shorter than the answer's offset)
    answer_at = real_tokenizer.decode(niah.prompt_ids[: niah.context_end]).index(niah.references[0])
    block = rows[1]["block"]
    assert len(real_tokenizer.decode(niah.prompt_ids[: block * size])) <= answer_at
    assert answer_at < len(real_tokenizer.decode(niah.prompt_ids[: (block + 1) * size]))
    assert rows[1]["covered"] == pytest.approx(1.0)  # every block selected
    for r in rows.values():
        assert r["covered"] >= r["forced"] + r["ranked"] - 1e-6 and r["covered"] >= r["forced"] + r["picked"] - 1e-6
        assert r["above"] == 0  # niah_single_1 has one needle: no other needle sentence ranks above it


def test_unknown_ruler_task_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown RULER tasks"):
        nvidia_ruler.RulerSuite(("niah_single_9",))
