"""Render the generated blocks of README.md and docs/*.md from results/*.json and the code.

    python scripts/report.py           # rewrite every <!-- report:NAME --> block
    python scripts/report.py --check   # exit 1 with a diff where a page differs from what it renders

The renderers are in nosa.bench.report (and its report_* modules).
"""

import sys
from pathlib import Path

from nosa.bench.report import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:], root=Path(__file__).resolve().parents[1]))
