"""RULER-style long-context tasks over real prose, generated here (no downloads).

An example (``Example``) is one chat turn: an instruction, a haystack (held-out prose from
nosa.train.prose, or repeated filler for the passkey) with inserted sentences at random depths in
``DEPTH``, a question, and the start of the reply (RULER's answer prefix); ``references`` are the
strings a right reply contains. An example of ``length`` tokens has a prompt of at most ``length -
max_new_tokens`` tokens. Tasks (``TASKS``, after RULER, Hsieh et al. 2024): ``passkey``,
``niah_single``, ``niah_multikey``, ``niah_multivalue``, ``vt`` (variable tracking), ``qa``.
Training rows (``training_examples``) come in two styles (``STYLES``): ``suite``, the suite's own
phrasings (what the fitted heads were trained on), or ``train``, phrasings that neither the suite nor
NVIDIA's RULER uses (other needles, questions, names, a prose haystack for the passkey), for a
fine-tune evaluated on them. Scoring (``is_right``): reply and references normalised (lower case,
"1,234" -> "1234", other non-alphanumerics spaces); right when every reference occurs in the reply as whole words.
``is_settled`` says when no continuation can change that verdict.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
from dataclasses import asdict, dataclass

from nosa.chat import chat_text
from nosa.train import datadir, prose

TASKS = ("passkey", "niah_single", "niah_multikey", "niah_multivalue", "vt", "qa")
STYLES = ("suite", "train")  # training rows phrased as the suite's, or as neither benchmark's (module docstring)
DEPTH = (0.1, 0.9)
# Sizes and wording measured on the dense 135M model at 2K (a few examples each): the passkey and
# qa questions say what to answer with (without it the model explained what a pass key is, 0 of 4);
# 4 values per key (RULER's) and 2-hop chains left it at 0 of 3; with 2 values and 1 hop it still
# rarely answers (it lists one value and variations of it), and docs/real-models.md says so.
KEYS = 4  # niah_multikey: needles in all, one asked
VALUES = 2  # niah_multivalue: values of the one key, all asked
VT_HOPS = 1  # assignments after the value: VT_HOPS + 1 variables to name
PASSKEY_FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
MAX_NEW_TOKENS = {"passkey": 12, "niah_single": 16, "niah_multikey": 16, "niah_multivalue": 32, "vt": 24, "qa": 12}

# Words for keys, names and objects: plain English, none of them frequent in Python documentation.
ADJECTIVES = ("amber", "brave", "calm", "dusty", "eager", "faint", "gentle", "hollow", "icy", "jolly", "keen",
              "lively", "misty", "noble", "odd", "proud", "quiet", "rapid", "shy", "tidy", "upbeat", "vivid",
              "wary", "young", "zesty", "bold", "crisp", "damp", "fierce", "glossy", "humble", "lucky")
NOUNS = ("badger", "canyon", "dolphin", "ember", "falcon", "glacier", "harbor", "island", "jaguar", "kettle",
         "lantern", "meadow", "nectar", "orchard", "pebble", "quarry", "raven", "saddle", "tulip", "valley",
         "walrus", "willow", "acorn", "beacon", "cobalt", "daisy", "feather", "garnet", "hazel", "ivory",
         "juniper", "lagoon")
NAMES = ("Ada", "Boris", "Clara", "Dmitri", "Elena", "Farid", "Greta", "Hugo", "Ingrid", "Jonas", "Keiko",
         "Lars", "Mira", "Nadia", "Omar", "Priya", "Quentin", "Rosa", "Stefan", "Tara")
OBJECTS = ("lantern", "compass", "violin", "telescope", "teapot", "hammer", "notebook", "umbrella", "camera",
           "kite", "clock", "mirror")
COLOURS = ("red", "green", "blue", "yellow", "purple", "orange", "white", "black", "silver", "golden")
CONTAINERS = ("chest", "drawer", "basket", "cupboard", "suitcase", "box", "bag", "crate", "jar", "cabinet")


@dataclass(frozen=True)
class Example:
    task: str
    length: int  # prompt + reply fit in this many tokens
    index: int
    prompt_ids: tuple[int, ...]
    context_end: int  # prompt_ids[:context_end] = chat template + instruction + haystack; the rest is the question
    references: tuple[str, ...]
    max_new_tokens: int
    depths: tuple[float, ...]  # where the inserted sentences went (share of the haystack's sentences)

    def digest(self) -> str:
        """sha256 of everything that defines the example's answer (prompt, references, reply length)."""
        body = json.dumps([self.task, list(self.prompt_ids), list(self.references), self.max_new_tokens])
        return hashlib.sha256(body.encode()).hexdigest()

    def to_dict(self) -> dict:
        out = asdict(self)
        out["prompt_ids"] = list(self.prompt_ids)
        return out


