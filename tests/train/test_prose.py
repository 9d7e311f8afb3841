"""nosa.train.prose: prose extraction, the document-level split and the jsonl the training CLI reads."""

import hashlib
import json

import pytest

from nosa.train import prose
from nosa.train.data import load_files


@pytest.fixture(scope="module")
def fixed_docs():
    return prose.documents(prose.FIXED_SOURCES)


def test_prose_keeps_paragraphs_and_drops_code_and_headings():
    text = (
        "The \"if\" statement\n******************\n\n"
        "The \"if\" statement is used for conditional\nexecution of a suite.\n\n"
        "   if_stmt ::= \"if\" assignment_expression \":\" suite\n\n"
        "Short.\n\n"
        "It selects exactly one of the suites by evaluating the expressions one by one.\n"
        ">>> print(1)\n    1\n"
    )
    assert prose.prose(text) == 'The "if" statement is used for conditional execution of a suite.'


def test_sentences_split_before_a_capital():
    assert prose.sentences("One sentence here. Another one! (A third.) e.g. not split") == [
        "One sentence here.", "Another one!", "(A third.) e.g. not split"]


def test_documents_are_sorted_and_split_by_document(fixed_docs):
    assert [d.key for d in fixed_docs] == sorted(d.key for d in fixed_docs)
    assert len({d.key for d in fixed_docs}) == len(fixed_docs)
    assert {d.key.split(":")[0] for d in fixed_docs} == set(prose.FIXED_SOURCES)
    train, heldout = prose.split(fixed_docs)
    assert not {d.key for d in train} & {d.key for d in heldout}
    assert len(train) + len(heldout) == len(fixed_docs)
    assert 0.1 < len(heldout) / len(fixed_docs) < 0.3  # about HELDOUT_PERCENT = 20
    # a document's side follows from its key alone: the same with a subset of the documents
    sub_train, sub_heldout = prose.split(fixed_docs[::3])
    assert {d.key for d in sub_heldout} == {d.key for d in heldout} & {d.key for d in fixed_docs[::3]}
    key = heldout[0].key
    assert int(hashlib.sha256(key.encode()).hexdigest(), 16) % 100 < prose.HELDOUT_PERCENT
    # enough held-out prose for the benchmark's perplexity windows (3 x 8K tokens, ~4 chars a token)
    assert sum(len(d.text) for d in heldout) > 3 * 8192 * 4


def test_licences_are_deduplicated_documents():
    docs = prose.documents(("licences",))
    assert docs and all(d.key.startswith("licences:") for d in docs)
    assert len({d.text for d in docs}) == len(docs)


def test_unknown_source_is_a_clear_error():
    with pytest.raises(ValueError, match=r"unknown source\(s\) \['web'\]"):
        prose.documents(("topics", "web"))


def test_jsonl_loads_as_training_data(tmp_path, fixed_docs):
    path = prose.write_jsonl(str(tmp_path / "d" / "train.jsonl"), fixed_docs[:5])
    rows = [json.loads(line) for line in open(path)]
    assert [r["key"] for r in rows] == [d.key for d in fixed_docs[:5]]
    ds = load_files([path])
    assert ds["text"] == [d.text for d in fixed_docs[:5]]


def test_cli_writes_both_splits(tmp_path, capsys):
    prose.main(["--out", str(tmp_path), "--sources", "topics"])
    train = [json.loads(x)["key"] for x in open(tmp_path / "train.jsonl")]
    heldout = [json.loads(x)["key"] for x in open(tmp_path / "heldout.jsonl")]
    assert train and heldout and not set(train) & set(heldout)
    assert all(prose.is_heldout(k) for k in heldout) and not any(prose.is_heldout(k) for k in train)
    assert "heldout.jsonl" in capsys.readouterr().out


def test_docstrings_read_back_from_the_cache_as_parsed(tmp_path, monkeypatch):
    """The parsed standard-library docstrings are kept in a file named by what they were read from;
    a later process reads the same documents back, and a damaged file is parsed again."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    prose._docstrings.cache_clear()
    parsed = prose._docstrings()
    (cache,) = (tmp_path / "nosa" / "prose").iterdir()
    prose._docstrings.cache_clear()
    assert prose._docstrings() == parsed and len(parsed) > 100
    cache.write_text('[["only", "this"]')  # cut short
    prose._docstrings.cache_clear()
    assert prose._docstrings() == parsed
    prose._docstrings.cache_clear()
