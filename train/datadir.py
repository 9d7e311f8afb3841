"""A training data directory: ``<name>.jsonl`` files of rows and ``meta.json`` (the settings the rows
were made with, so a later run knows whether to remake them), written atomically: into a temp
directory beside it, then renamed, so a crash never leaves a half-written directory behind.
nosa.train.synthetic and nosa.train.ruler write theirs through ``write``; nosa.train.data reads
``meta.json`` back with ``read_meta``."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Iterable


def write(out_dir: str, files: Iterable[tuple[str, Iterable[dict]]], meta: dict,
          extra: Callable[[str], None] | None = None) -> str:
    """Write each (name, rows) of ``files`` as ``name.jsonl`` (one JSON row a line; rows may be made
    lazily, while writing) and ``meta`` as meta.json into ``out_dir``, replacing what was there;
    ``extra(tmp_dir)`` may add files. Returns ``out_dir``."""
    tmp = f"{out_dir.rstrip('/')}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        for name, rows in files:
            with open(os.path.join(tmp, f"{name}.jsonl"), "w") as f:
                for row in rows:
                    f.write(json.dumps(row) + "\n")
        if extra is not None:
            extra(tmp)
        with open(os.path.join(tmp, "meta.json"), "w") as f:
            json.dump(meta, f, indent=1, sort_keys=True)
        shutil.rmtree(out_dir, ignore_errors=True)
        os.makedirs(os.path.dirname(os.path.abspath(out_dir)), exist_ok=True)
        os.rename(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def read_meta(out_dir: str) -> dict | None:
    """meta.json of a directory written by ``write``, None when there is none."""
    path = os.path.join(out_dir, "meta.json")
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f)