def normalise(text: str) -> str:
    text = re.sub(r"(?<=\d),(?=\d)", "", text.lower())
    return " ".join(re.sub(r"[^a-z0-9]+", " ", text).split())


def is_right(reply: str, references) -> bool:
    """Every reference occurs in the reply as whole words, after ``normalise`` (module docstring)."""
    padded = f" {normalise(reply)} "
    return all(f" {normalise(r)} " in padded for r in references)


def is_settled(reply: str, references) -> bool:
    """The reply is right whatever text follows it, so decoding can stop: right now and still right
    with a letter, a digit or a comma and a digit after it (only its last, unfinished word and a
    comma between digits could join what follows)."""
    return all(is_right(reply + tail, references) for tail in ("", "a", "0", ",0"))


class Haystack:
    """Prose as a ring of sentences with their token counts, to cut haystacks from; without the
    sentences that share a run of ``prose.SHARED_WORDS`` words with any of ``exclude``."""

    def __init__(self, tokenizer, texts: list[str], exclude: list[str] = ()):
        self.sentences = [s for text in texts for s in prose.sentences(text)]
        if exclude:
            seen = set().union(*(prose.word_grams(t) for t in exclude))
            self.sentences = [s for s in self.sentences if not prose.word_grams(s) & seen]
        if not self.sentences:
            raise ValueError("Haystack: no sentences in the given texts")
        counts = tokenizer([" " + s for s in self.sentences], add_special_tokens=False)["input_ids"]
        self.tokens = [len(c) for c in counts]

    def take(self, rng: random.Random, tokens: int) -> list[str]:
        """Consecutive sentences (wrapping around) from a random start, about ``tokens`` tokens."""
        i, out, total = rng.randrange(len(self.sentences)), [], 0
        while total < tokens:
            out.append(self.sentences[i])
            total += self.tokens[i]
            i = (i + 1) % len(self.sentences)
        return out


def make_examples(tokenizer, haystack: Haystack, task: str, length: int, count: int, seed: int) -> list[Example]:
    """``count`` examples of ``task`` at ``length`` tokens; example i depends only on (seed, task,
    length, i), so a larger count extends a smaller one."""
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; known: {list(TASKS)}")
    return [_render(tokenizer, haystack, task, length, i, random.Random(f"{seed}/{task}/{length}/{i}"))[0]
            for i in range(count)]


def _render(tokenizer, haystack: Haystack, task: str, length: int, index: int,
            rng: random.Random, style: str = "suite") -> tuple[Example, str]:
    """(the example, its prompt as text)."""
    instruction, needles, question, prefix, references = _BUILDERS[style][task](rng)
    max_new = MAX_NEW_TOKENS[task]
    budget = length - max_new

    def render(filler: list[str]) -> tuple[str, int]:
        body = list(filler)
        for depth, needle in sorted(zip(depths, needles), reverse=True):
            body.insert(round(depth * len(filler)), needle)
        hay = " ".join(body)
        text = chat_text(tokenizer, f"{instruction}\n\n{hay}\n\n{question}") + prefix
        return text, text.index(hay) + len(hay)

    depths = sorted(rng.uniform(*DEPTH) for _ in needles)
    overhead = len(tokenizer(render([])[0], add_special_tokens=False)["input_ids"])
    if task == "passkey" and style == "suite":  # RULER's repeated filler; the train style hides it in prose
        unit = PASSKEY_FILLER.split(". ")
        per = len(tokenizer(" " + PASSKEY_FILLER, add_special_tokens=False)["input_ids"]) / len(unit)
        filler = [unit[i % len(unit)].rstrip(".") + "." for i in range(int((budget - overhead) / per) + 1)]
    else:
        filler = haystack.take(rng, budget - overhead + 64)  # tokens of a join can fall below the sum
    while True:  # cut words off the end of the haystack until the prompt fits
        text, hay_end = render(filler)
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        excess = len(enc["input_ids"]) - budget
        if excess <= 0:
            break
        words = filler[-1].split()
        cut = max(1, int(excess / 3))  # a third of the excess in words: prose rarely runs 3 tokens a word
        filler = filler[:-1] + ([" ".join(words[:-cut])] if cut < len(words) else [])
    context_end = sum(1 for start, _ in enc["offset_mapping"] if start < hay_end)
    example = Example(task, length, index, tuple(enc["input_ids"]), context_end, tuple(references), max_new,
                      tuple(round(d, 4) for d in depths))
    return example, text


