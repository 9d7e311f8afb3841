"""Where a checkpoint's selection puts the answer: for suite-style examples, how the eviction heads
and the query-aware score rank the block that holds the answer, weighted by the dense attention the
answer-predicting row pays to it.

    python scripts/probe_ranking.py --checkpoint runs/smollm2/fitted --tasks niah_multikey qa niah_single

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
heads rank above the answer's block. The examples come from ``--seed`` (default 1; the suite's is
0). Writes JSON (``--out``) and prints a markdown table.
"""

from __future__ import annotations

import argparse
import os
import sys

for _var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
    os.environ.setdefault(_var, "1")  # before transformers is imported (it reads them then)

from nosa.bench.longctx.probe import run  # noqa: E402


def main(argv=None) -> int:
    parts = __doc__.split("\n\n")
    parser = argparse.ArgumentParser(description=parts[0], epilog="\n\n".join(parts[1:]),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", default="runs/smollm2/fitted", help="a NOSA checkpoint (eviction heads)")
    parser.add_argument("--tokenizer", default="models/smollm2-135m")
    parser.add_argument("--tasks", nargs="+", default=["niah_multikey", "qa", "niah_single"])
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--examples", type=int, default=6, help="per task")
    parser.add_argument("--shares", type=int, nargs="+", default=[4, 8], help="budgets: 1/SHARE of the blocks")
    parser.add_argument("--seed", type=int, default=1, help="the examples' seed (the suite uses 0)")
    parser.add_argument("--out", default="results/probe_ranking.json")
    args = parser.parse_args(argv)
    for path in (args.checkpoint, args.tokenizer):
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise SystemExit(f"probe_ranking: no checkpoint at {path!r} (python -m nosa.models smollm2 --out "
                             "models/smollm2-135m; python -m nosa.train --config configs/train/smollm2.yaml)")
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
