"""Which compressed-window layout lets the query-aware score find the answer: NVIDIA RULER's niah and qa
examples run densely on a model, and for each ``--windows`` layout (kernel/stride, in tokens) the
candidate blocks ranked by the query-aware score of the last prompt row, as the selection's free picks
are (nosa.bench.longctx.layouts says what is measured).

    python scripts/probe_windows.py                      # SmolLM2 at 2K, 3 examples per task, seed 1; minutes
    python scripts/probe_windows.py --windows 32/16 16/16 --examples 1

The examples come from seed 1 by default, not the benchmark's 42: a layout is chosen here and then
scored on the benchmark's examples (docs/training.md). Writes JSON (``--out``) and prints a table.
"""

from __future__ import annotations

import os
import sys

from nosa.bench.cli import doc_parser, offline

offline()  # before transformers is imported (it reads the flags then)

from nosa.bench.longctx.config import budget_config, windows_arg  # noqa: E402
from nosa.bench.longctx.layouts import run  # noqa: E402
from nosa.bench.longctx.suites import task_names  # noqa: E402


def main(argv=None) -> int:
    parser = doc_parser(__doc__)
    parser.add_argument("--model", default="models/smollm2-135m", help="a dense checkpoint")
    parser.add_argument("--ruler-data", default="runs/ruler-data", help="where RULER's generated rows are kept")
    parser.add_argument("--tasks", nargs="+", default=None, help="default: RULER's niah and qa tasks")
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--share", type=int, default=4, help="the budget (1/SHARE of the blocks) whose sink and "
                        "window blocks are left out of the ranking")
    parser.add_argument("--examples", type=int, default=3, help="per task")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--windows", type=windows_arg, nargs="+", metavar="KERNEL/STRIDE",
                        default=[(32, 16), (32, 32), (16, 16), (16, 8), (8, 8)])
    parser.add_argument("--out", default="results/probe_windows.json")
    args = parser.parse_args(argv)
    known = task_names("ruler")
    args.tasks = args.tasks or [t for t in known if t.startswith(("niah", "qa"))]
    wrong = [t for t in args.tasks if t not in known]
    if wrong:
        parser.error(f"--tasks: {wrong} are not RULER tasks; its tasks: {' '.join(known)}")
    for w in args.windows:
        try:
            budget_config(args.length, args.share, windows=w)
        except ValueError as e:
            parser.error(f"--windows {w[0]}/{w[1]}: {e}")
    if not os.path.isfile(os.path.join(args.model, "config.json")):
        raise SystemExit(f"probe_windows: no checkpoint at {args.model!r} (python -m nosa.models smollm2 --out "
                         "models/smollm2-135m)")
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
