"""The long-context benchmark's two suites (scripts/bench_longctx.py --suite): the project's own
RULER-style tasks (nosa.train.ruler, over held-out prose) and NVIDIA's RULER (nvidia_ruler).

A suite makes the examples (``nosa.train.ruler.Example``: prompt ids, where the context ends, the
references, the reply's token limit), scores a reply in [0, 1] and says when a reply is settled
(more tokens cannot change its score, so decoding stops)."""

from __future__ import annotations

from nosa.bench.longctx import nvidia_ruler
from nosa.train import prose, ruler

SUITES = ("nosa", "ruler")
SEEDS = {"nosa": 0, "ruler": nvidia_ruler.SEED}  # the examples' default seeds


class NosaSuite:
    """The project's own tasks: exact match of every reference as whole words (ruler.is_right)."""

    name = "nosa"
    scoring = "exact match of every reference inside the normalised greedy reply (nosa.train.ruler.is_right)"

    def __init__(self, tasks=ruler.TASKS):
        unknown = [t for t in tasks if t not in ruler.TASKS]
        if unknown:
            raise ValueError(f"unknown tasks {unknown} of the nosa suite; known: {list(ruler.TASKS)}")
        self.tasks = tuple(tasks)
        self._haystack = None

    def examples(self, tokenizer, tokenizer_dir: str, length: int, count: int, seed: int) -> list:
        if self._haystack is None:
            _, heldout = prose.split(prose.documents(prose.FIXED_SOURCES))
            self._haystack = ruler.Haystack(tokenizer, [d.text for d in heldout])
        return [ex for task in self.tasks
                for ex in ruler.make_examples(tokenizer, self._haystack, task, length, count, seed)]

    def score(self, reply: str, ex) -> bool:
        return ruler.is_right(reply, ex.references)

    def settled(self, reply: str, ex) -> bool:
        return ruler.is_settled(reply, ex.references)


def make_suite(name: str, tasks=None, data_dir: str = "runs/ruler-data"):
    """The suite called ``name`` over ``tasks`` (None: all of its tasks); RULER keeps its generated
    rows under ``data_dir``."""
    if name == "nosa":
        return NosaSuite(*([tasks] if tasks else []))
    if name == "ruler":
        return nvidia_ruler.RulerSuite(tasks or nvidia_ruler.TASKS, data_dir=data_dir)
    raise ValueError(f"unknown suite {name!r}; known: {', '.join(SUITES)}")


def task_names(name: str) -> tuple[str, ...]:
    """The tasks of the suite called ``name`` (without reading RULER's wheel)."""
    return ruler.TASKS if name == "nosa" else nvidia_ruler.TASKS
