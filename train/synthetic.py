"""Synthetic long-context tasks: passkey retrieval, multi-key needles, multi-query associative
recall (MQAR) and variable tracking.

An example is ``{"task", "text", "targets"}``: ``targets`` are character spans ``[start, end)`` of
``text`` that the model must predict (the answers); everything else is context. The length is
measured with a callable (characters by default, a tokenizer's token count when one is given) and
the filler is sized so that the example holds ``length`` units, give or take a few.

``write_dataset`` writes ``train.jsonl`` and ``heldout.jsonl`` (different seeds) plus
``meta.json`` into a directory, atomically.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from typing import Callable

TASKS = ("passkey", "multikey", "mqar", "vartrack")
_CONS = "bdfgklmnprstvz"
_VOWELS = "aeiou"


def _word(rng: random.Random) -> str:
    return "".join(rng.choice(_CONS) + rng.choice(_VOWELS) for _ in range(rng.randint(1, 3)))


def _filler(rng: random.Random, words: int, pool: int = 6) -> list[str]:
    """A paragraph of ``pool`` sentences of pseudo-words, repeated in order. An LM loss on the filler
    then rewards copying from earlier context (induction), the skill the retrieval answers need;
    the paragraph is new in every example, so nothing can be memorised."""
    sentences = [" ".join(_word(rng) for _ in range(rng.randint(4, 9))).capitalize() + "." for _ in range(pool)]
    out, left, i = [], words, 0
    while left > 0:
        sentence = sentences[i % pool]
        out.append(sentence)
        left -= sentence.count(" ") + 1
        i += 1
    return out


def _digits(rng: random.Random, n: int) -> str:
    return "".join(rng.choice("0123456789") for _ in range(n))


def _names(rng: random.Random, n: int, size: int = 3) -> list[str]:
    names: set[str] = set()
    while len(names) < n:
        names.add("".join(rng.choice("ABCDEFGHJKLMNPQRSTUVWXYZ") for _ in range(size)))
    return sorted(names, key=lambda _: rng.random())


# Each task returns (facts, question parts): facts are sentences inserted into the filler at random
# depths (in order); the question is a list of (text, is_target) pieces appended at the end. Targets
# start with their leading space, so a tokenizer that glues the space to the word labels it whole.
def _passkey(rng):
    key = _digits(rng, 5)
    question = [(" What is the pass key? The pass key is", False), (f" {key}", True), (".", False)]
    return [f"The pass key is {key}. Remember it."], question


def _multikey(rng):
    names = _names(rng, 4)
    keys = {n: _digits(rng, 5) for n in names}
    facts = [f"The key of {n} is {keys[n]}." for n in names]
    asked = rng.sample(names, 2)
    parts = []
    for n in asked:
        parts += [(f" The key of {n} is", False), (f" {keys[n]}", True), (".", False)]
    return facts, parts


def _mqar(rng):
    names = _names(rng, 8)
    vals = {n: _digits(rng, 2) for n in names}
    facts = [f"{n}={vals[n]}." for n in names]
    parts = []
    for n in rng.sample(names, 6):
        parts += [(f" {n}=", False), (vals[n], True), (".", False)]
    return facts, parts


def _vartrack(rng):
    names = _names(rng, 5)
    value = _digits(rng, 5)
    chain = names[:3]
    facts = [f"VAR {chain[0]} = {value}."]
    facts += [f"VAR {b} = VAR {a}." for a, b in zip(chain, chain[1:])]
    facts += [f"VAR {n} = {_digits(rng, 5)}." for n in names[3:]]
    rng.shuffle(facts[3:])
    answer = " ".join(chain)
    return facts, [(f" Which variables equal {value}? They are", False), (f" {answer}", True), (".", False)]


_TASK_FNS = {"passkey": _passkey, "multikey": _multikey, "mqar": _mqar, "vartrack": _vartrack}


def make_example(task: str, length: int, seed: int, measure: Callable[[str], int] = len) -> dict:
    """One example of ``task`` holding about ``length`` units of ``measure`` (never more)."""
    if task not in _TASK_FNS:
        raise ValueError(f"unknown synthetic task {task!r}; known tasks are {list(TASKS)}")
    words = max(8, length // 6)
    for _ in range(12):
        ex = _render(task, seed, words)
        n = measure(ex["text"])
        if n <= length and n >= 0.97 * length:
            return ex
        words = max(8, int(words * (length / max(n, 1)) * (0.99 if n > length else 1.0)))
    while measure(ex["text"]) > length and words > 8:
        words = max(8, int(words * 0.95))
        ex = _render(task, seed, words)
    return ex


def _render(task: str, seed: int, words: int) -> dict:
    rng = random.Random(f"{task}:{seed}")
    facts, question = _TASK_FNS[task](rng)
    filler = _filler(random.Random(f"filler:{seed}"), words)
    # Facts at random depths in the first 90% of the context, in their given order.
    slots = sorted(rng.randrange(0, max(1, int(len(filler) * 0.9)) + 1) for _ in facts)
    pieces, fi = [], 0
    for pos, fact in zip(slots, facts):
        pieces += filler[fi:pos] + [fact]
        fi = max(fi, pos)
    pieces += filler[fi:]
    text = " ".join(pieces)
    targets = []
    for part, is_target in question:
        if is_target:
            targets.append([len(text), len(text) + len(part)])
        text += part
    return {"task": task, "text": text, "targets": targets}


def make_split(tasks, count: int, length: int, seed: int, measure=len) -> list[dict]:
    """``count`` examples cycling through ``tasks``; deterministic in (tasks, length, seed)."""
    return [make_example(tasks[i % len(tasks)], length, seed * 1_000_003 + i, measure) for i in range(count)]


def write_dataset(
    out_dir: str,
    tasks,
    train: int,
    heldout: int,
    length: int,
    seed: int,
    measure=len,
    meta: dict | None = None,
    extra: Callable[[str], None] | None = None,
) -> str:
    """Write train.jsonl / heldout.jsonl / meta.json into ``out_dir`` via a temp dir + rename;
    ``extra(tmp_dir)`` may add files (the tokenizer the lengths were measured with)."""
    tmp = f"{out_dir.rstrip('/')}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        for name, count, split_seed in (("train", train, seed), ("heldout", heldout, seed + 1)):
            with open(os.path.join(tmp, f"{name}.jsonl"), "w") as f:
                for ex in make_split(list(tasks), count, length, split_seed, measure):
                    f.write(json.dumps(ex) + "\n")
        if extra is not None:
            extra(tmp)
        info = dict(meta or {}, tasks=list(tasks), train=train, heldout=heldout, length=length, seed=seed)
        with open(os.path.join(tmp, "meta.json"), "w") as f:
            json.dump(info, f, indent=1, sort_keys=True)
        if os.path.isdir(out_dir):
            shutil.rmtree(out_dir)
        os.makedirs(os.path.dirname(os.path.abspath(out_dir)), exist_ok=True)
        os.rename(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def read_meta(out_dir: str) -> dict | None:
    path = os.path.join(out_dir, "meta.json")
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f)
