"""Synthetic long-context tasks (``TASKS``): typed key-value recall (``recall``, the default), passkey
retrieval, multi-key needles, multi-query associative recall with names (``mqar``) and variable tracking.

In ``recall`` a value is ONE token that names its key (``K7`` belongs to ``K``; ``RECALL_VALUES``
join the tokenizer as whole tokens): one attention hop by content, which a 2-layer model learns in
minutes on a CPU. An example is ``{"task", "text", "targets"}``: ``targets`` are the character
spans ``[start, end)`` of ``text`` to predict; lengths are measured with a callable (characters, or
a tokenizer's token count): at most ``length`` units. Every fact lies at or after ``head`` and ends
at least ``tail`` units before the question, at a ``depth`` in [0, 1] of the span between (with
``head = sink_blocks * block_size``, ``tail = window_blocks * block_size`` only the selection can
reach it). ``write_dataset`` writes train.jsonl (and train-<L>.jsonl per curriculum length),
heldout.jsonl (another random stream) and meta.json into a directory, atomically.
"""

from __future__ import annotations

import os
import random
from typing import Callable

from nosa.train import datadir

TASKS = ("recall", "passkey", "multikey", "mqar", "vartrack")
_CONS = "bdfgklmnprstvz"
_VOWELS = "aeiou"
# recall: single-letter keys; a key's values are the ten tokens <key><digit> (see the docstring)
RECALL_KEYS = "ABCDEFGHJKLMNPQRSTUVWXYZ"
RECALL_VALUES = tuple(f"{k}{d}" for k in RECALL_KEYS for d in "0123456789")
RECALL_PAIRS = 4  # facts per example, each at its own depth
RECALL_QUERIES = 4  # questions per example (every fact asked once, in random order)


# A fixed lexicon of three-syllable pseudo-words: a word's third syllable follows from its first
# two, so an LM loss on the filler rewards a previous-token head early, the first half of the
# induction circuit that retrieval needs.
_LEXICON = [
    "".join(r.choice(_CONS) + r.choice(_VOWELS) for _ in range(3))
    for r in (random.Random(f"lexicon:{i}") for i in range(256))
]


def _filler_words(rng: random.Random, pool: int = 2) -> list[str]:
    """One paragraph of ``pool`` lower-case sentences of lexicon words; the filler repeats it in
    order. An LM loss on the filler then rewards copying from earlier context (induction), the skill
    the retrieval answers need; the paragraph is new in every example, so nothing can be memorised.
    Lower case keeps the recall keys (capital letters) out of the filler."""
    words = []
    for _ in range(pool):
        sentence = [rng.choice(_LEXICON) for _ in range(rng.randint(4, 9))]
        sentence[-1] += "."
        words += sentence
    return words


def _digits(rng: random.Random, n: int) -> str:
    return "".join(rng.choice("0123456789") for _ in range(n))


def _names(rng: random.Random, n: int, size: int = 3) -> list[str]:
    names: set[str] = set()
    while len(names) < n:
        names.add("".join(rng.choice("ABCDEFGHJKLMNPQRSTUVWXYZ") for _ in range(size)))
    return sorted(names, key=lambda _: rng.random())


# Each task returns (facts, question parts): facts are pieces inserted into the filler at random
# depths (in order); the question is a list of (text, is_target) pieces appended at the end. Targets
# start with their leading space or are digits, so the tokenizer labels them whole.
def _recall(rng):
    keys = rng.sample(RECALL_KEYS, RECALL_PAIRS)
    vals = {k: k + rng.choice("0123456789") for k in keys}  # one token each (RECALL_VALUES)
    facts = [f"{vals[k]}." for k in keys]
    parts = [(" ?", False)]
    for k in rng.sample(keys, RECALL_QUERIES):
        parts += [(f" {k}", False), (vals[k], True)]  # " KK7": the answer token right after its key
    return facts, parts + [(".", False)]


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


_TASK_FNS = {"recall": _recall, "passkey": _passkey, "multikey": _multikey, "mqar": _mqar, "vartrack": _vartrack}


