"""Render the generated blocks of README.md and docs/*.md: results tables from results/*.json and the
references (TrainConfig, NosaConfig, the NOSA_* variables) from the code.

A block is the lines between ``<!-- report:NAME -->`` and ``<!-- /report:NAME -->``, each on a line
of its own; whatever is there is replaced. ``NAME`` is a renderer of ``RENDERERS`` (``report_tables``
for results, ``report_reference`` for the code); a results block ends with one line per JSON it read,
from that file's ``provenance``. ``render(root)`` gives every page's new text; ``check(root)`` the
unified diffs of the pages that differ from it (``python scripts/report.py --check`` exits 1 on
any); ``citations(root)`` which results files each page cites (the docs test keeps results/ to them).
"""

from __future__ import annotations

import argparse
import difflib
import json
import re
from pathlib import Path
from typing import Callable

from nosa.bench import report_gemma, report_gpu, report_reference, report_ruler, report_serve, report_tables  # noqa: F401 (their @renders register)

BLOCK = re.compile(r"^<!-- report:(\w+) -->\n(.*?)^<!-- /report:\1 -->$", re.M | re.S)
CITED = re.compile(r"results/[\w.-]+\.(?:json|png)")
INDEX = "results_index"  # the block that lists every results file: not a citation itself

RENDERERS: dict[str, tuple[tuple[str, ...], Callable[[Path], str]]] = {
    **report_tables.RENDERERS, **report_reference.RENDERERS}


def pages(root: Path) -> list[Path]:
    return [root / "README.md"] + sorted((root / "docs").glob("*.md"))


def provenance_line(root: Path, name: str) -> str:
    """One line saying where the figures of ``name`` come from."""
    with open(root / name) as f:
        data = json.load(f)
    p = data.get("provenance") if isinstance(data, dict) else None
    if not p:
        return f"Data: `{name}` (no provenance recorded)."
    m = p.get("machine") or {}
    machine = [m.get("cpu"), m.get("cores") and f"{m['cores']} cores",
               m.get("memory_gib") and f"{m['memory_gib']:g} GiB", m.get("gpu") or "no GPU",
               m.get("torch") and f"torch {m['torch']}"]
    dirty = " with uncommitted changes" if p.get("dirty") else ""
    recorded = f" (provenance recorded {p['recorded']})" if p.get("recorded") else ""
    note = f" {p['note']}" if p.get("note") else ""
    if p.get("written_at"):  # the tree changed while it ran: the run's code is the one it started from
        at = p["written_at"]
        if at["commit"] != p.get("commit"):
            note += f" Written at commit `{str(at['commit'])[:7]}`, committed while it ran."
        elif at.get("dirty"):
            note += " Tracked files were edited while it ran."
    parts = data.get("parts") or []
    if parts:
        commits = ", ".join(sorted({f"`{str(q.get('commit'))[:7]}`" for q in parts}))
        dirty_parts = " with uncommitted changes" if any(q.get("dirty") for q in parts) else ""
        note += (f" Joined from {len(parts)} runs at commit {commits}{dirty_parts}, {parts[0]['date']}; their "
                 "commands are in the JSON's `parts`.")
    return (f"*Data:* `{name}` · `{p['command']}` · commit `{str(p.get('commit'))[:7]}`{dirty}, {p['date']} · "
            f"{', '.join(x for x in machine if x)}{recorded}.{note}")


def render_block(root: Path, name: str) -> str:
    if name == INDEX:
        return results_index(root)
    if name not in RENDERERS:
        raise KeyError(f"no renderer named {name!r}; known: {sorted(RENDERERS) + [INDEX]}")
    sources, fn = RENDERERS[name]
    parts = [fn(root).strip()] + [provenance_line(root, s) for s in sources]
    return "\n\n".join(parts)


def render_text(root: Path, text: str) -> str:
    def replace(match: re.Match) -> str:
        name = match.group(1)
        return f"<!-- report:{name} -->\n\n{render_block(root, name)}\n\n<!-- /report:{name} -->"

    return BLOCK.sub(replace, text)


def render(root: Path) -> dict[Path, str]:
    """{page: its text with every block rendered}."""
    return {page: render_text(root, page.read_text()) for page in pages(root)}


def check(root: Path) -> list[str]:
    """Unified diffs (committed -> rendered) of the pages whose blocks are out of date."""
    diffs = []
    for page, new in render(root).items():
        old = page.read_text()
        if old != new:
            name = str(page.relative_to(root))
            diffs.append("".join(difflib.unified_diff(old.splitlines(True), new.splitlines(True),
                                                      f"{name} (committed)", f"{name} (rendered)")))
    return diffs


def citations(root: Path) -> dict[str, set[str]]:
    """{page: the results files it cites}, by path in its own text (outside the generated blocks,
    so rendering never changes the answer) or through the sources of its blocks; the results index
    block, which lists every file, does not count."""
    out = {}
    for page in pages(root):
        text = page.read_text()
        cited = set()
        for match in BLOCK.finditer(text):
            if match.group(1) in RENDERERS:
                cited |= set(RENDERERS[match.group(1)][0])
        cited |= set(CITED.findall(BLOCK.sub("", text)))
        out[str(page.relative_to(root))] = cited
    return out


def results_index(root: Path) -> str:
    """Every file of results/: the pages that cite it, and for a JSON its command, commit and date."""
    cited_by: dict[str, list[str]] = {}
    for page, names in citations(root).items():
        for name in names:
            cited_by.setdefault(name, []).append(page)
    rows = []
    for path in sorted((root / "results").iterdir()):
        name = f"results/{path.name}"
        pages_ = ", ".join(sorted(cited_by.get(name, []))) or "**no page**"
        prov = "-"
        if path.suffix == ".json":
            with open(path) as f:
                data = json.load(f)
            p = data.get("provenance") if isinstance(data, dict) else None
            prov = f"`{p['command']}` (`{str(p['commit'])[:7]}`, {p['date']})" if p else "**none**"
        rows.append(f"| `{name}` | {pages_} | {prov} |")
    return "\n".join(["| file | cited by | command (commit, date) |", "|---|---|---|"] + rows)


def main(argv: list[str], root: Path) -> int:
    parser = argparse.ArgumentParser(prog="scripts/report.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 with a diff if a page differs")
    args = parser.parse_args(argv)
    if args.check:
        diffs = check(root)
        for d in diffs:
            print(d)
        if diffs:
            print(f"report: {len(diffs)} page(s) differ from what results/ and the code render; "
                  "run python scripts/report.py")
        return 1 if diffs else 0
    for page, new in render(root).items():
        if page.read_text() != new:
            page.write_text(new)
            print(f"report: rewrote {page.relative_to(root)}")
    return 0
