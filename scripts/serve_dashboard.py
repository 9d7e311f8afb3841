"""The serving dashboard without W&B: plot the offloading engine's per-step, per-layer counters.

    python scripts/serve_dashboard.py STATS.json [--plot results/serve_dashboard.png] [--json]
    python scripts/serve_dashboard.py runs/serve/metrics.jsonl --plot out.png

Input: the stats file a server writes with $NOSA_SERVE_STATS_FILE (its ``timeline``: one record
per decode step, nosa.serve.offload.stats), a JSON list of such records (scripts/bench_offload.py
saves them), or the ``metrics.jsonl`` that $NOSA_SERVE_WANDB logging writes beside the W&B run.
Panels: hit rate and misses per step; recall and stall time per step (stall share of the step);
prefetch hit rate per layer (demand misses avoided); resident slots and batch; admission
(bandwidth estimate, hideable vs demanded bytes per step, decisions). ``--json`` prints the
summary (totals per layer) instead of, or besides, the plot.
"""

from __future__ import annotations

import argparse
import json

from nosa.bench.server.dashboard import load_timeline, plot, summary


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("path", help="stats file, JSON list of step records, or metrics.jsonl")
    ap.add_argument("--plot", default=None, help="PNG to write")
    ap.add_argument("--title", default="nosa serving dashboard")
    ap.add_argument("--json", action="store_true", help="print the summary as JSON")
    args = ap.parse_args()
    records = load_timeline(args.path)
    if args.json or not args.plot:
        print(json.dumps(summary(records), indent=2))
    if args.plot:
        plot(records, args.plot, args.title)
        print(f"wrote {args.plot}")


if __name__ == "__main__":
    main()
