"""nosa.bench.cli: the scripts' offline flags are set before transformers can read them, and their
parsers come from their docstrings."""

import os
import subprocess
import sys

from nosa.bench.cli import HF_OFFLINE, doc_parser, offline


def test_importing_the_helper_does_not_import_transformers():
    """The scripts call offline() after importing nosa.bench.cli and before anything that imports
    transformers, which reads the flags when it is imported: so the helper itself must not."""
    code = "import sys, nosa.bench.cli; print('transformers' in sys.modules, 'huggingface_hub' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]


def test_offline_sets_only_unset_flags(monkeypatch):
    for var in HF_OFFLINE:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")  # a user's own choice stays
    offline()
    assert [os.environ[v] for v in HF_OFFLINE] == ["0", "1", "1"]


def test_doc_parser_description_and_epilog():
    doc = "What it does.\n\n    python x.py\n\nMore."
    parser = doc_parser(doc)
    assert parser.description == "What it does." and parser.epilog == "    python x.py\n\nMore."
    assert doc_parser(doc, epilog_from=2).epilog == "More."
    assert "    python x.py" in parser.format_help()  # line breaks and indentation kept
