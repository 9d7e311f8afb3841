"""Long-context benchmark for a real pretrained model: dense vs training-free selection (A = 0) at 1/4
and 1/8 of the blocks vs NOSA checkpoints, side by side on the same examples, on NVIDIA's RULER or
on the project's own RULER-style suite.

    python -m nosa.models smollm2 --out models/smollm2-135m               # once: the model
    python scripts/bench_longctx.py --suite ruler --quick                 # RULER, 1 example per task at 2K
    python scripts/bench_longctx.py --suite ruler --plot results/ruler.png
    python scripts/bench_longctx.py --quick                               # own suite, 4 examples per task at 2K
    python scripts/bench_longctx.py --plot results/longctx.png            # own suite, 2K, 4K, 8K
    python scripts/bench_longctx.py --nosa fitted=runs/smollm2/nosa       # + NOSA checkpoints (LABEL=PATH)

``--suite ruler``: NVIDIA's RULER (nvidia-long-context-eval 26.3): its 13 task configurations, written
by its own generators with the model's tokenizer (seed 42, as its prepare.py) and kept under
runs/ruler-data, scored by its own metrics (string_match_all; string_match_part for qa), per example
in [0, 1]. What runs differently from a stock RULER run (an untrained sentence splitter, the model's
chat template) is in nosa/bench/longctx/nvidia_ruler.py and docs/ruler.md.

``--suite nosa`` (default): nosa.train.ruler's tasks (passkey, single / multi-key / multi-value needles, variable
tracking, a question answered by one sentence) over held-out prose from nosa.train.prose (only the
sources every CPython ships, so the examples are the same on any install of one Python version).
Each example is one chat turn through the model's template; the reply is greedy and scored by
exact match of the answer inside it (nosa.train.ruler.is_right says how text is normalised).
Decoding stops at the end of the turn, at the task's token limit, or as soon as the reply is right
whatever follows (nosa.train.ruler.is_settled), which saves decode steps and changes no score.
Spread: the Wilson 95% interval of each share of right answers.

Variants: ``dense``; ``A = 0`` (the dense weights converted with every eviction head off: the
training-free, query-aware selection of InfLLM-v2); each ``--nosa`` checkpoint (its weights and
eviction heads). Every sparse variant runs at the suite's NosaConfig for the length and the budget
share (``budget_config``: blocks of 32 tokens, so 8K = 256 blocks; budget = 1/4 or 1/8 of the
context's blocks = 1 sink + a window of 17/64 of it (the released NOSA's proportion) + free
query-aware picks, 1/16 of it by default (``--picks``; the release's 15/64 reselects 4x as many
blocks per step and answered no better on this model: docs/real-models.md) + the rest ranked by the eviction
heads; dense_len 0. 8K at 1/4 = 64 = 1 + 17 + 4 + 42). The compressed windows that score blocks for the
query are 32 tokens every 16 by default; ``--windows 16/16`` runs every sparse variant with others
(scripts/probe_windows.py compares layouts; docs/training.md).

Prefill (``--prefill``):
- ``dense`` (default): the context part of a prompt (template, instruction, haystack) is prefilled
  once with dense attention and every variant continues from that KV cache: the question rows and
  every decode step attend with the variant's own attention. The question never sees the haystack
  densely, so the answer has to come through the selection; one dense prefill serves all variants
  (a checkpoint with other base weights gets its own).
- ``sparse``: every variant prefills the whole prompt with its own attention, as a server with
  dense_len 0 does (sparse prefill is about twice a dense one on CPU, per variant).

Per variant and length, over the decode steps (the last prompt row, then each generated token; per
layer and KV head; nosa_prefill's row t selects as decode step t does): blocks entering the
selection per step (what a device cache must recall), the hit rate of a device cache of exactly
the budget (selected blocks that were selected at the previous step too) and the share of the dense
attention mass inside the selection. Perplexity: the last 1K tokens of held-out prose windows of the
longest length (the first tokens are the context, prefilled as ``--prefill`` says).

Dense replies and perplexities are cached under ``--cache`` (keyed by the checkpoint's weights and
the example's content), so a run that adds a NOSA checkpoint does not decode dense again. Writes
JSON (``--out``), a markdown table (stdout) and, with ``--plot``, a PNG.
"""

