"""Synthetic tasks, the local tokenizer, loading through datasets, packing and batch order."""

import json

import pytest
import torch

from nosa.train import synthetic
from nosa.train.data import IGNORE, batch_at, build_rows
from nosa.train.tokenizer import token_counter, train_tokenizer


@pytest.fixture(scope="module")
def tok():
    sample = synthetic.make_split(list(synthetic.TASKS), 40, 1024, seed=5)
    return train_tokenizer((ex["text"] for ex in sample), vocab_size=320)


@pytest.mark.parametrize("task", synthetic.TASKS)
def test_examples_are_deterministic_and_sized(task, tok):
    count = token_counter(tok)
    ex = synthetic.make_example(task, 512, seed=3, measure=count)
    assert ex == synthetic.make_example(task, 512, seed=3, measure=count)
    assert ex != synthetic.make_example(task, 512, seed=4, measure=count)
    assert 0.9 * 512 <= count(ex["text"]) <= 512
    assert ex["targets"] and all(0 < a < b <= len(ex["text"]) for a, b in ex["targets"])
    answers = [ex["text"][a:b] for a, b in ex["targets"]]
    assert all(ans.strip() for ans in answers)
    # The answer is present in the context before the question (retrievable).
    first_target = ex["targets"][0][0]
    if task in ("passkey", "multikey"):
        assert all(ans.strip() in ex["text"][:first_target] for ans in answers)


def test_unknown_task():
    with pytest.raises(ValueError, match="unknown synthetic task 'nope'"):
        synthetic.make_example("nope", 100, 0)


