"""Time the whole test suite: one run of ``bash scripts/test.sh`` (two pytest-xdist workers) with a
JUnit report; writes the wall time, the outcome counts and the slowest tests as JSON.

    python scripts/time_suite.py                       # -> results/suite.json
    python scripts/time_suite.py --out /tmp/suite.json -- -k "not real"

Run it on a quiet machine: the figure is the suite's wall time, which other load stretches.
"""

from __future__ import annotations

import argparse
import sys

from nosa.bench.suite_time import run


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="results/suite.json", help="JSON output (default results/suite.json)")
    parser.add_argument("--slowest", type=int, default=15, help="how many of the slowest tests to keep (default 15)")
    parser.add_argument("--all-tests", default=None, metavar="PATH",
                        help="also write every test's seconds (slowest first) to PATH")
    parser.add_argument("pytest_args", nargs="*", help="more pytest arguments (after --)")
    args = parser.parse_args(argv)
    return run(args)["exit_code"]


if __name__ == "__main__":
    sys.exit(main())
