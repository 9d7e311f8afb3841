"""The tokenizer the trainer builds: BOS in front of encoded text (as Llama/Qwen tokenizers do), none
in the training data, and a chat template that survives save/load (SGLang serves it)."""

import pytest

from nosa.train.tokenizer import add_bos, load_tokenizer, token_counter, train_tokenizer

TEXTS = ["the passkey is 12345. remember it.", "what is the passkey? 12345"] * 30


@pytest.fixture(scope="module")
def tok():
    return train_tokenizer(TEXTS, vocab_size=300)


def test_bos_is_added_in_front_and_only_with_special_tokens(tok):
    plain = tok("the passkey", add_special_tokens=False)["input_ids"]
    assert tok("the passkey")["input_ids"] == [tok.bos_token_id, *plain]
    assert tok("")["input_ids"] == [tok.bos_token_id]  # an empty prompt is still one token
    assert tok.convert_ids_to_tokens(tok.bos_token_id) == "<bos>"
    assert token_counter(tok)("the passkey") == len(plain)  # data sizes are measured without BOS


def test_chat_template_renders_and_survives_save_load(tok, tmp_path):
    messages = [{"role": "system", "content": "answer with digits"}, {"role": "user", "content": "passkey?"}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == "<bos><|system|>\nanswer with digits<eos>\n<|user|>\npasskey?<eos>\n<|assistant|>\n"
    assert not tok.apply_chat_template(messages, tokenize=False).endswith("<|assistant|>\n")
    tok.save_pretrained(str(tmp_path))
    again = load_tokenizer(str(tmp_path))
    ids = again.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=False)
    # What SGLang does: render, then encode without specials. One BOS, the template's.
    assert ids == again(text, add_special_tokens=False)["input_ids"]
    assert ids[0] == again.bos_token_id and ids.count(again.bos_token_id) == 1
    assert again("x")["input_ids"][0] == again.bos_token_id


def test_add_bos_names_a_missing_token(tok):
    with pytest.raises(ValueError, match="bos_token='<s>' is not in the tokenizer's vocabulary"):
        add_bos(tok.backend_tokenizer, "<s>")
