"""Read an offline W&B run back (no network, no W&B server) and print or plot it.

    python scripts/wandb_report.py runs/tiny                 # latest run under runs/tiny/wandb
    python scripts/wandb_report.py RUN_DIR_OR_.wandb --json  # history/config/summary as JSON
    python scripts/wandb_report.py runs/tiny --plot results/tiny_curves.png
    python scripts/wandb_report.py runs/smollm2-sparse --summary results/train_smollm2.json --label nosa-ft

The ``run-*.wandb`` file is a LevelDB-style record log (7-byte file header, 32 KiB blocks, records
with a 7-byte header: crc32, length, type FULL/FIRST/MIDDLE/LAST) of wandb_internal_pb2.Record
protobufs; this reader parses it directly. ``wandb sync RUN_DIR`` uploads the same run once a key
and network are available.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from nosa.bench.results import write_result
from nosa.bench.wandb_run import plot, print_report, read_run, summarise_run


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("path", help="run dir, offline-run-* dir or .wandb file")
    parser.add_argument("--json", action="store_true", help="print the whole run as JSON")
    parser.add_argument("--plot", metavar="PNG", help="write loss / accuracy / A / selection curves")
    parser.add_argument("--summary", metavar="JSON",
                        help="add the run's figures (steps, wall time, first and last loss terms and selection "
                             "statistics) to this results file, under --label (replacing a run of that label)")
    parser.add_argument("--label", help="the run's name in --summary (default: its folder's name)")
    args = parser.parse_args(argv)
    run = read_run(args.path)
    if args.json:
        json.dump(run, sys.stdout, indent=1, default=str)
        print()
    else:
        print_report(run)
    if args.plot:
        plot(run, args.plot)
    if args.summary:
        label = args.label or os.path.basename(os.path.normpath(args.path))
        runs = []
        if os.path.isfile(args.summary):
            with open(args.summary) as f:
                runs = [r for r in json.load(f)["runs"] if r["label"] != label]
        write_result(args.summary, {"runs": [*runs, summarise_run(run, label)]})
        print(f"wrote {args.summary}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
