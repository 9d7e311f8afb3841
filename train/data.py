"""Data: local files through ``datasets``, tokenised and packed to ``seq_len``.

Rows are ``input_ids``, ``labels`` (-100 where no loss is taken), ``answers`` (bool: the answer
tokens, which nosa.train.loss weighs ``data.answer_weight``) and ``position_ids``, each
[seq_len], plus ``task`` ("" for plain text). Plain text (``text_field`` only): all documents
joined by EOS and cut into rows of exactly ``seq_len``, labels = inputs. Supervised examples
(``text`` + ``targets`` character spans, nosa.train.synthetic): only target tokens carry labels;
whole examples are packed greedily into rows (never split), the rest is right padding with no
label. ``position_ids`` restart at 0 where a document starts, so with ``use_cache=False`` each
document of a packed row attends only to itself, densely (transformers' mask) and with NOSA
(``nosa_prefill_varlen``, nosa.hf). ``batch_at`` maps (step, micro step, rank) to a fixed set of
rows (a seeded permutation per epoch): a resumed run sees the batches an uninterrupted one would.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from nosa.train import ruler, synthetic
from nosa.train.datadir import read_meta
from nosa.train.tokenizer import load_tokenizer, token_counter, train_tokenizer

IGNORE = -100


def offline_env() -> None:
    """No hub access: local loads of json/parquet otherwise still try the network."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def load_files(paths: list[str]):
    """A ``datasets.Dataset`` from local .jsonl/.json/.parquet/.txt files (all of one kind)."""
    offline_env()
    import datasets  # optional: datasets reads HF_DATASETS_OFFLINE at import (offline_env() first)

    missing = [p for p in paths if not os.path.isfile(p)]
    if missing:
        raise ValueError(f"data file(s) not found: {missing}")
    kinds = {_builder(p) for p in paths}
    if len(kinds) != 1:
        raise ValueError(f"data files mix formats {sorted(kinds)}: {paths}")
    datasets.disable_progress_bars()
    return datasets.load_dataset(kinds.pop(), data_files=list(paths), split="train")


def _builder(path: str) -> str:
    if path.endswith((".jsonl", ".json")):
        return "json"
    if path.endswith(".parquet"):
        return "parquet"
    if path.endswith((".txt", ".text")):
        return "text"
    raise ValueError(f"data file {path!r}: expected .jsonl, .json, .parquet or .txt")


def tokenize(ds, tokenizer, text_field: str = "text", num_proc: int = 1, targets_only: bool = True):
    """Add ``input_ids``, ``labels`` and ``answers`` per document. Every document starts with the
    tokenizer's BOS (when it has one), as SGLang and ``tokenizer(text)`` encode prompts, so the
    model trains on what it is served; a text that already starts with it (a chat turn whose
    template writes the BOS, as SmolLM2's ``<|im_start|>``) gets no second one. With ``targets``
    spans and ``targets_only`` only answer tokens carry labels, otherwise every token but BOS does;
    ``answers`` marks the answer tokens (all False without ``targets``)."""
    if text_field not in ds.column_names:
        raise ValueError(f"data has no column {text_field!r}; columns are {ds.column_names}")
    has_targets = "targets" in ds.column_names
    supervised = has_targets and targets_only
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []

    def fn(batch):
        enc = tokenizer(batch[text_field], add_special_tokens=False, return_offsets_mapping=has_targets)
        input_ids, labels, answers = [], [], []
        for i, ids in enumerate(enc["input_ids"]):
            spans = batch["targets"][i] if has_targets else []
            offsets = enc["offset_mapping"][i] if has_targets else [(0, 0)] * len(ids)
            answer = [any(a <= s and e <= b and e > s for a, b in spans) for s, e in offsets]
            head = bos if ids[: len(bos)] != bos else []  # a chat turn starts with its own BOS-like token
            input_ids.append(head + list(ids))
            labels.append([IGNORE] * len(head) + [t if ok or not supervised else IGNORE for t, ok in zip(ids, answer)])
            answers.append([False] * len(head) + answer)
        tasks = batch["task"] if "task" in batch else [""] * len(labels)
        return {"input_ids": input_ids, "labels": labels, "answers": answers, "task": tasks}

    return ds.map(fn, batched=True, remove_columns=ds.column_names, num_proc=num_proc or None)


