"""The synthetic task generator: facts outside the sinks and the question's local window at the
configured depth, exact token placement, held-out disjoint from train, tokenizer round trip,
curriculum files and the config keys that drive them."""

import json
import os

import pytest

from nosa.train import synthetic
from nosa.train.config import load_config
from nosa.train.tokenizer import token_counter, train_tokenizer

SMOKE = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "train", "smoke.yaml")

BLOCK, SINKS, WINDOW = 16, 1, 2
HEAD, TAIL = SINKS * BLOCK, WINDOW * BLOCK


@pytest.fixture(scope="module")
def tok():
    sample = synthetic.make_split(list(synthetic.TASKS), 40, 1024, seed=5)
    return train_tokenizer((ex["text"] for ex in sample), vocab_size=400, extra_tokens=synthetic.RECALL_VALUES)


def _tokens(tok, ex):
    enc = tok(ex["text"], add_special_tokens=False, return_offsets_mapping=True)
    answers = [i for i, (s, e) in enumerate(enc["offset_mapping"]) if any(a <= s and e <= b for a, b in ex["targets"])]
    return enc["input_ids"], answers


@pytest.mark.parametrize("task", synthetic.TASKS)
def test_facts_lie_outside_sinks_and_the_question_window(task, tok):
    count = token_counter(tok)
    for seed in range(6):
        ex = synthetic.make_example(task, 512, seed, count, head=HEAD, tail=TAIL)
        ids, answers = _tokens(tok, ex)
        assert 500 <= len(ids) <= 512
        question = ex["question"]
        assert answers and min(answers) > question  # the answers are predicted inside the question
        for start, end in ex["facts"]:
            # the recorded token span holds exactly the fact (placement is exact, not estimated)
            assert tok.decode(ids[start:end]) == " " + tok.decode(ids[start:end]).strip()
            assert start >= HEAD and end <= question - TAIL
            # every block of the fact is neither a sink nor in the window of any question row
            assert start // BLOCK >= SINKS
            assert (end - 1) // BLOCK <= question // BLOCK - WINDOW
        # the answer is there to retrieve: the facts hold every answer string
        facts_text = tok.decode([t for s, e in ex["facts"] for t in ids[s:e]])
        for a, b in ex["targets"]:
            assert ex["text"][a:b].strip() in facts_text or task == "vartrack"


def test_recall_answers_come_only_from_the_facts(tok):
    ex = synthetic.make_example("recall", 400, 3, token_counter(tok), head=HEAD, tail=TAIL)
    context = ex["text"][: ex["text"].index(" ?")]
    values = [w.rstrip(".") for w in context.split() if w.rstrip(".") in synthetic.RECALL_VALUES]
    assert len(values) == synthetic.RECALL_PAIRS == len({v[0] for v in values})  # one value per key
    answers = [ex["text"][a:b] for a, b in ex["targets"]]
    assert len(answers) == synthetic.RECALL_QUERIES and set(answers) <= set(values)
    # each question names the key of its answer; the answer is one token (an added token)
    words = ex["text"][ex["text"].index(" ?") :].replace(".", "").split()[1:]
    assert words == [a[0] + a for a in answers]
    ids = tok(ex["text"], add_special_tokens=False)["input_ids"]
    for a in answers:  # the token before each answer is its key (the question asks by the key)
        at = ids.index(tok.convert_tokens_to_ids(a), ex["question"])
        assert tok.decode([ids[at - 1]]).strip() == a[0]
    for a in answers:
        assert tok(a, add_special_tokens=False)["input_ids"] == [tok.convert_tokens_to_ids(a)]


