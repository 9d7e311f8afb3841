"""NVIDIA's RULER (the ``nvidia-long-context-eval`` wheel) as a suite of the long-context benchmark.

RULER's own generators write the examples: its 13 task configurations (``synthetic.yaml``), its
templates and answer prefixes (``data/synthetic/constants.py``), its data (Paul Graham's essays,
SQuAD, HotpotQA, all inside the wheel), run as scripts the way RULER's ``prepare.py`` runs them,
with the model's HF tokenizer. Its own metrics score the replies (``string_match_all``, and
``string_match_part`` for qa; ``eval/synthetic/constants.py``), on the reply cleaned as RULER's
``postprocess_pred`` cleans it.

What differs from a stock RULER run, and why:
- ``nltk.tokenize.sent_tokenize`` (niah's essay haystacks) is an untrained
  ``PunktSentenceTokenizer().tokenize``: the trained punkt data comes from nltk's downloader, which
  no package registry serves. It splits at the same ``. ? !`` boundaries but knows no abbreviations,
  so "Mr. Smith" becomes two sentences: needles may land after such a period.
- The model's own chat template wraps the task text (RULER's ``Templates`` has none for
  SmolLM2's ChatML); the answer prefix then opens the assistant's reply, as RULER appends it after
  its chat templates' assistant tag (its leading space dropped after the template's newline).
  A base model without a chat template (Gemma 3 270M) gets RULER's own ``base`` template: the
  model's ``<bos>``, the task text, the answer prefix, as stock RULER writes them.
- The generators are given the length minus the chat template's tokens, so that template, task
  text and the task's ``tokens_to_generate`` fit in the length. fwe's generator fills its text up to
  that limit without keeping room for the reply (stock RULER's fwe prompts run over the length by up
  to 50 tokens); where a task's rows run over, it is generated again with the limit lowered by the
  largest overrun.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass

from nosa.chat import chat_text, has_chat_template
from nosa.train.ruler import Example

SEED = 42  # RULER's prepare.py: random_seed 42 (+ the chunk index; one chunk here)
TASKS = ("niah_single_1", "niah_single_2", "niah_single_3", "niah_multikey_1", "niah_multikey_2",
         "niah_multikey_3", "niah_multivalue", "niah_multiquery", "vt", "cwe", "fwe", "qa_1", "qa_2")
# Where the question starts after the context, per generator (the text that follows {context} in
# its template; the last occurrence, since cwe's prompt holds a worked example first).
QUESTION_STARTS = {"niah": "\nWhat ", "variable_tracking": "\nQuestion: Find all",
                   "common_words_extraction": "\nQuestion: What are the", "freq_words_extraction": "\nQuestion: Do not",
                   "qa": "\n\nAnswer the question based on the given documents."}
# Marks the end of the task text and the start of the answer prefix in the generators' template. A
# word of its own: vt's few-shot example drops the word before the answer prefix (a chat template's
# closing tag in RULER's own runs), which is then this mark and nothing else.
_MARK = " \u241e"
# Run in a fresh interpreter: nltk's sent_tokenize replaced before the generator imports it, and
# the generator's folder on sys.path as `python script.py` would put it (it imports its siblings).
_BOOT = ("import sys, runpy, nltk.tokenize, nltk.tokenize.punkt as p; "
         "nltk.tokenize.sent_tokenize = p.PunktSentenceTokenizer().tokenize; "
         "script = sys.argv[1]; sys.argv = sys.argv[1:]; sys.path.insert(0, script.rsplit('/', 1)[0]); "
         "runpy.run_path(script, run_name='__main__')")


def package_dir() -> str:
    spec = importlib.util.find_spec("long_context_eval")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("RULER needs NVIDIA's generators: pip install 'nosa[real]' "
                         "(nvidia-long-context-eval==26.3), or run `bash scripts/setup.sh`")
    return list(spec.submodule_search_locations)[0]


@dataclass(frozen=True)
class TaskConfig:
    name: str  # e.g. niah_multikey_2
    generator: str  # the script under data/synthetic: niah, variable_tracking, ...
    args: dict  # synthetic.yaml's arguments of the configuration
    template: str  # the task text, with {context} and {query}
    answer_prefix: str
    tokens_to_generate: int
    metric: str  # string_match_all | string_match_part


def task_configs() -> dict[str, TaskConfig]:
    """RULER's 13 task configurations, read from the installed wheel."""
    import yaml  # optional: pyyaml (the train extra)

    root = package_dir()
    with open(os.path.join(root, "synthetic.yaml")) as f:
        custom = yaml.safe_load(f)
    constants = _load(os.path.join(root, "data", "synthetic", "constants.py"))["TASKS"]
    metrics = _load(os.path.join(root, "eval", "synthetic", "constants.py"))["TASKS"]
    out = {}
    for name in TASKS:
        base = constants[custom[name]["task"]]
        out[name] = TaskConfig(name, custom[name]["task"], dict(custom[name]["args"]), base["template"],
                               base.get("answer_prefix", ""), base["tokens_to_generate"],
                               metrics[custom[name]["task"]]["metric_fn"].__name__)
    return out


