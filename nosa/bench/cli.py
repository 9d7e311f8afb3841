"""What the benchmark scripts share before their work starts: the Hugging Face offline flags, which
must be set before transformers is imported (it reads them then; nothing here imports it), and an
argparse parser written from the script's docstring."""

from __future__ import annotations

import argparse
import os

HF_OFFLINE = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE")


def offline() -> None:
    """Set the Hugging Face offline flags (where they are unset): no hub access, local files only."""
    for var in HF_OFFLINE:
        os.environ.setdefault(var, "1")


def doc_parser(doc: str, epilog_from: int = 1) -> argparse.ArgumentParser:
    """A parser whose description is the docstring's first paragraph and whose epilog is its paragraphs
    from ``epilog_from`` on, line breaks kept."""
    parts = doc.split("\n\n")
    return argparse.ArgumentParser(description=parts[0], epilog="\n\n".join(parts[epilog_from:]),
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