@pytest.mark.parametrize("depth", [(0.0, 0.1), (0.9, 1.0)])
def test_depth_places_facts_in_its_range(tok, depth):
    count = token_counter(tok)
    for seed in range(5):
        ex = synthetic.make_example("passkey", 1024, seed, count, head=HEAD, tail=TAIL, depth=depth)
        (start, end), question = ex["facts"][0], ex["question"]
        # the fact starts at depth * (span between the sinks and the window), +- one filler word
        span = question - TAIL - (end - start) - HEAD
        rel = (start - HEAD) / span
        assert depth[0] - 0.02 <= rel <= depth[1] + 0.02, rel


def test_too_short_for_head_and_tail():
    with pytest.raises(ValueError, match="leaves no filler between head=16 and tail=500"):
        synthetic.make_example("recall", 512, 0, head=16, tail=500)
    with pytest.raises(ValueError, match=r"depth=\[0.5, 0.2\]"):
        synthetic.make_example("recall", 512, 0, depth=(0.5, 0.2))


def test_tokenizer_round_trip(tok):
    count = token_counter(tok)
    for task in synthetic.TASKS:
        ex = synthetic.make_example(task, 300, 11, count, head=HEAD, tail=TAIL)
        ids, answers = _tokens(tok, ex)
        assert tok.decode(ids) == ex["text"]
        # labelled tokens are exactly the answers: no target shares a token with its context
        assert "".join(tok.decode([ids[i]]) for i in answers) == "".join(ex["text"][a:b] for a, b in ex["targets"])
        assert len(ids) == count(ex["text"]) <= 300


def test_heldout_is_disjoint_from_train(tmp_path, tok):
    out = tmp_path / "d"
    synthetic.write_dataset(str(out), ["recall"], 200, 50, 256, seed=4, measure=token_counter(tok),
                            lengths=[128], head=HEAD, tail=TAIL)
    train = [json.loads(x) for x in (out / "train.jsonl").read_text().splitlines()]
    held = [json.loads(x) for x in (out / "heldout.jsonl").read_text().splitlines()]
    short = [json.loads(x) for x in (out / "train-128.jsonl").read_text().splitlines()]
    assert len(train) == 200 and len(held) == 50 and len(short) == 200
    assert not {e["text"] for e in train} & {e["text"] for e in held}
    # not even the same facts in another filler: the question with its answers is never shared
    tail = lambda e: e["text"][e["text"].index(" ?") :]  # noqa: E731
    assert not {tail(e) + str(e["facts"]) for e in train} & {tail(e) + str(e["facts"]) for e in held}
    assert all(token_counter(tok)(e["text"]) <= 128 for e in short)
    meta = json.loads((out / "meta.json").read_text())
    assert meta["lengths"] == [128, 256] and meta["head"] == HEAD and meta["tail"] == TAIL


def test_same_seed_other_split_differs(tok):
    a = synthetic.make_split(["recall"], 3, 200, 1, split="train")
    b = synthetic.make_split(["recall"], 3, 200, 1, split="heldout")
    assert a == synthetic.make_split(["recall"], 3, 200, 1, split="train")
    assert all(x["text"] != y["text"] for x, y in zip(a, b))


def test_curriculum_config():
    cfg = load_config(SMOKE, ["dense_steps=5", "curriculum=[[2, 64], [1, 128]]"])
    assert [cfg.stage_at(s) for s in range(5)] == [(64, 4), (64, 4), (128, 2), (256, 1), (256, 1)]
    assert cfg.seq_lens == [64, 128, 256]
    for bad, match in [
        ("[[2, 100]]", r"seq_len 100 must divide seq_len=256 and be a multiple of nosa.block_size=16"),
        ("[[6, 64]]", r"its 6 steps exceed dense_steps=5"),
        ("[[2]]", r"expected \[\[steps, seq_len\], ...\] of positive ints, got stage \[2\]"),
    ]:
        with pytest.raises(ValueError, match=match):
            load_config(SMOKE, ["dense_steps=5", f"curriculum={bad}"])
    with pytest.raises(ValueError, match=r"data.synthetic.depth=\[0.8, 0.2\]"):
        load_config(SMOKE, ["data.synthetic.depth=[0.8, 0.2]"])
