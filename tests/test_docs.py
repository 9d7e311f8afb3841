"""The docs stay true to the data: README.md and docs/*.md against results/*.json and the code.

- the generated blocks equal what ``scripts/report.py`` renders now (``--check``);
- ``mkdocs build --strict`` passes (skipped without mkdocs, the ``dev`` extra);
- no measured figure is typed by hand: outside the generated blocks and code, no percentage, no
  ``1.23x`` ratio, no number with a unit of time, size, bandwidth or throughput, no bare decimal;
- every file under results/ is cited by a page (by path, or through a block rendered from it), and
  every cited JSON exists and has its provenance;
- the README stays short, and its links into docs/ exist.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from nosa.bench import report
from nosa.bench.report_reference import field_comments

ROOT = Path(__file__).resolve().parents[1]
README_MAX_LINES = 220

FENCE = re.compile(r"^```.*?^```[ \t]*$", re.M | re.S)
CODE_SPAN = re.compile(r"`[^`\n]*`")
LINK_TARGET = re.compile(r"\]\([^)]*\)")
COMMENT = re.compile(r"<!--.*?-->", re.S)
UNIT = (r"(?:ms|us|µs|ns|s|secs?|seconds?|min|mins|minutes?|h|hours?|[KMGT]i?B|kB|GFLOP|tokens|tok)(?:/s)?"
        r"|tokens/s|tok/s")
FIGURE = re.compile(
    r"(?<![\w.])\d[\d,]*(?:\.\d+)?\s?%"  # 97.3%, 12 %
    r"|(?<![\w.])\d+(?:\.\d+)?x(?![\w])"  # 1.23x, 16x
    rf"|(?<![\w.])\d[\d,]*(?:\.\d+)?\s?(?:{UNIT})(?![\w/])"  # 4.5 min, 22 ms, 8 MiB, 3 GB/s
    r"|(?<![\w.-])\d+\.\d+(?![\w.]*\d)"  # a bare decimal (versions have two dots; Apache-2.0)
)
# "tokens" after a number is a length (a config), not a throughput: only "tokens/s" counts
LENGTHS = re.compile(r"\d[\d,]*\s?tokens(?!/s)")


def _pages() -> list[Path]:
    return report.pages(ROOT)


def _prose(text: str) -> str:
    """The hand-written text of a page: without generated blocks, code, link targets, comments."""
    text = report.BLOCK.sub("", text)
    text = FENCE.sub("", text)
    text = COMMENT.sub("", text)
    text = CODE_SPAN.sub("", text)
    return LINK_TARGET.sub("]", text)


def test_generated_blocks_are_up_to_date():
    diffs = report.check(ROOT)
    assert not diffs, ("README/docs differ from what results/ and the code render; run python "
                       "scripts/report.py\n" + "\n".join(diffs)[:20000])


def test_every_page_block_names_a_renderer():
    for page in _pages():
        for match in report.BLOCK.finditer(page.read_text()):
            assert match.group(1) in report.RENDERERS or match.group(1) == report.INDEX, (page, match.group(1))


@pytest.mark.skipif(importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("material") is None,
                    reason="mkdocs / mkdocs-material not installed (pip install -e '.[dev]')")
def test_mkdocs_build_strict(tmp_path):
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet",
                           "-f", str(ROOT / "mkdocs.yml"), "-d", str(tmp_path / "site")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert (tmp_path / "site" / "index.html").is_file()


def test_figure_regex_catches_figures_and_spares_config():
    caught = ["hit rate 97.3% warm", "at 0.955x the speed", "16x", "took 4.5 min", "22 ms per step",
              "8 MiB recalled", "at 3.5 GB/s", "2,022 s", "a ratio of 1.014", "300 tokens/s"]
    spared = ["block 64", "1/16 of the budget", "SGLang 0.5.23", "torch 2.14.1", "8K prompts",
              "sm_90", "128 blocks of 4 tokens", "query_blocks + 1", "Llama-3-8B", "2 cores", "Apache-2.0"]
    for text in caught:
        assert FIGURE.search(LENGTHS.sub("", text)), text
    for text in spared:
        assert not FIGURE.search(LENGTHS.sub("", text)), text


def test_no_hand_typed_figures():
    found = []
    for page in _pages():
        for n, line in enumerate(_prose(page.read_text()).splitlines(), 1):
            for match in FIGURE.finditer(LENGTHS.sub("", line)):
                found.append(f"{page.relative_to(ROOT)}: {match.group(0)!r} in {line.strip()[:100]!r}")
    assert not found, ("measured figures belong in a generated block (nosa/bench/report_tables.py, "
                       "<!-- report:NAME -->), not in prose:\n" + "\n".join(found))


def test_results_are_cited_and_have_provenance():
    cited = set().union(*report.citations(ROOT).values())
    files = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "results").rglob("*") if p.is_file())
    uncited = [f for f in files if f not in cited]
    assert not uncited, f"results files no page cites (cite them or delete them): {uncited}"
    for name in sorted(c for c in cited if c.endswith(".json")):
        path = ROOT / name
        assert path.is_file(), f"a page cites {name}, which does not exist"
        with open(path) as f:
            data = json.load(f)
        prov = data.get("provenance") if isinstance(data, dict) else None
        assert prov, f"{name} has no provenance block"
        missing = {"command", "commit", "dirty", "machine", "date"} - set(prov)
        assert not missing, f"{name}: provenance lacks {sorted(missing)}"
    for name in sorted(c for c in cited if not c.endswith(".json")):
        assert (ROOT / name).is_file(), f"a page cites {name}, which does not exist"


def test_readme_is_short_and_its_links_exist():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= README_MAX_LINES
    for target in re.findall(r"\]\(((?:docs|results)/[^)#\s]+)", text):
        assert (ROOT / target).exists(), target


def test_field_comments_read_the_comment_above_and_the_trailing_one():
    @dataclass
    class Example:
        """Not a field."""

        # tokens per block
        # (the unit of selection)
        block: int = 64  # a power of two
        plain: int = 1

        # a blank line above ends nothing; this comment belongs to the list
        items: list[int] = field(
            default_factory=list,  # empty
        )

        def method(self) -> int:  # not a field
            x: int = 1  # not a field either
            return x

    assert field_comments(Example) == {
        "block": "tokens per block (the unit of selection) a power of two",
        "plain": "",
        "items": "a blank line above ends nothing; this comment belongs to the list empty",
    }
