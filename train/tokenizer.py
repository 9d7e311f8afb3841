"""The tokenizer: the model's own (a local path), or a byte-level BPE trained here with the
``tokenizers`` library and wrapped as a ``PreTrainedTokenizerFast`` (no downloads).

Digits are split one per token so that numbers in the synthetic tasks are copied digit by digit.
"""

from __future__ import annotations

SPECIALS = ("<pad>", "<bos>", "<eos>")


def train_tokenizer(texts, vocab_size: int = 512):
    """A byte-level BPE over ``texts`` (an iterable of str) -> PreTrainedTokenizerFast."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

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
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>")


def load_tokenizer(path: str):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def token_counter(tokenizer):
    """text -> number of tokens (no special tokens added)."""
    return lambda text: len(tokenizer(text, add_special_tokens=False)["input_ids"])
