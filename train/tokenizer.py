"""The tokenizer: the model's own (a local path), or a byte-level BPE trained here with the
``tokenizers`` library and wrapped as a ``PreTrainedTokenizerFast`` (no downloads).

Digits are split one per token so that numbers in the synthetic tasks are copied digit by digit.
Like Llama/Qwen tokenizers it adds ``<bos>`` in front of every encoded text (``add_special_tokens``,
the default of ``tokenizer(text)`` and of SGLang's /generate; the training data is tokenized
without it) and ships a chat template, so a served checkpoint answers /v1/chat/completions and an
empty prompt still has one token.
"""

from __future__ import annotations

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

SPECIALS = ("<pad>", "<bos>", "<eos>")

# Role-tagged turns, each closed by EOS; the prompt ends with the assistant tag when a reply is
# wanted. bos_token comes from the template, so SGLang encodes the rendered text without specials.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] + eos_token + '\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)


def add_bos(tokenizer_object, bos_token: str) -> None:
    """Make a ``tokenizers.Tokenizer`` prepend ``bos_token`` when special tokens are added."""
    bos_id = tokenizer_object.token_to_id(bos_token)
    if bos_id is None:
        raise ValueError(f"bos_token={bos_token!r} is not in the tokenizer's vocabulary")
    tokenizer_object.post_processor = processors.TemplateProcessing(
        single=f"{bos_token} $A", pair=f"{bos_token} $A {bos_token} $B", special_tokens=[(bos_token, bos_id)]
    )


def train_tokenizer(texts, vocab_size: int = 512, extra_tokens=()):
    """A byte-level BPE over ``texts`` (an iterable of str) -> PreTrainedTokenizerFast, plus
    ``extra_tokens``: strings that always encode as one token each (ids after the BPE's
    ``vocab_size``; e.g. the recall task's values, nosa.train.synthetic.RECALL_VALUES)."""
    from transformers import PreTrainedTokenizerFast  # optional: after nosa.train sets HF_HUB_OFFLINE

    if vocab_size < 256 + len(SPECIALS):
        raise ValueError(f"tokenizer.vocab_size={vocab_size} must be >= {256 + len(SPECIALS)} (bytes + specials)")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIALS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    add_bos(tok, "<bos>")
    if extra_tokens:
        tok.add_tokens([AddedToken(t, normalized=False) for t in extra_tokens])
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>",
                                   chat_template=CHAT_TEMPLATE)


def load_tokenizer(path: str):
    from transformers import AutoTokenizer  # optional: after nosa.train sets HF_HUB_OFFLINE

    tok = AutoTokenizer.from_pretrained(path)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def token_counter(tokenizer):
    """text -> number of tokens (no special tokens added)."""
    return lambda text: len(tokenizer(text, add_special_tokens=False)["input_ids"])
