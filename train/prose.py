"""English prose that ships with Python and its installed packages, as documents (no downloads).

    python -m nosa.train.prose --out data/prose        # writes train.jsonl and heldout.jsonl

Sources (every document has a stable key ``source:name``): ``topics`` (``pydoc_data.topics``, one
document per topic), ``docstrings`` (the standard library's docstrings of at least
``MIN_DOCSTRING`` characters, read with ``ast``, one document per module) and ``licences`` (the
installed distributions' licence files, deduplicated; they depend on what is installed, so the
benchmark leaves them out: ``FIXED_SOURCES``). Only prose paragraphs are kept (no indented lines,
no heading underlines). Split by document: held out when ``sha256(key) mod 100 <
heldout_percent``, so installing a package never moves another document across the split.
"""

from __future__ import annotations

import argparse
import ast
import functools
import hashlib
import importlib.metadata
import json
import os
import re
import sys
import sysconfig
from dataclasses import dataclass
from pydoc_data.topics import topics

SOURCES = ("topics", "docstrings", "licences")
FIXED_SOURCES = ("topics", "docstrings")  # the same on every install of one CPython version
HELDOUT_PERCENT = 20
MIN_DOCSTRING = 300  # characters; shorter docstrings are mostly one-line summaries
MIN_PARAGRAPH = 40  # characters; shorter paragraphs are headings or labels
# Standard-library folders that hold tests, tools, build files or vendored code rather than documented
# modules (the build files live in config-<version>-<platform>).
SKIP_DIRS = {"test", "tests", "idlelib", "site-packages", "__pycache__", "lib2to3", "turtledemo", "ensurepip",
             "tkinter"}
LICENCE_PREFIXES = ("LICENSE", "LICENCE", "COPYING")


@dataclass(frozen=True)
class Document:
    key: str  # "source:name", stable across runs
    text: str  # prose paragraphs separated by blank lines


def prose(text: str) -> str:
    """The prose paragraphs of ``text`` (see the module docstring), separated by blank lines."""
    keep = []
    for para in re.split(r"\n\s*\n", text):
        lines = [ln for ln in para.split("\n") if ln.strip()]
        if not lines or any(ln[:1].isspace() for ln in lines):
            continue
        if any(re.fullmatch(r"[*=\-~^#_+.\s]{3,}", ln) for ln in lines):  # headings and rules
            continue
        joined = " ".join(ln.strip() for ln in lines)
        if len(joined) >= MIN_PARAGRAPH:
            keep.append(joined)
    return "\n\n".join(keep)


SHARED_WORDS = 8  # a run of this many words in two texts: one text shares the other's prose


def words(text: str) -> list[str]:
    """The words of ``text`` as ``word_grams`` counts them: lower case, letters and digits only."""
    return re.findall(r"[a-z0-9]+", text.lower())


def word_grams(text: str, n: int = SHARED_WORDS) -> set[str]:
    """The runs of ``n`` consecutive words of ``text`` (``words``)."""
    w = words(text)
    return {" ".join(w[i : i + n]) for i in range(len(w) - n + 1)}


def documents(sources: tuple[str, ...] = SOURCES) -> list[Document]:
    """Non-empty prose documents of ``sources``, sorted by key (deterministic on one install).
    Read once per process (parsing the installed docstrings takes seconds); each call gets its own list."""
    unknown = sorted(set(sources) - set(SOURCES))
    if unknown:
        raise ValueError(f"prose: unknown source(s) {unknown}; known: {list(SOURCES)}")
    return list(_read(tuple(sources)))


@functools.cache
def _read(sources: tuple[str, ...]) -> tuple[Document, ...]:
    readers = {"topics": _topics, "docstrings": _docstrings, "licences": _licences}
    docs = []
    for source in sources:
        for name, text in readers[source]():
            body = prose(text)
            if body:
                docs.append(Document(f"{source}:{name}", body))
    return tuple(sorted(docs, key=lambda d: d.key))


def is_heldout(key: str, heldout_percent: int = HELDOUT_PERCENT) -> bool:
    return int(hashlib.sha256(key.encode()).hexdigest(), 16) % 100 < heldout_percent


def split(docs: list[Document], heldout_percent: int = HELDOUT_PERCENT) -> tuple[list[Document], list[Document]]:
    """(training, held-out) documents; see the module docstring."""
    train = [d for d in docs if not is_heldout(d.key, heldout_percent)]
    heldout = [d for d in docs if is_heldout(d.key, heldout_percent)]
    return train, heldout


