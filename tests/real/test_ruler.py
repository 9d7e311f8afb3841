"""nosa.train.ruler: the scoring rule, and examples built with the real model's tokenizer and chat
template over held-out prose."""

import pytest

from nosa.train import prose, ruler


def test_is_right_normalises_case_punctuation_and_digit_commas():
    assert ruler.is_right("The pass key is 48,213.", ["48213"])
    assert ruler.is_right("It is in the GREEN   chest!", ["green chest"])
    assert ruler.is_right("- 1234567\n- 7654321", ["7654321", "1234567"])
    assert not ruler.is_right("- 1234567", ["1234567", "7654321"])  # a list with an item missing
    assert not ruler.is_right("The number is 12345678.", ["1234567"])  # whole words only
    assert not ruler.is_right("greenchest", ["green chest"])


def test_is_settled_only_when_no_continuation_can_change_the_verdict():
    assert ruler.is_settled("The pass key is 48213.", ["48213"])
    assert ruler.is_settled("- 1234567\n- 7654321 ", ["1234567", "7654321"])
    assert not ruler.is_settled("The pass key is 48213", ["48213"])  # "482135" would be wrong
    assert not ruler.is_settled("The pass key is 48213,", ["48213"])  # "48213,5" reads 482135
    assert not ruler.is_settled("The pass key is 4821", ["48213"])


@pytest.fixture(scope="module")
def haystack(real_tokenizer):
    _, heldout = prose.split(prose.documents(prose.FIXED_SOURCES))
    return ruler.Haystack(real_tokenizer, [d.text for d in heldout])


@pytest.mark.real
@pytest.mark.parametrize("task", ruler.TASKS)
def test_examples_fit_hide_the_answer_in_the_context_and_are_deterministic(task, real_tokenizer, haystack):
    length = 1024
    examples = ruler.make_examples(real_tokenizer, haystack, task, length, 3, seed=5)
    assert [e.digest() for e in examples[:2]] == [e.digest() for e in
                                                 ruler.make_examples(real_tokenizer, haystack, task, length, 2, seed=5)]
    assert len({e.digest() for e in examples}) == 3
    for ex in examples:
        budget = length - ex.max_new_tokens
        assert budget - 8 <= len(ex.prompt_ids) <= budget
        context = real_tokenizer.decode(ex.prompt_ids[: ex.context_end])
        question = real_tokenizer.decode(ex.prompt_ids[ex.context_end :])
        assert context.startswith("<|im_start|>system")
        assert "<|im_end|>\n<|im_start|>assistant\n" in question
        assert all(r in context for r in ex.references)
        assert not any(r in question for r in ex.references)
        assert all(ruler.DEPTH[0] <= d <= ruler.DEPTH[1] for d in ex.depths)
        if task == "niah_multikey":
            assert context.count("One of the special magic numbers for") == ruler.KEYS


@pytest.mark.real
def test_unknown_task_is_a_clear_error(real_tokenizer, haystack):
    with pytest.raises(ValueError, match="unknown task 'nope'"):
        ruler.make_examples(real_tokenizer, haystack, "nope", 1024, 1, 0)



@pytest.mark.real
def test_training_examples_are_the_suite_prompts_answered_and_label_only_the_reply(real_tokenizer, haystack,
                                                                                   tmp_path):
    import json

    from nosa.train.data import IGNORE, load_files, tokenize

    length = 1024
    rows = ruler.training_examples(real_tokenizer, haystack, ["niah_single", "qa"], length, 2, seed=3)
    assert [r["task"] for r in rows] == ["niah_single", "qa", "niah_single", "qa"]  # round robin
    for row in rows:
        (start, end), = row["targets"]
        reply = row["text"][start:end]
        assert end == len(row["text"]) and reply.endswith(real_tokenizer.eos_token)
        references = reply.removesuffix(real_tokenizer.eos_token).strip(" .").split(" and ")
        assert ruler.is_right(reply, references)
        assert all(r in row["text"][:start] for r in references)  # the answer is stated in the prompt
        prompt_ids = real_tokenizer(row["text"][:start], add_special_tokens=False)["input_ids"]
        assert len(prompt_ids) <= length - ruler.MAX_NEW_TOKENS[row["task"]]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    ds = tokenize(load_files([str(tmp_path / "rows.jsonl")]), real_tokenizer)
    for row, ids, labels in zip(rows, ds["input_ids"], ds["labels"]):
        assert ids[0] == real_tokenizer.bos_token_id != ids[1]  # the template's own BOS, not a second one
        labelled = [t for t, lab in zip(ids, labels) if lab != IGNORE]
        (start, _), = row["targets"]
        assert real_tokenizer.decode(labelled).strip() == row["text"][start:].strip()
