"""Compare settings of the eviction-head fit on the real model without a long-context suite run per
setting: the fit's inputs are captured once, every layer's heads are refitted per setting, and each
setting is scored by answer-block coverage on suite-style examples.

    python scripts/sweep_fit.py --settings rank=0 rank=1,tau=0.02 rank=3,tau=0.05 rank=0,rows=12

Answer-block coverage: the last prompt row is the row that predicts the answer (RULER's answer prefix
ends the prompt). Over every layer and KV head, the dense attention that this row pays to the block
holding the answer's first token, and the share of it that falls inside that head's selection at the
suite's NosaConfig (``budget_config``). 1.0: every head that reads the answer can still read it. The
examples come from another seed than the suite's (default ``--seed 1``, the suite's default is 0), so
a setting chosen here is not fitted to the examples the suite scores.

A setting is ``key=value`` pairs joined by commas: ``rank`` (the window ranking term's weight, the
config's ``distill.rank_weight``; 0: off), ``tau`` (``distill.rank_tau``), ``steps`` (``distill.steps``),
``rows`` (the first N of the captured rows). Unset keys come from ``--config``. Each setting refits
from the same initial weights. Writes JSON (``--out``) and prints a markdown table.
"""

from __future__ import annotations

import sys

from nosa.bench.cli import doc_parser, offline

offline()  # before transformers is imported (it reads the flags then)

from nosa.bench.longctx.sweep import parse_setting, run  # noqa: E402


def main(argv=None) -> int:
    parser = doc_parser(__doc__)
    parser.add_argument("--config", default="configs/train/smollm2.yaml",
                        help="training config: the fit's NosaConfig, rows, steps, lr, scale and defaults")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                        help="config overrides, as for python -m nosa.train (e.g. distill.rows=12)")
    parser.add_argument("--settings", type=parse_setting, nargs="+", default=[{}], metavar="SETTING")
    parser.add_argument("--rows", type=int, help="rows to capture (default: the config's distill.rows)")
    parser.add_argument("--tasks", nargs="+", default=["qa", "niah_multikey", "niah_single"])
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096])
    parser.add_argument("--examples", type=int, nargs="+", default=[6, 3], help="per task at each length")
    parser.add_argument("--share", type=int, default=4, help="budget: 1/SHARE of the blocks")
    parser.add_argument("--seed", type=int, default=1, help="the examples' seed (the suite uses 0)")
    parser.add_argument("--out", default="results/fit_sweep.json")
    args = parser.parse_args(argv)
    if len(args.examples) not in (1, len(args.lengths)):
        parser.error(f"--examples needs one number or one per length ({len(args.lengths)})")
    counts = args.examples * len(args.lengths) if len(args.examples) == 1 else args.examples
    return run(args, counts)


if __name__ == "__main__":
    sys.exit(main())