def write_jsonl(path: str, docs: list[Document]) -> str:
    """One ``{"text", "key"}`` object per line, the format ``data.train_files`` reads."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        for d in docs:
            f.write(json.dumps({"text": d.text, "key": d.key}) + "\n")
    os.replace(tmp, path)
    return path


def token_windows(tokenizer, docs: list[Document], length: int, count: int) -> list[list[int]]:
    """``count`` consecutive windows of ``length`` token ids of ``docs`` joined by blank lines, each
    starting with the tokenizer's BOS where it has one (Gemma needs it); ValueError when the documents
    hold fewer tokens than that."""
    stream = tokenizer("\n\n".join(d.text for d in docs), add_special_tokens=False)["input_ids"]
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    step = length - len(bos)
    if count * step > len(stream):
        raise ValueError(f"the held-out prose has {len(stream)} tokens, fewer than {count} windows of {length}")
    return [bos + stream[w * step:(w + 1) * step] for w in range(count)]


def sentences(text: str) -> list[str]:
    """Sentences of a prose text: split after ., ! or ? followed by space and a capital, a quote or a
    parenthesis. Good enough to place inserted sentences between two sentences of real prose."""
    return [s for s in re.split(r"(?<=[.!?])\s+(?=[A-Z\"'(])", text.replace("\n\n", " ")) if s.strip()]


def _topics():
    return sorted(topics.items())


def _stdlib_files() -> tuple[str, list[str]]:
    """(the standard library's folder, its .py files read for docstrings, in a fixed order)."""
    lib = sysconfig.get_paths()["stdlib"]
    paths = []
    for root, dirs, files in os.walk(lib):
        dirs[:] = sorted(d for d in dirs if d not in SKIP_DIRS and not d.startswith("config-"))
        paths += [os.path.join(root, name) for name in sorted(files) if name.endswith(".py")]
    return lib, paths


def _docstring_cache(lib: str, paths: list[str]) -> str:
    """A file for the parsed docstrings, named by what they are read from (the files' paths, sizes and
    times, and the MIN_DOCSTRING cut): every training run, benchmark and test process parses them
    otherwise (seconds each)."""
    digest = hashlib.sha256(f"{lib} {MIN_DOCSTRING}".encode())
    for path in paths:
        st = os.stat(path)
        digest.update(f"{path} {st.st_size} {st.st_mtime_ns}\n".encode())
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(root, "nosa", "prose", f"docstrings-{digest.hexdigest()[:16]}.json")


@functools.lru_cache(maxsize=1)  # parsing the standard library takes seconds; it does not change
def _docstrings() -> tuple[tuple[str, str], ...]:
    lib, paths = _stdlib_files()
    cache = _docstring_cache(lib, paths)
    try:
        with open(cache) as f:
            return tuple((module, text) for module, text in json.load(f))
    except (OSError, ValueError):
        pass
    found = []
    for path in paths:
        try:
            with open(path, encoding="utf-8") as f:
                tree = ast.parse(f.read())
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        parts = []
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc and len(doc) >= MIN_DOCSTRING:
                    parts.append(doc)
        if parts:
            module = os.path.relpath(path, lib)[: -len(".py")].replace(os.sep, ".")
            found.append((module, "\n\n".join(parts)))
    try:  # written beside, then renamed: a process reading it never sees half a file
        os.makedirs(os.path.dirname(cache), exist_ok=True)
        tmp = f"{cache}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(found, f)
        os.replace(tmp, cache)
    except OSError:
        pass  # a read-only home: parse again next time
    return tuple(found)


def _licences():
    seen = set()
    found = []
    for dist in importlib.metadata.distributions():
        for file in dist.files or []:
            if not os.path.basename(str(file)).upper().startswith(LICENCE_PREFIXES):
                continue
            try:
                with open(dist.locate_file(file), encoding="utf-8") as f:
                    text = f.read()
            except (OSError, UnicodeDecodeError):
                continue
            digest = hashlib.sha256(prose(text).encode()).hexdigest()  # copies differ in their layout
            if digest not in seen:
                seen.add(digest)
                found.append((f"{dist.metadata['Name']}/{file}", text))
    return sorted(found)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m nosa.train.prose", description=__doc__.split("\n\n")[0],
                                     epilog="\n\n".join(__doc__.split("\n\n")[2:]),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="data/prose", help="directory for train.jsonl and heldout.jsonl")
    parser.add_argument("--sources", nargs="+", default=list(SOURCES), choices=SOURCES)
    parser.add_argument("--heldout-percent", type=int, default=HELDOUT_PERCENT)
    args = parser.parse_args(argv)
    train, heldout = split(documents(tuple(args.sources)), args.heldout_percent)
    for name, docs in (("train", train), ("heldout", heldout)):
        path = write_jsonl(os.path.join(args.out, f"{name}.jsonl"), docs)
        print(f"[prose] {path}: {len(docs)} documents, {sum(len(d.text) for d in docs) / 1e6:.2f}M characters")
    return 0


if __name__ == "__main__":
    sys.exit(main())
