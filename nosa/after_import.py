"""Run a function once a module has been imported, without importing it.

``when_imported(module, callback, quiet)`` runs ``callback`` right after ``module`` is imported, or
at once when it already is: ``import nosa`` needs only torch, yet NOSA's model types must reach
transformers' Auto registries once transformers builds them. A callback may import any module of
the package ``quiet`` (e.g. "transformers"): it runs only when no module of that package is still
executing (a finder at the front of ``sys.meta_path`` counts the executions in progress while a
callback is pending), so it never meets a half-initialised module of an import chain. Assumed:
nothing registers a callback from inside an import of ``quiet``.
"""

from __future__ import annotations

import sys
from collections.abc import Callable


def when_imported(module: str, callback: Callable[[], None], quiet: str) -> None:
    """Call ``callback()`` once ``module`` is in ``sys.modules`` and no module of the package
    ``quiet`` is executing; ``module`` must belong to ``quiet``. Each callback runs once."""
    if not _within(module, quiet):
        raise ValueError(f"when_imported: {module!r} is not a module of {quiet!r}")
    watch = next((f for f in sys.meta_path if isinstance(f, _Watch) and f.quiet == quiet), None)
    if watch is None:
        watch = _Watch(quiet)
        sys.meta_path.insert(0, watch)
    watch.pending.append((module, callback))
    watch.run_ready()


def _within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


class _Watch:
    """Meta-path finder: hands out the specs the other finders find for the modules of ``quiet``,
    with a loader that counts executions, and runs pending callbacks when the count is back to 0."""

    def __init__(self, quiet: str):
        self.quiet = quiet
        self.pending: list[tuple[str, Callable[[], None]]] = []
        self.executing = 0
        self.running = False  # a callback's own imports must not start the next callback

    def find_spec(self, name, path, target=None):
        if not _within(name, self.quiet):
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _CountingLoader(spec.loader, self)
        return spec

    def run_ready(self) -> None:
        if self.executing or self.running:
            return
        self.running = True
        try:
            while ready := [item for item in self.pending if item[0] in sys.modules]:
                self.pending.remove(ready[0])
                ready[0][1]()
        finally:
            self.running = False
        if not self.pending and self in sys.meta_path:
            sys.meta_path.remove(self)


class _CountingLoader:
    """The found loader, with ``exec_module`` counted; everything else (get_source for tracebacks and
    inspect, resource readers) is the found loader's."""

    def __init__(self, loader, watch: _Watch):
        self.loader = loader
        self.watch = watch

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        self.watch.executing += 1
        try:
            self.loader.exec_module(module)
        finally:
            self.watch.executing -= 1
        if self.watch.executing == 0:
            # importlib binds a submodule to its package only after this returns; bind it now, so
            # that a callback reaching it as ``package.module`` finds it.
            parent, _, child = module.__name__.rpartition(".")
            if parent in sys.modules and module.__name__ in sys.modules:
                setattr(sys.modules[parent], child, sys.modules[module.__name__])
        self.watch.run_ready()

    def __getattr__(self, name):
        return getattr(self.loader, name)
