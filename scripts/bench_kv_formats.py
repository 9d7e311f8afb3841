"""How far each host KV format (NOSA_HOST_KV_DTYPE) moves a real model's next-token distribution, K and
V apart: nosa.bench.kv_formats says what is measured and how.

    python scripts/bench_kv_formats.py                          # SmolLM2, 2 windows of 2K -> results/kv_formats.json
    python scripts/bench_kv_formats.py --quick                  # 1 window of 1K, a minute
    python scripts/bench_kv_formats.py --model models/gemma3-270m --out runs/kv_formats_gemma.json
"""

from __future__ import annotations

import argparse
import sys

from nosa.bench.kv_formats import FORMATS, measure
from nosa.bench.results import write_result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="models/smollm2-135m", help="dense HF checkpoint (python -m nosa.models)")
    parser.add_argument("--length", type=int, default=2048, help="tokens per held-out prose window (default 2048)")
    parser.add_argument("--windows", type=int, default=2, help="windows (default 2); the last half of each is scored")
    parser.add_argument("--formats", nargs="+", default=list(FORMATS), metavar="FORMAT",
                        help=f"formats to measure (default all): {'; '.join(FORMATS)}")
    parser.add_argument("--quick", action="store_true", help="1 window of 1024 tokens")
    parser.add_argument("--out", default="results/kv_formats.json",
                        help="JSON output (default results/kv_formats.json)")
    args = parser.parse_args(argv)
    if args.quick:
        args.length, args.windows = 1024, 1
    if args.length < 4 or args.windows < 1:
        parser.error("--length must be at least 4 and --windows at least 1")
    result = measure(args.model, args.length, args.windows, args.formats)
    write_result(args.out, result)
    print(f"{'format':58s} {'KL':>9s} {'greedy same':>11s} {'ppl / exact':>11s}")
    for r in result["formats"]:
        label = r["format"] + ("" if r["kind"] == "served" else f" ({r['kind']})")
        print(f"{label:58s} {r['kl']:9.5f} {100 * r['greedy_agreement']:10.2f}% {r['ppl_ratio']:11.4f}")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