def training_examples(tokenizer, haystack: Haystack, tasks, length: int, count: int, seed: int | str,
                      style: str = "suite", prose_rows: int = 0) -> list[dict]:
    """``count`` examples per task at ``length`` tokens, built like ``make_examples``'s in ``style``
    (``STYLES``; over the prose of ``haystack``: the training documents, so the benchmark's held-out
    prose stays unseen) and answered: ``{"text", "targets", "task"}``, the text being the prompt, the
    reference reply (``reference_reply``) and the end of the turn; ``targets`` the character span of
    reply and end (nosa.train.data's supervised format). Example i of every task comes before example
    i + 1 of any. Then ``prose_rows`` rows of plain prose from ``haystack`` (task ``prose``), every
    token a target: language modelling beside the tasks. Their random stream is not the benchmark's."""
    unknown = [t for t in tasks if t not in TASKS]
    if unknown:
        raise ValueError(f"unknown task {unknown[0]!r}; known: {list(TASKS)}")
    if style not in STYLES:
        raise ValueError(f"unknown style {style!r}; known: {list(STYLES)}")
    stream = "train" if style == "suite" else f"train-{style}"  # the suite style's rows as they always were
    out = []
    for i in range(count):  # round robin over the tasks: the first n rows cover every task
        for task in tasks:
            rng = random.Random(f"{stream}/{seed}/{task}/{length}/{i}")
            ex, prompt = _render(tokenizer, haystack, task, length, i, rng, style)
            answer = reference_reply(ex.references) + tokenizer.eos_token
            out.append({"text": prompt + answer, "targets": [[len(prompt), len(prompt) + len(answer)]], "task": task})
    for i in range(prose_rows):
        text = " ".join(haystack.take(random.Random(f"{stream}/{seed}/prose/{length}/{i}"), length))
        out.append({"text": text, "targets": [[0, len(text)]], "task": "prose"})  # cut to its last `length` tokens
    return out


def write_training_set(out_dir: str, tokenizer, tasks, length: int, train: int, heldout: int, seed: int,
                       meta: dict | None = None, style: str = "suite", prose_rows: int = 0) -> str:
    """Write ``train.jsonl`` (``train`` examples per task over the training documents of
    nosa.train.prose), ``heldout.jsonl`` (``heldout`` per task over the held-out documents that the
    benchmark also uses, from another random stream than the benchmark's examples) and ``meta.json``
    (``meta`` and the arguments) into ``out_dir``, atomically (a temp dir, then a rename). ``style``
    and ``prose_rows``: ``training_examples``'s (the prose rows go into train.jsonl only)."""
    _, heldout_docs = prose.split(prose.documents(prose.FIXED_SOURCES))
    hays = {"train": training_haystack(tokenizer), "heldout": Haystack(tokenizer, [d.text for d in heldout_docs])}
    files = ((name, training_examples(tokenizer, hays[name], tasks, length, count,
                                      seed if name == "train" else f"heldout/{seed}", style,
                                      prose_rows if name == "train" else 0))
             for name, count in (("train", train), ("heldout", heldout)))
    info = dict(meta or {}, tasks=list(tasks), length=length, train=train, heldout=heldout, seed=seed, style=style,
                prose_rows=prose_rows)
    return datadir.write(out_dir, files, info)


def training_haystack(tokenizer) -> Haystack:
    """The training documents of nosa.train.prose, less every sentence that shares a run of words
    with the held-out documents the benchmark cuts its haystacks from (docstrings repeat
    boilerplate across packages: "if any other exception is raised, it is as if ...")."""
    train_docs, _ = prose.split(prose.documents())
    _, heldout_docs = prose.split(prose.documents(prose.FIXED_SOURCES))
    return Haystack(tokenizer, [d.text for d in train_docs], exclude=[d.text for d in heldout_docs])


def reference_reply(references) -> str:
    """The reply a training example teaches after the answer prefix: " 12345.", " red box.",
    " 1234567 and 7654321."."""
    return " " + " and ".join(references) + "."


def _number(rng: random.Random, digits: int) -> str:
    return str(rng.randrange(10 ** (digits - 1), 10**digits))


def _keys(rng: random.Random, n: int) -> list[str]:
    return [f"{a}-{b}" for a, b in zip(rng.sample(ADJECTIVES, n), rng.sample(NOUNS, n))]


_NIAH_INSTRUCTION = ("Some special magic numbers are hidden within the following text. Make sure to memorize it. "
                     "I will quiz you about the numbers afterwards.")


def _passkey(rng):
    key = _number(rng, 5)
    return ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
            "I will quiz you about the important information there.",
            [f"The pass key is {key}. Remember it. {key} is the pass key."],
            "What is the pass key? Answer with the number.", "The pass key is", [key])