def _load(path: str) -> dict:
    """A module's globals by path (RULER's constants files are not importable as one package)."""
    spec = importlib.util.spec_from_file_location(f"_ruler_{abs(hash(path))}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return vars(module)


def rows_file(out_dir: str, task: str) -> str:
    """Where RULER's generator writes a task's rows under ``out_dir`` (its --save_dir)."""
    return os.path.join(out_dir, task, "validation.jsonl")


def generate(cfg: TaskConfig, tokenizer_dir: str, max_seq_length: int, count: int, seed: int,
             out_dir: str) -> list[dict]:
    """RULER's rows ({index, input, outputs, length}) of one task configuration, written by its own
    generator under ``out_dir`` (kept there: a second call reads them back)."""
    path = rows_file(out_dir, cfg.name)
    if not os.path.isfile(path):
        script = os.path.join(package_dir(), "data", "synthetic", f"{cfg.generator}.py")
        argv = [sys.executable, "-c", _BOOT, script, "--save_dir", out_dir, "--save_name", cfg.name,
                "--tokenizer_path", tokenizer_dir, "--tokenizer_type", "hf",
                "--max_seq_length", str(max_seq_length), "--tokens_to_generate", str(cfg.tokens_to_generate),
                "--num_samples", str(count), "--random_seed", str(seed),
                "--template", cfg.template + _MARK + cfg.answer_prefix]
        for key, value in cfg.args.items():
            argv += [f"--{key}", str(value)]
        env = dict(os.environ, TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
        done = subprocess.run(argv, capture_output=True, text=True, env=env)
        if done.returncode != 0 or not os.path.isfile(path):
            raise RuntimeError(f"RULER's {cfg.generator}.py failed for {cfg.name} at {max_seq_length} tokens "
                               f"(exit {done.returncode}):\n{done.stderr[-2000:]}")
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    if len(rows) != count:
        raise RuntimeError(f"RULER wrote {len(rows)} rows for {cfg.name} at {path}, expected {count}")
    return rows


def chat_overhead(tokenizer) -> int:
    """Tokens the chat template adds around a message (a base model: its <bos>)."""
    return len(tokenizer(_wrap(tokenizer, "", ""), add_special_tokens=False)["input_ids"])


def _wrap(tokenizer, user: str, prefix: str) -> str:
    """The prompt's text: the user's turn through the chat template, the answer prefix opening the
    reply (its leading space dropped after the template's newline); for a base model, RULER's
    ``base`` template: <bos>, the task text, the answer prefix."""
    if not has_chat_template(tokenizer):
        return (tokenizer.bos_token or "") + user + prefix
    return chat_text(tokenizer, user.strip()) + prefix.lstrip()


def to_example(tokenizer, cfg: TaskConfig, row: dict, length: int) -> Example:
    """One RULER row as the benchmark's example: the task text as the user's turn, the answer
    prefix opening the reply, and where the context ends (the question's first token after it)."""
    text = row["input"]
    head, _, prefix = text.rpartition(_MARK)
    if not head:
        raise ValueError(f"RULER row {cfg.name}/{row['index']}: the answer-prefix mark is missing from its input")
    user = head.replace(_MARK, "")  # cwe's worked example holds the mark too: RULER's base template there
    prompt = _wrap(tokenizer, user, prefix)
    question = prompt.rfind(QUESTION_STARTS[cfg.generator])
    if question < 0:
        raise ValueError(f"RULER row {cfg.name}/{row['index']}: no question after the context")
    enc = tokenizer(prompt, add_special_tokens=False, return_offsets_mapping=True)
    ids = enc["input_ids"]
    context_end = sum(1 for start, _ in enc["offset_mapping"] if start < question)
    return Example(cfg.name, length, row["index"], tuple(ids), context_end, tuple(str(o) for o in row["outputs"]),
                   cfg.tokens_to_generate, ())


def postprocess(reply: str) -> str:
    """RULER's postprocess_pred: stripped, control characters to newlines."""
    return re.sub(r"[\x00-\x1f]", "\n", reply.strip()).strip()


def score(metric: str, reply: str, references) -> float:
    """RULER's per-example score in [0, 1]: string_match_all, the share of references inside the
    reply; string_match_part, 1 if any is (case-insensitive substrings, as RULER matches)."""
    pred = postprocess(reply).lower()
    found = [r.lower() in pred for r in references]
    if metric == "string_match_all":
        return sum(found) / len(found)
    if metric == "string_match_part":
        return float(any(found))
    raise ValueError(f"unknown RULER metric {metric!r}")


class RulerSuite:
    """The benchmark's suite interface (see nosa.bench.longctx.suites) over NVIDIA's RULER."""

    name = "ruler"
    scoring = ("RULER's metrics on the greedy reply (postprocess_pred): string_match_all (share of the "
               "references inside the reply) for niah, vt, cwe and fwe; string_match_part (any) for qa")

    def __init__(self, tasks=TASKS, data_dir: str = "runs/ruler-data"):
        self.configs = task_configs()
        unknown = [t for t in tasks if t not in self.configs]
        if unknown:
            raise ValueError(f"unknown RULER tasks {unknown}; known: {list(TASKS)}")
        self.tasks = tuple(tasks)
        self.data_dir = data_dir

    def examples(self, tokenizer, tokenizer_dir: str, length: int, count: int, seed: int) -> list[Example]:
        from tqdm import tqdm  # optional: tqdm (the train extra)

        limit = length - chat_overhead(tokenizer) - 2  # the mark's tokens count in the generator's limit
        digest = _tokenizer_digest(tokenizer_dir)
        out = []
        # a bar while RULER's generators write rows (each a fresh interpreter: seconds to minutes a
        # task); rows written before are read back at once and show none
        first_try = os.path.join(self.data_dir, digest, f"{length}-seed{seed}-n{count}")
        todo = [t for t in self.tasks if not os.path.isfile(rows_file(first_try, t))]
        bar = tqdm(total=len(todo), desc=f"RULER rows at {length}", unit="task", dynamic_ncols=True,
                   disable=not todo)
        for task in self.tasks:
            cfg, cut = self.configs[task], 0
            bar.set_postfix_str(task, refresh=task in todo)
            for _ in range(3):
                name = f"{length}-seed{seed}-n{count}" + (f"-cut{cut}" if cut else "")
                where = os.path.join(self.data_dir, digest, name)
                rows = [to_example(tokenizer, cfg, row, length)
                        for row in generate(cfg, tokenizer_dir, limit - cut, count, seed, where)]
                over = max(len(ex.prompt_ids) + ex.max_new_tokens - length for ex in rows)
                if over <= 0:
                    break
                cut += over
            else:
                raise RuntimeError(f"RULER's {cfg.name} rows still run {over} tokens over {length} "
                                   f"with the generator's limit cut by {cut}")
            out += rows
            bar.update(task in todo)
        bar.close()
        return out

    def score(self, reply: str, ex: Example) -> float:
        return score(self.configs[ex.task].metric, reply, ex.references)

    def settled(self, reply: str, ex: Example) -> bool:
        """Substrings stay inside a reply that grows: at the full score, more tokens change nothing."""
        return self.score(reply, ex) == 1.0


def _tokenizer_digest(tokenizer_dir: str) -> str:
    h = hashlib.sha256()
    for name in sorted(os.listdir(tokenizer_dir)):
        if name.startswith("tokenizer") or name in ("special_tokens_map.json", "vocab.json", "merges.txt"):
            with open(os.path.join(tokenizer_dir, name), "rb") as f:
                h.update(name.encode() + f.read())
    return h.hexdigest()[:16]
