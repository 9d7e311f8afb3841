"""Nothing the evaluation generates is trained on. The train-style rows of nosa.train.ruler (what
configs/train/smollm2-sparse.yaml trains on) share no phrasing with the prompts of the project's
suite or with RULER's templates and needles, and no haystack text with the suite's held-out prose or
with RULER's essays, SQuAD and HotpotQA contexts. Word 5-grams for phrasing, 8-grams for text."""

from __future__ import annotations

import json
import os
import re

import pytest

from nosa.chat import chat_text
from nosa.train import prose, ruler

pytestmark = pytest.mark.real
LENGTH = 512


grams = prose.word_grams  # the runs of words the training haystack's filter compares


def shared(mine: set[str], text: str, n: int) -> list[str]:
    """The n-grams of ``text`` in ``mine``, without holding all of a large text's n-grams at once."""
    words = prose.words(text)
    return [g for g in (" ".join(words[i : i + n]) for i in range(len(words) - n + 1)) if g in mine]


@pytest.fixture(scope="module")
def sides(real_tokenizer):
    """(training rows, their haystack, the suite's examples, the held-out haystack)."""
    _, heldout_docs = prose.split(prose.documents(prose.FIXED_SOURCES))
    train_hay = ruler.training_haystack(real_tokenizer)  # write_training_set's
    heldout_hay = ruler.Haystack(real_tokenizer, [d.text for d in heldout_docs])
    rows = ruler.training_examples(real_tokenizer, train_hay, ruler.TASKS, LENGTH, 2, seed=1, style="train",
                                   prose_rows=2)
    suite = [ex for task in ruler.TASKS for ex in ruler.make_examples(real_tokenizer, heldout_hay, task, LENGTH, 2, 0)]
    return rows, train_hay, suite, heldout_hay


def test_train_style_shares_no_phrasing_with_the_suite_or_ruler(sides, real_tokenizer):
    from nosa.bench.longctx import nvidia_ruler

    rows, train_hay, suite, heldout_hay = sides
    assert {r["task"] for r in rows} == {*ruler.TASKS, "prose"}
    # a format's phrasing: what its texts hold beyond their haystack and the chat template (whose
    # pieces become breaks, so that no n-gram runs across one)
    head, tail = chat_text(real_tokenizer, "\x00").split("\x00")

    def task_text(text: str) -> str:
        for piece in (head, tail, real_tokenizer.eos_token):
            text = text.replace(piece, " | ")
        return text

    heldout_text = grams(" ".join(heldout_hay.sentences), 5)
    suite_phrasing = set().union(*(grams(task_text(real_tokenizer.decode(ex.prompt_ids)), 5)
                                   for ex in suite)) - heldout_text
    train_text = grams(" ".join(train_hay.sentences), 5)
    train_phrasing = set().union(*(grams(task_text(r["text"]), 5) for r in rows)) - train_text
    root = os.path.join(nvidia_ruler.package_dir(), "data", "synthetic")
    ruler_texts = [cfg.template + " " + cfg.answer_prefix for cfg in nvidia_ruler.task_configs().values()]
    for script in ("niah.py", "variable_tracking.py"):  # the needles and the repeated haystack
        with open(os.path.join(root, script)) as f:
            ruler_texts += re.findall(r'"([^"\n]{24,})"', f.read())
    ruler_phrasing = set().union(*(grams(re.sub(r"\{[^}]*\}", " | ", t), 5) for t in ruler_texts))
    assert len(suite_phrasing) > 50 and len(ruler_phrasing) > 50 and len(train_phrasing) > 50
    assert not train_phrasing & suite_phrasing, sorted(train_phrasing & suite_phrasing)[:10]
    assert not train_phrasing & ruler_phrasing, sorted(train_phrasing & ruler_phrasing)[:10]
    joined = " ".join(r["text"] for r in rows)
    assert "VAR " not in joined and "special magic" not in joined and "The grass is green" not in joined
    # and the check can fail: the suite's own rows share the suite's phrasing
    suite_rows = ruler.training_examples(real_tokenizer, train_hay, ("niah_single",), LENGTH, 1, seed=1)
    assert grams(task_text(suite_rows[0]["text"]), 5) & suite_phrasing


def test_training_text_is_none_of_the_evaluations_text(sides):
    from nosa.bench.longctx import nvidia_ruler

    rows, _, _, heldout_hay = sides
    trained = set().union(*(grams(r["text"], 8) for r in rows))
    assert not shared(trained, " ".join(heldout_hay.sentences), 8)  # the suite's held-out prose
    # the check can fail: the training documents themselves repeat held-out boilerplate
    train_docs, _ = prose.split(prose.documents())
    assert shared(grams(" ".join(d.text for d in train_docs), 8), " ".join(heldout_hay.sentences), 8)
    root = os.path.join(nvidia_ruler.package_dir(), "data", "synthetic", "json")
    with open(os.path.join(root, "PaulGrahamEssays.json")) as f:
        essays = json.load(f)["text"]
    with open(os.path.join(root, "squad.json")) as f:
        squad = " ".join(p["context"] for article in json.load(f)["data"] for p in article["paragraphs"])
    with open(os.path.join(root, "hotpotqa.json")) as f:
        hotpot = " ".join(" ".join(s) for ex in json.load(f) for _, s in ex["context"])
    for name, text in (("essays", essays), ("squad", squad), ("hotpotqa", hotpot)):
        assert not shared(trained, text, 8), name
