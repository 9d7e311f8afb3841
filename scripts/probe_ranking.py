"""Where a checkpoint's selection puts the answer: for the project's suite-style examples or NVIDIA
RULER's (``--suite ruler``), how the eviction heads and the query-aware score rank the block that
holds the answer, weighted by the dense attention the answer-predicting row pays to it.

    python scripts/probe_ranking.py --checkpoint runs/smollm2/fitted --tasks niah_multikey qa niah_single
    python scripts/probe_ranking.py --suite ruler --checkpoint runs/gemma3-8k/fitted \\
        --tokenizer models/gemma3-270m --length 8192 --examples 2 --shares 4

Per example, layer and KV head, the last prompt row (it predicts the answer's first token) is run
densely and its attention to the answer's block is the weight. At each budget share (``--shares``;
the suite's ``budget_config``) the block is

- ``forced`` when it is a sink or window block;
- ``ranked`` when the heads' static order (pooled eviction score, block mean, lower index: the order
  ``nosa.select.select_blocks`` ranks by) puts it among the budget's ranked slots (budget - sink -
  window - picks) of the other blocks;
- ``picked`` when the query-aware score (``nosa.select.query_block_scores``) puts it among the
  free picks;
- ``coverage``: inside the actual selection (``nosa_prefill``; ranked or picked or forced, as the
  selection decides them together).

Each figure is the share of the answer-block weight, over all examples of a task. Also reported:
the weighted mean number of other blocks holding an inserted sentence (a distractor needle) that the
heads rank above the answer's block. The examples come from ``--seed``: by default 1 for the
project's suite (whose own seed is 0) and RULER's benchmark seed (42) for RULER, whose examples the
probe is there to explain (the answer's block is where the first reference first appears: meant for
the niah and qa tasks, not for word extraction). Writes JSON (``--out``: per task and per example)
and prints a markdown table.
"""

from __future__ import annotations

import os
import sys

from nosa.bench.cli import doc_parser, offline

offline()  # before transformers is imported (it reads the flags then)

from nosa.bench.longctx.probe import run  # noqa: E402
from nosa.bench.longctx.suites import SEEDS, task_names  # noqa: E402


def main(argv=None) -> int:
    parser = doc_parser(__doc__)
    parser.add_argument("--checkpoint", default="runs/smollm2/fitted", help="a NOSA checkpoint (eviction heads)")
    parser.add_argument("--tokenizer", default="models/smollm2-135m")
    parser.add_argument("--suite", choices=["nosa", "ruler"], default="nosa",
                        help="the project's suite-style tasks, or NVIDIA RULER's (default nosa)")
    parser.add_argument("--ruler-data", default="runs/ruler-data", help="where RULER's generated rows are kept")
    parser.add_argument("--tasks", nargs="+", default=None,
                        help="default: niah_multikey qa niah_single (nosa); the niah tasks (ruler)")
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--examples", type=int, default=6, help="per task")
    parser.add_argument("--shares", type=int, nargs="+", default=[4, 8], help="budgets: 1/SHARE of the blocks")
    parser.add_argument("--seed", type=int, default=None,
                        help="the examples' seed (default: 1 for nosa, whose suite uses 0; ruler: 42, the benchmark's)")
    parser.add_argument("--out", default="results/probe_ranking.json")
    args = parser.parse_args(argv)
    if args.tasks is None:
        args.tasks = ["niah_multikey", "qa", "niah_single"] if args.suite == "nosa" else [
            t for t in task_names("ruler") if t.startswith("niah")]
    if args.seed is None:  # RULER: the benchmark's examples, whose replies the probe explains; the project's
        # suite: another seed than its own 0 (the probe must not read the examples a fit was chosen on)
        args.seed = SEEDS["ruler"] if args.suite == "ruler" else 1
    for path in (args.checkpoint, args.tokenizer):
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise SystemExit(f"probe_ranking: no checkpoint at {path!r} (python -m nosa.models smollm2 --out "
                             "models/smollm2-135m; python -m nosa.train --config configs/train/smollm2.yaml)")
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
