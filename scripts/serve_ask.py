"""Serve a NOSA checkpoint with offloading on and ask it held-out questions through the OpenAI API.

    python scripts/serve_ask.py                                   # the quickstart's runs/tiny/nosa
    python scripts/serve_ask.py --checkpoint runs/tiny-seed1/nosa --examples 32 --concurrency 8
    python scripts/serve_ask.py --suite --checkpoint runs/smollm2/nosa --length 8192   # the real model
    python scripts/serve_ask.py --suite ruler --checkpoint runs/smollm2-sparse/nosa --length 8192 \\
        --dense models/smollm2-135m                    # NVIDIA's RULER, dense's answer beside each served one

What it does, in order:
1. builds the questions:
   - default: fresh held-out examples of the checkpoint's own training task (typed key-value
     recall: 4 facts in filler, then "? K" asks for key K's value; nosa.train.synthetic, the random
     stream of scripts/bench_accuracy.py, disjoint from training) at the training length;
   - ``--suite`` (a chat model such as SmolLM2-135M-Instruct): the long-context suite's examples
     (nosa.train.ruler over held-out prose, the prompts of scripts/bench_longctx.py) at
     ``--length`` tokens, ``--per-task`` of each task; the checkpoint is served at the suite's
     NosaConfig for that length and ``--share`` (nosa.bench.longctx.config.budget_config) with its own
     eviction heads (a dense checkpoint, e.g. models/smollm2-135m: with A = 0, the backend's
     training-free selection, through NOSA_CONFIG);
   - ``--suite ruler``: NVIDIA's RULER prompts, as scripts/bench_longctx.py --suite ruler writes them
     (seed 42, rows kept under ``--ruler-data``), scored by RULER's own metrics;
   - ``--dense MODEL``: each prompt's dense answer too (the original model, full attention), from
     bench_longctx.py's dense cache or computed before the server starts, so that the printout shows
     what the sparsity keeps;
2. starts SGLang on 127.0.0.1 with ``--attention-backend nosa`` and offloading on
   (NOSA_OFFLOAD=1): each running request holds only ``topk_blocks`` blocks per KV head on the
   device, fewer tokens than its prompt, the rest of its KV lives in the host pool; the recall
   scheduler, admission and the stats file are on (``--wandb offline``: every decode step's
   counters also go to a W&B run, NOSA_SERVE_WANDB);
3. sends every question through the OpenAI API, several at once, greedy:
   - recall: ``/v1/completions`` with the prompt's ids (the tiny model was trained on raw text, so
     no chat template), the answer being the first token, with a few more tokens after it so that
     the offloaded decode path runs;
   - suite: ``/v1/chat/completions`` with the user message and a final assistant message holding
     the answer prefix, ``continue_final_message: true`` (nosa.bench.longctx.chat), up to the
     task's reply length; scored as the suite scores (nosa.train.ruler.is_right, or RULER's metrics);
4. prints each answer against the expected one, then the accuracy, and from the server's own
   counters ($NOSA_SERVE_STATS_FILE): the hit rate of the device block cache, the recalled bytes,
   the peak device slots against the KV that SGLang's torch_native backend would hold for the same
   requests; writes the serving dashboard (scripts/serve_dashboard.py) and a JSON summary;
5. stops the server: at the end, on an error, on Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile

from nosa.bench.longctx.config import PICKS, picks_share
from nosa.bench.longctx.suites import SUITES


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", default="runs/tiny/nosa", help="NOSA checkpoint trained on the synthetic "
                   "recall task (python -m nosa.train writes runs/<name>/nosa); with --suite a NOSA chat model")
    p.add_argument("--examples", type=int, default=16, help="held-out examples; each asks 4 questions")
    p.add_argument("--concurrency", type=int, default=8, help="questions in flight at once")
    p.add_argument("--after", type=int, default=15, help="tokens generated after the answer (decode steps)")
    p.add_argument("--seed", type=int, default=1234, help="seed of the held-out examples")
    p.add_argument("--device-requests", type=int, default=4,
                   help="device KV budget, in requests: NOSA_DEVICE_KV_TOKENS = this x topk_blocks x block_size")
    p.add_argument("--threads", type=int, default=1, help="torch threads of the server (OMP_NUM_THREADS)")
    suite = p.add_argument_group("the long-context suite (--suite)")
    suite.add_argument("--suite", nargs="?", const="nosa", choices=SUITES, default=None,
                       help="ask a long-context suite's chat prompts through /v1/chat/completions instead of "
                            "the recall task: nosa (the default of a bare --suite), the project's own tasks; "
                            "ruler, NVIDIA's RULER (bench_longctx.py --suite ruler's prompts)")
    suite.add_argument("--length", type=int, default=8192, help="tokens of prompt and reply")
    suite.add_argument("--tasks", nargs="+", default=None, help="suite tasks (default: all of the suite's)")
    suite.add_argument("--per-task", type=int, default=1, help="examples of each task")
    suite.add_argument("--share", type=int, default=4, help="budget = 1/share of the context's blocks")
    suite.add_argument("--max-tokens", type=int, default=None, metavar="N",
                       help="cap each reply at N tokens (default: the task's reply length); scored as capped")
    suite.add_argument("--picks", type=picks_share, default=PICKS, metavar="FRACTION",
                       help="free query-aware picks as a share of the budget (bench_longctx.py --picks; "
                            "default the suite's 1/16, the release's 15/64)")
    suite.add_argument("--suite-seed", type=int, default=None, help="seed of the suite's examples "
                       "(bench_longctx.py --seed; default 0 for nosa, RULER's 42 for ruler)")
    suite.add_argument("--ruler-data", default="runs/ruler-data", help="--suite ruler: where RULER's generated "
                       "rows are kept (bench_longctx.py --ruler-data)")
    suite.add_argument("--dense", default=None, metavar="MODEL", help="also print the dense model MODEL's answer "
                       "(full attention, e.g. models/smollm2-135m) beside each served one: from bench_longctx.py's "
                       "dense cache, computed and cached where it has none")
    suite.add_argument("--cache", default="runs/bench-cache", help="with --dense: bench_longctx.py's dense cache "
                       "('' to turn it off)")
    p.add_argument("--wandb", choices=["offline", "online"], default=None,
                   help="also log every decode step's counters to W&B (NOSA_SERVE_WANDB; run under --wandb-dir)")
    p.add_argument("--wandb-dir", default="runs/serve", help="NOSA_SERVE_WANDB_DIR (metrics.jsonl beside the run)")
    p.add_argument("--out", default="results/serve_ask.json", help="JSON summary")
    p.add_argument("--plot", default="results/serve_ask.png", help="serving dashboard PNG ('' to skip)")
    p.add_argument("--log", default=None, help="server log file (default: a temporary file, kept on failure)")
    args = p.parse_args(argv)
    if args.max_tokens is not None and args.max_tokens < 1:
        p.error(f"--max-tokens must be at least 1 (got {args.max_tokens})")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if not os.path.isdir(args.checkpoint):
        raise SystemExit(f"serve_ask: no checkpoint at {args.checkpoint}; train one first "
                         "(python -m nosa.train --config configs/train/tiny.yaml)")
    from nosa.bench.ask import run  # optional: transformers and the server code, loaded after the checks above

    work = tempfile.mkdtemp(prefix="serve_ask-")  # the server's log, stats file and checkpoint view
    code = run(args, work)
    shutil.rmtree(work, ignore_errors=True)  # kept when anything failed: the log is there
    return code


if __name__ == "__main__":
    sys.exit(main())