def test_write_dataset_is_atomic_and_complete(tmp_path):
    out = tmp_path / "syn"
    synthetic.write_dataset(str(out), ["passkey", "mqar"], 6, 2, 300, seed=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["syn"]  # no temp dir left behind
    lines = (out / "train.jsonl").read_text().splitlines()
    held = (out / "heldout.jsonl").read_text().splitlines()
    assert len(lines) == 6 and len(held) == 2
    assert not set(lines) & set(held)
    assert json.loads((out / "meta.json").read_text())["train"] == 6


def test_supervised_rows_label_only_answers(tmp_path, tok):
    synthetic.write_dataset(str(tmp_path / "d"), ["passkey"], 3, 1, 200, seed=2, measure=token_counter(tok))
    rows = build_rows([str(tmp_path / "d" / "train.jsonl")], tok, 256)
    assert len(rows) == 3  # one example per row: two would not fit into 256 tokens
    row = rows[0]
    assert row["input_ids"].shape == (256,) and row["labels"].shape == (256,)
    labelled = row["labels"] != IGNORE
    answer = tok.decode(row["input_ids"][labelled]).strip()
    assert len(answer) == 5 and answer.isdigit()
    assert f"The pass key is {answer}." in tok.decode(row["input_ids"])
    # Right padding carries no label.
    pad = row["input_ids"] == tok.pad_token_id
    assert pad.any() and (row["labels"][pad] == IGNORE).all()
    # loss_on=all: every real token is labelled, the example boundaries stay.
    full = build_rows([str(tmp_path / "d" / "train.jsonl")], tok, 256, targets_only=False)[0]
    assert torch.equal(full["input_ids"], row["input_ids"])
    # every document starts with BOS (as SGLang encodes prompts), which carries no label
    bos = full["input_ids"] == tok.bos_token_id
    assert full["input_ids"][0] == tok.bos_token_id and int(bos.sum()) == 1
    assert ((full["labels"] != IGNORE) == (~pad & ~bos)).all()
    # `answers` marks exactly the answer tokens, whatever the labels cover
    assert torch.equal(full["answers"], labelled) and torch.equal(row["answers"], labelled)


@pytest.mark.parametrize("kind", ["jsonl", "parquet", "txt"])
def test_text_files_are_packed_to_seq_len(tmp_path, tok, kind):
    docs = [" ".join(f"word{i}x{j}" for j in range(60)) for i in range(10)]
    path = tmp_path / f"docs.{kind}"
    if kind == "jsonl":
        path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    elif kind == "parquet":
        import datasets

        datasets.Dataset.from_dict({"text": docs}).to_parquet(str(path))
    else:
        path.write_text("\n".join(docs) + "\n")
    rows = build_rows([str(path)], tok, 64)
    total = sum(len(tok(d, add_special_tokens=False)["input_ids"]) + 2 for d in docs)  # + BOS, EOS
    assert len(rows) == total // 64
    for r in rows:  # every token is its own label but BOS (nothing predicts a document's start)
        bos = r["input_ids"] == tok.bos_token_id
        assert torch.equal(r["labels"][~bos], r["input_ids"][~bos]) and (r["labels"][bos] == IGNORE).all()
    stream = torch.cat([r["input_ids"] for r in rows])
    assert (stream == tok.eos_token_id).sum() >= len(docs) - 2  # documents joined by EOS
    for r in rows:  # positions restart right after each EOS: one document per run of positions
        ids, pos = r["input_ids"], r["position_ids"]
        restart = torch.nonzero(pos[1:] == 0).squeeze(1) + 1
        assert torch.equal(restart, torch.nonzero(ids[:-1] == tok.eos_token_id).squeeze(1) + 1)
        assert ((pos[1:] == pos[:-1] + 1) | (pos[1:] == 0)).all()


def test_packed_examples_restart_positions_per_example(tmp_path, tok):
    synthetic.write_dataset(str(tmp_path / "d"), ["passkey"], 4, 1, 100, seed=2, measure=token_counter(tok))
    lengths = [1 + len(tok(json.loads(x)["text"], add_special_tokens=False)["input_ids"])  # + BOS
               for x in (tmp_path / "d" / "train.jsonl").read_text().splitlines()]
    rows = build_rows([str(tmp_path / "d" / "train.jsonl")], tok, 256)
    assert len(rows) == 2  # two examples of at most 100 tokens per row
    for r, pair in zip(rows, (lengths[:2], lengths[2:])):
        want = [p for n in pair for p in range(n)] + list(range(256 - sum(pair)))  # padding: its own run
        assert r["position_ids"].tolist() == want
        batch = batch_at(rows, 0, 0, 1, 2, 0, 1, seed=0)
        assert batch["position_ids"].shape == batch["input_ids"].shape == (2, 256)


def test_too_little_data(tmp_path, tok):
    path = tmp_path / "small.jsonl"
    path.write_text(json.dumps({"text": "hi"}) + "\n")
    with pytest.raises(ValueError, match="fewer than seq_len=64 tokens"):
        build_rows([str(path)], tok, 64)


def test_missing_column(tmp_path, tok):
    path = tmp_path / "x.jsonl"
    path.write_text(json.dumps({"body": "hi"}) + "\n")
    with pytest.raises(ValueError, match="no column 'text'"):
        build_rows([str(path)], tok, 64)


def test_batch_order_is_a_function_of_the_step(tmp_path, tok):
    rows = build_rows_text(tmp_path, tok)
    a = batch_at(rows, 5, 1, 2, 2, 0, 1, seed=3)
    assert torch.equal(a["input_ids"], batch_at(rows, 5, 1, 2, 2, 0, 1, seed=3)["input_ids"])
    # Two ranks of a step see different rows; one epoch visits every row once.
    r0 = batch_at(rows, 0, 0, 1, 1, 0, 2, seed=3)["input_ids"]
    r1 = batch_at(rows, 0, 0, 1, 1, 1, 2, seed=3)["input_ids"]
    assert not torch.equal(r0, r1)
    seen = torch.cat([batch_at(rows, s, 0, 1, 1, 0, 1, seed=3)["input_ids"] for s in range(len(rows))])
    assert len({tuple(x.tolist()) for x in seen}) == len({tuple(r["input_ids"].tolist()) for r in rows})


def build_rows_text(tmp_path, tok):
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"text": f"doc {i} " * 40}) + "\n" for i in range(8)))
    return build_rows([str(path)], tok, 32)