from __future__ import annotations

import argparse
import json
import sys

from nosa.bench.cli import doc_parser, offline

offline()  # before transformers is imported (it reads the flags then)

from nosa.bench.longctx.config import PICKS, WINDOWS, budget_config, picks_share, windows_arg  # noqa: E402
from nosa.bench.longctx.merge import drop_variants, keep_lengths, merge  # noqa: E402
from nosa.bench.longctx.run import run  # noqa: E402
from nosa.bench.longctx.suites import SEEDS, SUITES, task_names  # noqa: E402
from nosa.bench.longctx.summary import write_report  # noqa: E402

EXAMPLES = {"nosa": [12, 10, 4], "ruler": [3, 2, 1]}  # per task at 2K, 4K, 8K (docs/benchmarks.md: the times)


def main(argv=None) -> int:
    parser = doc_parser(__doc__, epilog_from=2)
    parser.add_argument("--model", default="models/smollm2-135m", help="dense HF checkpoint (python -m nosa.models)")
    parser.add_argument("--nosa", nargs="+", metavar="[LABEL=]CKPT", help="NOSA checkpoints to add as variants")
    parser.add_argument("--dense-ckpt", nargs="+", metavar="LABEL=CKPT", default=[],
                        help="checkpoints to add with dense attention (a dense fine-tune, e.g. dense-FT, or a NOSA "
                             "checkpoint's dense mode for its perplexity); every sparse variant is also paired with "
                             "each of them, and each of them with dense")
    parser.add_argument("--suite", choices=SUITES, default="nosa",
                        help="ruler: NVIDIA's RULER; nosa: the project's own RULER-style tasks (default)")
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8192])
    parser.add_argument("--examples", type=int, nargs="+",
                        help="examples per task at each length (one number: the same at every length; default "
                             f"{' '.join(map(str, EXAMPLES['nosa']))} for nosa, "
                             f"{' '.join(map(str, EXAMPLES['ruler']))} for ruler)")
    parser.add_argument("--tasks", nargs="+", help="a subset of the suite's tasks (default: all of them)")
    parser.add_argument("--shares", type=int, nargs="+", default=[4, 8], help="budgets: 1/SHARE of the blocks")
    parser.add_argument("--picks", type=picks_share, nargs="+", default=[PICKS], metavar="FRACTION",
                        help="free query-aware picks as a share of the budget (several: one variant per NOSA "
                             "checkpoint, budget and share; default 1/16; the release's split is 15/64). A = 0 "
                             "ranks every non-forced block by the query, so its selection does not depend on this")
    parser.add_argument("--windows", type=windows_arg, default=WINDOWS, metavar="KERNEL/STRIDE",
                        help="the compressed windows that score blocks for a query, in tokens (default "
                             f"{WINDOWS[0]}/{WINDOWS[1]}; blocks are {WINDOWS[0]}); every sparse variant, A = 0 and "
                             "--nosa alike, runs with them, and another layout than the default is in their names")
    parser.add_argument("--a0", action=argparse.BooleanOptionalAction, default=True,
                        help="the A = 0 variants (--no-a0: only dense and the --nosa checkpoints, e.g. to add a "
                             "checkpoint to an earlier report on the same examples with --merge)")
    parser.add_argument("--host-kv-dtypes", nargs="+", default=["auto"], choices=["auto", "int8", "float8_e4m3fn"],
                        help="each NOSA variant once per host KV format (NOSA_HOST_KV_DTYPE; nosa.hf.host_kv_dtype: "
                             "attention reads K and V quantized and dequantized, the selection the exact keys)")
    parser.add_argument("--prefill", choices=("dense", "sparse"), default="dense")
    parser.add_argument("--ppl-windows", type=int, default=3,
                        help="held-out windows of the longest length (0: no perplexity)")
    parser.add_argument("--seed", type=int, help="examples' seed (default 0 for nosa; RULER's 42 for ruler)")
    parser.add_argument("--quick", action="store_true",
                        help="the shortest length only, 1 window; 4 examples per task (nosa) or 1 (ruler)")
    parser.add_argument("--cache", default="runs/bench-cache", help="dense results cache ('' to turn it off)")
    parser.add_argument("--ruler-data", default="runs/ruler-data",
                        help="--suite ruler: where RULER's generated rows are kept (read back by later runs)")
    parser.add_argument("--out", help="JSON report (default results/longctx.json, or results/ruler.json)")
    parser.add_argument("--plot", metavar="PNG", help="also draw accuracy, recalls and hit rate per length")
    parser.add_argument("--merge", nargs="+", metavar="JSON",
                        help="run nothing: join reports into --out, its tables and --plot: reports of other "
                             "lengths (e.g. one process per length on a machine with cores to spare), or of the "
                             "same lengths (or some of them) and examples with other variants (e.g. a checkpoint "
                             "run with --no-a0, or other --picks), or of the same lengths and variants with another "
                             "--seed each (their examples pooled)")
    parser.add_argument("--drop", nargs="+", metavar="TEXT",
                        help="with --merge: leave out the variants whose name contains TEXT (e.g. an earlier "
                             "checkpoint's, when a new one is added), from each report before they are joined "
                             "and from the joined one")
    parser.add_argument("--keep-lengths", type=int, nargs="+", metavar="N",
                        help="with --merge: only these lengths of each report (e.g. to pool one length of a "
                             "joined report with another --seed's run of it)")
    args = parser.parse_args(argv)
    known = task_names(args.suite)
    wrong = [t for t in args.tasks or [] if t not in known]
    if wrong:
        parser.error(f"--tasks: {wrong} are not tasks of the {args.suite} suite; its tasks: {' '.join(known)}")
    args.tasks = args.tasks or list(known)
    args.seed = args.seed if args.seed is not None else SEEDS[args.suite]
    args.out = args.out or f"results/{'longctx' if args.suite == 'nosa' else 'ruler'}.json"
    args.examples = args.examples or EXAMPLES[args.suite]
    if args.merge:
        reports = []
        for path in args.merge:
            try:
                with open(path) as f:
                    reports.append(json.load(f))
            except (OSError, ValueError) as e:
                raise SystemExit(f"bench_longctx --merge: cannot read the report {path!r}: {e}") from None
        if args.keep_lengths:
            reports = [keep_lengths(r, args.keep_lengths) for r in reports]
        reports = [drop_variants(r, args.drop or []) for r in reports]
        return write_report(drop_variants(merge(reports), args.drop or []), args.out, args.plot)
    if args.drop or args.keep_lengths:
        parser.error("--drop and --keep-lengths work with --merge (they shape the reports it joins)")
    if not args.a0 and not args.nosa and not args.dense_ckpt:
        parser.error("--no-a0 without --nosa or --dense-ckpt leaves only dense to run")
    for spec in args.dense_ckpt:
        label = spec.rpartition("=")[0]
        if not label or label == "dense" or label.startswith("A = 0"):
            parser.error(f"--dense-ckpt {spec!r}: give it a LABEL= of its own (not dense or A = 0)")
    if args.ppl_windows < 0:
        parser.error(f"--ppl-windows must be 0 or more, got {args.ppl_windows}")
    if args.quick:
        args.lengths, args.examples, args.ppl_windows = [min(args.lengths)], [4 if args.suite == "nosa" else 1], 1
    counts = args.examples * len(args.lengths) if len(args.examples) == 1 else args.examples
    if len(counts) != len(args.lengths):
        raise SystemExit(f"bench_longctx: --examples needs one number or one per length ({len(args.lengths)})")
    for length in args.lengths:
        for share in args.shares:
            for picks in args.picks:
                budget_config(length, share, picks, args.windows)  # a ValueError naming the field, first
    return write_report(run(args, dict(zip(args.lengths, counts))), args.out, args.plot)


if __name__ == "__main__":
    sys.exit(main())
