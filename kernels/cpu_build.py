"""The CPU kernels' build: a C++ file of kernels/ compiled on first use and loaded with ctypes.

Each source (resolve_cpu.cpp, select_cpu.cpp) is compiled with the system's C++ compiler (``$CXX``,
else ``c++``; about a second) into ``$NOSA_KERNEL_CACHE`` (default ``~/.cache/nosa/kernels``), named
by the source's hash: no torch headers, no build step at install. A ``CppLibrary`` loads its source
once per process; without a compiler it warns once and its callers run the torch path.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

from nosa import env

log = logging.getLogger(__name__)


def cache_dir() -> Path:
    return env.path("NOSA_KERNEL_CACHE")


def build(source: Path, force: bool = False) -> Path:
    """Compile ``source`` (if its build for this content is not there yet, or ``force``); returns the
    shared library's path. Raises RuntimeError with the compiler's output on failure."""
    text = source.read_bytes()
    out = cache_dir() / f"{source.stem}-{hashlib.sha256(text).hexdigest()[:16]}.so"
    if out.exists() and not force:
        return out
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if not compiler:
        raise RuntimeError("no C++ compiler found (set $CXX or install g++)")
    out.parent.mkdir(parents=True, exist_ok=True)
    # build beside the target, then rename: another process loading it never sees half a file
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        cmd = [compiler, "-O3", "-std=c++17", "-shared", "-fPIC", "-o", tmp, str(source)]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr.strip()}")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


class CppLibrary:
    """``source`` built and loaded once per process, its functions typed by ``declare(lib)``."""

    def __init__(self, source: Path, declare: Callable[[ctypes.CDLL], None], what: str):
        self.source, self._declare, self.what = source, declare, what
        self._lock = threading.Lock()
        self._lib: ctypes.CDLL | None = None
        self.error: str | None = None

    def get(self) -> ctypes.CDLL | None:
        """The loaded library, or None (no compiler, or a failed build: warned once)."""
        if self._lib is not None or self.error is not None:
            return self._lib
        with self._lock:
            if self._lib is None and self.error is None:
                try:
                    lib = ctypes.CDLL(str(build(self.source)))
                    self._declare(lib)
                    self._lib = lib
                except (OSError, RuntimeError) as exc:
                    self.error = str(exc)
                    log.warning("nosa: the %s is unavailable, the torch path runs instead: %s", self.what, exc)
        return self._lib

    def ready(self) -> bool:
        """``NOSA_KERNELS`` unset or ``auto`` and the library built: its callers run it."""
        return env.choice("NOSA_KERNELS") == "auto" and self.get() is not None
