"""Accuracy benchmark on held-out synthetic retrieval: dense vs training-free selection (the dense
weights, A = 0: InfLLM-v2 style) vs NOSA fine-tuned, at the training length and at 2x and 4x it,
over one or more training seeds; plus what the selection does while the answers are decoded.

    python scripts/bench_accuracy.py --run runs/tiny runs/tiny-seed1 --plot results/accuracy.png
    python scripts/bench_accuracy.py --run runs/tiny --quick           # 1x only, 8 examples

Each run directory is what ``python -m nosa.train`` leaves (``dense`` = end of the dense phase,
``nosa`` = end of fine-tuning); several runs = several training seeds of one config, reported as
mean and [min, max]. The held-out examples are fresh (their own random stream, disjoint from the
training and held-out splits), drawn like the run's data: its tasks, its fact depth, facts outside
the sink blocks and the question's local window. The NOSA budget is the fine-tuned checkpoint's
NosaConfig; A = 0 gets the same one.

Per variant and length:
- ``acc``: share of answers right under teacher forcing (= what greedy decoding would produce; an
  example asks several questions, each answered by one token, each counted); ``acc_example``:
  share of examples with every answer right; ``loss``: mean cross-entropy over the answer tokens.
For the two sparse variants, over the decode steps (every token of the question and its answers,
fed one at a time after the context, per layer and KV head; nosa_prefill's row t selects as decode
step t would):
- ``entering_mean`` / ``entering_max``: blocks entering the selection per step (what a device cache
  must recall from the host);
- ``hit_rate``: selected blocks that were selected at the previous step too, i.e. already resident
  in a device cache of exactly the budget;
- ``mass``: share of the model's dense attention probability (softmax of q.k over every causal
  key) inside the selected blocks, over query heads.
Writes JSON (--out) and a markdown table to stdout; --plot draws accuracy, recalls and hit rate.
"""

from __future__ import annotations

import sys

from nosa.bench.cli import doc_parser, offline

offline()  # before transformers is imported (it reads the flags then)

from nosa.bench.accuracy import run  # noqa: E402


def main(argv=None) -> int:
    parser = doc_parser(__doc__)
    parser.add_argument("--run", nargs="+", default=["runs/tiny"], help="run dirs (one per training seed)")
    parser.add_argument("--lengths", type=int, nargs="+", help="default: 1x, 2x, 4x the training seq_len")
    parser.add_argument("--examples", type=int, default=32, help="held-out examples per length")
    parser.add_argument("--seed", type=int, default=777)
    parser.add_argument("--quick", action="store_true", help="training length only, 8 examples")
    parser.add_argument("--out", default="results/accuracy.json")
    parser.add_argument("--plot", metavar="PNG", help="also draw accuracy, recalls and hit rate per length")
    args = parser.parse_args(argv)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