def pack(ds, seq_len: int, pad_id: int, eos_id: int | None, examples: bool):
    """Rows of exactly ``seq_len`` tokens (see the module docstring)."""
    import datasets  # optional: datasets reads HF_DATASETS_OFFLINE at import (offline_env() first)

    rows = {"input_ids": [], "labels": [], "answers": [], "position_ids": [], "task": []}
    if examples:
        ids_row, lab_row, ans_row, pos_row, task_row = [], [], [], [], ""
        for ex in ds:
            ids, lab, ans = ex["input_ids"][-seq_len:], ex["labels"][-seq_len:], ex["answers"][-seq_len:]
            if ids_row and len(ids_row) + len(ids) > seq_len:
                _flush(rows, ids_row, lab_row, ans_row, pos_row, task_row, seq_len, pad_id)
                ids_row, lab_row, ans_row, pos_row = [], [], [], []
            task_row = ex["task"] if not ids_row else task_row
            ids_row, lab_row, ans_row = ids_row + ids, lab_row + lab, ans_row + ans
            pos_row = pos_row + list(range(len(ids)))
        if ids_row:
            _flush(rows, ids_row, lab_row, ans_row, pos_row, task_row, seq_len, pad_id)
    else:
        ids_stream: list[int] = []
        lab_stream: list[int] = []
        for ex in ds:
            end = [eos_id] if eos_id is not None else []
            ids_stream += ex["input_ids"] + end
            lab_stream += ex["labels"] + end
        for start in range(0, len(ids_stream) - seq_len + 1, seq_len):
            chunk = ids_stream[start : start + seq_len]
            rows["input_ids"].append(chunk)
            rows["labels"].append(lab_stream[start : start + seq_len])
            rows["answers"].append([False] * seq_len)
            rows["position_ids"].append(document_positions(chunk, eos_id))
            rows["task"].append("")
    if not rows["input_ids"]:
        raise ValueError(f"the data holds fewer than seq_len={seq_len} tokens: no training row")
    out = datasets.Dataset.from_dict(rows)
    out.set_format("torch", columns=["input_ids", "labels", "answers", "position_ids"], output_all_columns=True)
    return out


def document_positions(ids: list[int], eos_id: int | None) -> list[int]:
    """Positions that restart at 0 after every EOS (the EOS ends its document)."""
    out, pos = [], 0
    for tok in ids:
        out.append(pos)
        pos = 0 if tok == eos_id else pos + 1
    return out


def _flush(rows, ids, labels, answers, positions, task, seq_len, pad_id):
    pad = seq_len - len(ids)
    rows["input_ids"].append(ids + [pad_id] * pad)
    rows["labels"].append(labels + [IGNORE] * pad)
    rows["answers"].append(answers + [False] * pad)
    rows["position_ids"].append(positions + list(range(pad)))  # the padding: a document of its own
    rows["task"].append(task)


def build_rows(paths, tokenizer, seq_len: int, text_field: str = "text", num_proc: int = 1, targets_only: bool = True):
    """files -> packed rows (the whole pipeline). Examples with ``targets`` keep their
    boundaries (one or more whole examples per row) whether or not the loss covers all tokens."""
    ds = load_files(paths)
    examples = "targets" in ds.column_names
    ds = tokenize(ds, tokenizer, text_field, num_proc, targets_only)
    return pack(ds, seq_len, tokenizer.pad_token_id, tokenizer.eos_token_id, examples)