def _niah(rng, keys: int, values: int):
    names = _keys(rng, keys)
    numbers = [_number(rng, 7) for _ in range(keys * values)]
    needles = [f"One of the special magic numbers for {names[i % keys]} is: {n}." for i, n in enumerate(numbers)]
    rng.shuffle(needles)  # the asked key at any of the depths
    asked = names[0]
    if values > 1:
        return (_NIAH_INSTRUCTION, needles,
                f"What are all the special magic numbers for {asked} mentioned in the provided text?",
                f"The special magic numbers for {asked} mentioned in the provided text are", numbers)
    return (_NIAH_INSTRUCTION, needles, f"What is the special magic number for {asked} mentioned in the provided text?",
            f"The special magic number for {asked} mentioned in the provided text is", [numbers[0]])


def _chain(rng, letters: int, digits: int, first: str, link: str) -> tuple[list[str], str, list[str]]:
    """vt's chain: (VT_HOPS + 1 names of ``letters`` capitals, a value of ``digits`` digits, the
    assignments: ``first`` of the value to the first name, then ``link`` of each name to the next)."""
    names = ["".join(rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(letters)) for _ in range(VT_HOPS + 1)]
    value = _number(rng, digits)
    return names, value, [first.format(a=names[0], v=value)] + [link.format(a=a, b=b) for a, b in zip(names, names[1:])]


def _vt(rng):
    names, value, needles = _chain(rng, 5, 5, "VAR {a} = {v}.", "VAR {b} = VAR {a}.")
    return ("Memorize and track the chain of variable assignments hidden in the following text.", needles,
            f"Question: Find all variables that are assigned the value {value} in the text above.",
            f"Answer: According to the chain of variable assignments in the text above, {len(names)} variables "
            f"are assigned the value {value}, they are:", names)


def _qa(rng):
    name, thing = rng.choice(NAMES), rng.choice(OBJECTS)
    place = f"{rng.choice(COLOURS)} {rng.choice(CONTAINERS)}"
    return ("Answer the question based on the following text.", [f"{name} keeps the {thing} in the {place}."],
            f"Where does {name} keep the {thing}? Answer with the place.", f"{name} keeps the {thing} in the", [place])


# The train style: the same tasks and sizes, other words (6-digit codes instead of RULER's 7-digit
# numbers and 5-digit pass keys, "Let X be Y" instead of "VAR X = Y", keys without RULER's hyphen).


def _own_passkey(rng):
    key = _number(rng, 6)
    return ("An access code is buried in the passage below. Look for it and keep it in mind.",
            [f"The access code is {key}; keep the access code {key} in mind."],
            "What is the access code? Reply with the code.", "The access code is", [key])


def _own_niah(rng, keys: int, values: int):
    names = [k.replace("-", " ") for k in _keys(rng, keys)]
    codes = [_number(rng, 6) for _ in range(keys * values)]
    needles = [f"The secret code of the {names[i % keys]} is {c}." for i, c in enumerate(codes)]
    rng.shuffle(needles)
    asked = names[0]
    instruction = "The passage below hides secret codes among its sentences. Questions about the codes follow it."
    if values > 1:
        return (instruction, needles, f"List every secret code of the {asked}.",
                f"The secret codes of the {asked} are", codes)
    return (instruction, needles, f"Which secret code belongs to the {asked}?",
            f"The secret code of the {asked} is", [codes[0]])


def _own_vt(rng):
    names, value, needles = _chain(rng, 4, 6, "Let {a} be {v}.", "Let {b} be {a}.")
    return ("Some names get values in the passage below, one from another. Follow them.", needles,
            f"Which names end up holding {value}?", f"The names holding {value} are", names)


def _own_qa(rng):
    name, thing = rng.choice(NAMES), rng.choice(OBJECTS)
    place = f"{rng.choice(COLOURS)} {rng.choice(CONTAINERS)}"
    return ("Read the passage below, then reply to the question after it.",
            [f"The {thing} that {name} owns sits in the {place}."],
            f"Where does the {thing} of {name} sit? Reply with the place.", f"The {thing} of {name} sits in the",
            [place])


def _builders(passkey, niah, vt, qa) -> dict:
    """A style's task builders: each takes a random stream, returns (instruction, needles, question,
    answer prefix, references)."""
    return {"passkey": passkey, "niah_single": lambda rng: niah(rng, 1, 1),
            "niah_multikey": lambda rng: niah(rng, KEYS, 1), "niah_multivalue": lambda rng: niah(rng, 1, VALUES),
            "vt": vt, "qa": qa}


_BUILDERS = {"suite": _builders(_passkey, _niah, _vt, _qa),
             "train": _builders(_own_passkey, _own_niah, _own_vt, _own_qa)}
