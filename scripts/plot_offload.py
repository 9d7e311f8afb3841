"""Plot results/offload.json (scripts/bench_offload.py): the longest context served at one device KV
budget, and the warm hit rate of the device block cache for NOSA vs A = 0 per context.

    .venv/bin/python scripts/plot_offload.py [results/offload.json] [--out results/offload.png]
"""

from __future__ import annotations

import argparse
import json
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", nargs="?", default=os.path.join(ROOT, "results", "offload.json"))
    ap.add_argument("--out", default=os.path.join(ROOT, "results", "offload.png"))
    args = ap.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(args.results) as f:
        report = json.load(f)
    panels = [p for p in ("capacity", "hitrate") if p in report]
    if not panels:
        raise SystemExit(f"{args.results} has neither a capacity nor a hitrate part")
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4), squeeze=False)
    for ax, part in zip(axes[0], panels):
        if part == "capacity":
            cap = report["capacity"]
            names = ["torch_native", "nosa, offloading"]
            values = [cap["torch_native"]["served_context"] or 0, cap["nosa_offload"]["served_context"] or 0]
            bars = ax.bar(names, [v / 1024 for v in values], color=["#999999", "#1f77b4"])
            for bar, v in zip(bars, values):
                ax.text(bar.get_x() + bar.get_width() / 2, v / 1024, f"{v:,}", ha="center", va="bottom")
            ax.set_ylabel("longest context served (K tokens)")
            ax.set_title(f"device KV budget {cap['device_kv_tokens']:,} tokens")
        else:
            rows = report["hitrate"]["rows"]
            for name, style in (("nosa", "o-"), ("a0", "s--")):
                mine = sorted((r["context"], r["warm_hit_rate"]) for r in rows if r["selection"] == name)
                label = {"nosa": "NOSA checkpoint (its eviction heads)",
                         "a0": "same weights, A = 0 (training-free)"}[name]
                ax.plot([c for c, _ in mine], [100 * h for _, h in mine], style, label=label)
            ax.set_xscale("log", base=2)
            ax.set_xlabel("context (tokens)")
            ax.set_ylabel("warm hit rate (%), cache = budget")
            ax.set_title("device block cache hit rate")
            ax.legend()
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