def prepare_synthetic(
    sec, seq_len: int, vocab_size: int, tokenizer_path: str | None, rank: int, lengths=(), head: int = 0, tail: int = 0
) -> str:
    """Make sure ``sec.dir`` holds the synthetic dataset for these settings (rank 0 writes it,
    atomically, with the tokenizer its lengths were measured with, under ``tokenizer/``): examples
    at seq_len and every curriculum length in ``lengths``, facts placed between ``head`` and
    ``tail`` tokens (nosa.train.synthetic)."""
    want = dict(
        version=4,
        seq_len=seq_len,
        tokenizer=tokenizer_path or f"byte-bpe-{vocab_size}",
        lengths=sorted(set(lengths) | {seq_len}),
        head=head,
        tail=tail,
        depth=list(sec.depth),
    )
    meta = read_meta(sec.dir) or {}
    same = all(meta.get(k) == v for k, v in want.items()) and all(
        meta.get(k) == v
        for k, v in dict(
            tasks=list(sec.tasks), train=sec.train_examples, heldout=sec.heldout_examples, seed=sec.seed
        ).items()
    )
    if rank == 0 and not same:
        if tokenizer_path:
            tok = load_tokenizer(tokenizer_path)
        else:
            sample = synthetic.make_split(list(synthetic.TASKS), 200, 4096, seed=sec.seed + 99)
            tok = train_tokenizer((ex["text"] for ex in sample), vocab_size, synthetic.RECALL_VALUES)
        # Examples as long as a row (less the BOS): one example per row, so its facts sit where
        # head and tail put them relative to the row's sink blocks and local window.
        synthetic.write_dataset(
            sec.dir,
            sec.tasks,
            sec.train_examples,
            sec.heldout_examples,
            seq_len,
            sec.seed,
            token_counter(tok),
            meta=want,
            extra=lambda d: tok.save_pretrained(os.path.join(d, "tokenizer")),
            lengths=list(lengths),
            reserve=int(tok.bos_token_id is not None),  # tokenize() puts BOS in front
            head=head,
            tail=tail,
            depth=tuple(sec.depth),
        )
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
    return sec.dir


def prepare_ruler(sec, seq_len: int, tokenizer_path: str, rank: int) -> str:
    """Make sure ``sec.dir`` holds RULER-style rows for these settings (nosa.train.ruler; rank 0
    writes them): examples of ``seq_len`` tokens with the tokenizer at ``tokenizer_path``."""
    want = dict(version=3, tokenizer=os.path.abspath(tokenizer_path), tasks=list(sec.tasks), length=seq_len,
                train=sec.train_examples, heldout=sec.heldout_examples, seed=sec.seed, style=sec.style,
                prose_rows=sec.prose_rows)
    meta = read_meta(sec.dir) or {}
    before = {"style": "suite", "prose_rows": 0}  # rows written before these settings existed
    if rank == 0 and any(meta.get(k, before.get(k)) != v for k, v in want.items()):
        ruler.write_training_set(sec.dir, load_tokenizer(tokenizer_path), sec.tasks, seq_len, sec.train_examples,
                                 sec.heldout_examples, sec.seed, meta=want, style=sec.style,
                                 prose_rows=sec.prose_rows)
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
    return sec.dir


def batch_at(
    rows, step: int, micro: int, grad_accum: int, micro_batch: int, rank: int, world: int, seed: int
) -> dict[str, torch.Tensor]:
    """The micro batch of (optimizer step, micro step, rank): input_ids/labels/position_ids
    [micro_batch, seq_len] (position_ids: see the module docstring)."""
    n = len(rows)
    first = ((step * grad_accum + micro) * world + rank) * micro_batch
    index = []
    for g in range(first, first + micro_batch):
        epoch, pos = divmod(g, n)
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 7919 + epoch))
        index.append(int(perm[pos]))
    batch = rows[index]
    return {k: batch[k] for k in ("input_ids", "labels", "answers", "position_ids")}
