"""The one writer of benchmark results: ``write_result(path, data)`` writes ``data`` as JSON with a
top-level ``"provenance"`` block saying what produced it (the command, the commit, the machine, the
date), atomically: a reader never sees half a file, and a failed run leaves the old file in place.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import shlex
import subprocess
import sys

import torch

from nosa.bench import REPO


def provenance(argv: list[str] | None = None) -> dict:
    """``{"command", "commit", "dirty", "machine", "date"}`` for a result made now by ``argv`` (the
    command line as typed, program first; default ``sys.argv``): ``command`` reads
    ``python scripts/bench_x.py --quick`` (a program inside the checkout relative to it), or
    ``python -m nosa.plan ...`` for a module run with ``-m`` (its file path would not run as a script);
    ``commit`` and ``dirty`` (tracked files changed since the commit) are None where git or the
    repository is missing. The commit is the one the run started from (``STARTED``, read when this
    module was first imported): where commits came during a long run, the one at writing goes to
    ``written_at``, so a result never claims code it did not run."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    if argv is None and spec is not None and spec.name:  # python -m nosa.plan: so it reads, and reruns
        argv = ["-m", spec.name.removesuffix(".__main__"), *sys.argv[1:]]
    argv = list(sys.argv if argv is None else argv)
    program = os.path.abspath(argv[0]) if argv and argv[0] != "-m" else ""
    if program.startswith(REPO + os.sep):  # scripts/x.py, however the path to it was typed
        argv[0] = os.path.relpath(program, REPO)
    now = git_state()
    commit, dirty = STARTED if STARTED[0] is not None else now
    out = {"command": " ".join(["python", *(shlex.quote(a) for a in argv)]), "commit": commit, "dirty": dirty,
           "machine": machine(), "date": datetime.date.today().isoformat()}
    if now != (commit, dirty):
        out["written_at"] = {"commit": now[0], "dirty": now[1]}
    return out


def git_state(root: str = REPO) -> tuple[str | None, bool | None]:
    """(HEAD's sha, whether tracked files outside results/ differ from it) of the checkout at
    ``root``; (None, None) without git or outside a repository. results/ does not count: a run that
    rewrites one results file (the quickstart's demo, then its serving step) has changed no code."""
    try:
        head = subprocess.run(["git", "-C", root, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=30)
        if head.returncode != 0:
            return None, None
        status = subprocess.run(["git", "-C", root, "status", "--porcelain", "--untracked-files=no", "--", ".",
                                 ":(exclude)results"],
                                capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):  # no git executable, or a hung one
        return None, None
    return head.stdout.strip(), bool(status.stdout.strip()) if status.returncode == 0 else None


STARTED = git_state()  # (commit, dirty) when the run began: a benchmark imports this module first


def machine() -> dict:
    """CPU model, usable cores, memory in GiB, the GPU's name (None without CUDA), torch and Python."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"cpu": cpu_model(), "cores": cores,
            "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
            "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
            "torch": torch.__version__, "python": platform.python_version()}


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo on Linux), else what ``platform`` knows."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def write_result(path: str, data: dict, argv: list[str] | None = None) -> str:
    """Write ``{"provenance": provenance(argv), **data}`` to ``path`` as JSON (parent folders made),
    through a temporary file in the same folder renamed over ``path``. A ``"provenance"`` already in
    ``data`` (a report read back and merged) is replaced by this run's. Returns ``path``."""
    result = {"provenance": provenance(argv), **{k: v for k, v in data.items() if k != "provenance"}}
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"  # same folder (a rename within one file system), one per process
    try:
        with open(tmp, "w") as f:
            json.dump(result, f, indent=1)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path