def make_example(
    task: str,
    length: int,
    seed,
    measure: Callable[[str], int] = len,
    head: int = 0,
    tail: int = 0,
    depth: tuple[float, float] = (0.0, 1.0),
) -> dict:
    """One example of ``task`` holding at most ``length`` units of ``measure``; its facts lie in
    ``[head, question start - tail)`` at ``depth`` (see the module docstring). Also returns
    ``facts``: the unit span ``[start, end)`` of every fact, and ``question``: where it starts."""
    if task not in _TASK_FNS:
        raise ValueError(f"unknown synthetic task {task!r}; known tasks are {list(TASKS)}")
    lo, hi = depth
    if not 0.0 <= lo <= hi <= 1.0:
        raise ValueError(f"depth={list(depth)}: expected [lo, hi] with 0 <= lo <= hi <= 1")
    rng = random.Random(f"{task}:{seed}")
    facts, question = _TASK_FNS[task](rng)
    paragraph = _filler_words(random.Random(f"filler:{seed}"))
    cost: dict[str, int] = {}

    def units(piece: str) -> int:  # every piece is joined with a leading space
        if piece not in cost:
            cost[piece] = measure(" " + piece)
        return cost[piece]

    q_text = "".join(part for part, _ in question)
    q_units = measure(q_text)
    fact_units = [units(f) for f in facts]
    room = length - q_units - sum(fact_units)  # units of filler
    filler, offsets, used = [], [], 0  # offsets[i]: filler units before word i
    while True:
        word = paragraph[len(filler) % len(paragraph)]
        if used + units(word) > room:
            break
        offsets.append(used)
        filler.append(word)
        used += units(word)
    offsets.append(used)
    # Fact i goes before filler word at[i]; in filler units it starts at offsets[at[i]], which must
    # lie in [head, used - tail] (the facts before it shift it and the question alike).
    first, last = head, used - tail
    inside = [i for i, off in enumerate(offsets) if first <= off <= last]
    if not inside:
        raise ValueError(
            f"synthetic task {task!r}: length={length} leaves no filler between head={head} and "
            f"tail={tail} (facts {sum(fact_units)} + question {q_units} units)"
        )
    lo_u, hi_u = first + lo * (last - first), first + hi * (last - first)
    slots = [i for i in inside if lo_u <= offsets[i] <= hi_u]
    if not slots:  # a narrow depth range between two word boundaries: the nearest one inside
        slots = [min(inside, key=lambda i: abs(offsets[i] - lo_u))]
    at = sorted(rng.choice(slots) for _ in facts)
    pieces, spans, pos, fi = [], [], 0, 0
    for slot, fact, n in zip(at, facts, fact_units):
        for word in filler[fi:slot]:
            pieces.append(word)
            pos += units(word)
        fi = max(fi, slot)
        pieces.append(fact)
        spans.append([pos, pos + n])
        pos += n
    for word in filler[fi:]:
        pieces.append(word)
        pos += units(word)
    text = "".join(" " + p for p in pieces)
    targets = []
    for part, is_target in question:
        if is_target:
            targets.append([len(text), len(text) + len(part)])
        text += part
    return {"task": task, "text": text, "targets": targets, "facts": spans, "question": pos}


def make_split(tasks, count: int, length: int, seed, measure=len, split: str = "", **placement) -> list[dict]:
    """``count`` examples cycling through ``tasks``; deterministic in (tasks, length, seed, split).
    ``placement``: head, tail, depth of make_example."""
    tag = f"{split}:" if split else ""
    return [
        make_example(tasks[i % len(tasks)], length, f"{tag}{seed * 1_000_003 + i}", measure, **placement)
        for i in range(count)
    ]


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
    lengths: list[int] = (),
    reserve: int = 0,
    **placement,
) -> str:
    """Write train.jsonl / heldout.jsonl (at ``length``), ``train-<L>.jsonl`` for every other L in
    ``lengths`` (curriculum stages) and meta.json into ``out_dir`` via a temp dir + rename;
    ``extra(tmp_dir)`` may add files (the tokenizer the lengths were measured with).
    ``placement`` (head, tail, depth) applies at ``length``; the shorter curriculum stages are a
    warm-up of the dense model and place facts anywhere (a short row has no room for sinks and a
    window, and a budget that covers the whole row selects everything anyway). Every example leaves
    ``reserve`` tokens of its length free (the BOS the training data puts in front of it)."""
    stages = [("train", train, length, "train", placement), ("heldout", heldout, length, "heldout", placement)]
    stages += [(f"train-{n}", train, n, "train", {}) for n in sorted(set(lengths) - {length})]
    files = ((name, make_split(list(tasks), count, n - reserve, seed, measure, split, **where))
             for name, count, n, split, where in stages)  # one file's rows in memory at a time
    info = dict(
        meta or {}, tasks=list(tasks), train=train, heldout=heldout, length=length, seed=seed, reserve=reserve,
        lengths=sorted(set(lengths) | {length}),
        **{k: list(v) if isinstance(v, tuple) else v for k, v in placement.items()},
    )
    return datadir.write(out_dir, files, info, extra)


def train_file(out_dir: str, length: int, final_length: int) -> str:
    """The training file of a curriculum stage at ``length`` tokens."""
    name = "train.jsonl" if length == final_length else f"train-{length}.jsonl"
    return os.path.join(out_dir, name)
