"""The serving dashboard without W&B (scripts/serve_dashboard.py): a server's per-step, per-layer
offloading counters read from its stats file, a JSON list of step records or a metrics.jsonl,
summed up, and plotted."""

from __future__ import annotations

import json
import os


def load_timeline(path: str) -> list[dict]:
    """Step records from a stats file, a JSON list of records, or a metrics.jsonl (flat records)."""
    if path.endswith(".jsonl"):
        with open(path) as f:
            return [_unflatten(json.loads(line)) for line in f if line.strip()]
    with open(path) as f:
        data = json.load(f)
    records = data.get("timeline") if isinstance(data, dict) else data
    if not isinstance(records, list):
        raise SystemExit(f"serve_dashboard: {path} has no step timeline (key 'timeline'); was the server "
                         "run with $NOSA_OFFLOAD=1 and $NOSA_SERVE_STATS_FILE set?")
    return records


def _unflatten(flat: dict) -> dict:
    layers: dict[str, dict[int, float]] = {}
    for key, v in flat.items():
        if key.startswith("layer") and "/" in key:
            head, name = key.split("/", 1)
            layers.setdefault(name, {})[int(head[5:])] = v
    record = {"step": flat.get("step"), "wall_seconds": flat.get("wall_seconds", 0.0),
              "stall_seconds": flat.get("stall_seconds", 0.0), "batch": flat.get("batch", 0),
              "resident_slots": flat.get("resident_slots", 0),
              "layers": {name: [by[i] for i in sorted(by)] for name, by in layers.items()}}
    adm = {k.split("/", 1)[1]: v for k, v in flat.items() if k.startswith("admission/")}
    if adm:
        names = ("admit", "wait", "grant", "revoke", "resident", "offloaded")
        record["admission"] = {"decisions": {n: adm.get(n, 0) for n in names},
                               **{k: v for k, v in adm.items() if k not in names}}
    return record


def summary(records: list[dict]) -> dict:
    """Totals per layer and shares over the whole timeline."""
    if not records:
        raise SystemExit("serve_dashboard: the timeline is empty (no decode step recorded)")
    keys = records[0]["layers"].keys()
    totals = {k: [sum(r["layers"][k][i] for r in records) for i in range(len(records[0]["layers"][k]))] for k in keys}
    wall = sum(r["wall_seconds"] for r in records)
    stall = sum(r["stall_seconds"] for r in records)
    avoided = [p / max(p + m, 1) for p, m in zip(totals["prefetch_hits"], totals["misses"])]
    return {"steps": len(records), "wall_seconds": round(wall, 4), "stall_share": round(stall / wall, 4) if wall else 0,
            "hit_rate": round(sum(totals["hits"]) / max(sum(totals["selected"]), 1), 4),
            "prefetch_hit_rate_per_layer": [round(a, 4) for a in avoided], "totals_per_layer": totals,
            "admission": records[-1].get("admission", {}).get("decisions")}


def plot(records: list[dict], out: str, title: str = "nosa serving dashboard") -> None:
    import matplotlib  # optional: matplotlib (the train extra)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # optional: matplotlib

    steps = list(range(len(records)))
    lay = lambda key: [sum(r["layers"][key]) for r in records]  # noqa: E731
    sel, hits, misses = lay("selected"), lay("hits"), lay("misses")
    fig, axes = plt.subplots(2, 3, figsize=(15, 7.5))
    ax = axes[0, 0]
    ax.plot(steps, [h / s if s else 1.0 for h, s in zip(hits, sel)], label="hit rate")
    ax.set_ylim(0, 1.05)
    ax.set_title("hit rate per step (all layers)")
    ax2 = ax.twinx()
    ax2.bar(steps, misses, color="tab:red", alpha=0.3, label="misses (items)")
    ax2.bar(steps, lay("prefetch_hits"), color="tab:green", alpha=0.4, label="prefetch hits")
    ax2.legend(loc="lower right", fontsize=7)
    ax = axes[0, 1]
    ax.plot(steps, [1e3 * r["wall_seconds"] for r in records], label="step (layers)")
    ax.plot(steps, [1e3 * sum(r["layers"]["recall_seconds"]) for r in records], label="recall (worker)")
    ax.plot(steps, [1e3 * r["stall_seconds"] for r in records], label="stall (layers waiting)")
    ax.set_title("time per step (ms)")
    ax.legend(fontsize=7)
    ax = axes[0, 2]
    s = summary(records)
    layers = list(range(len(s["prefetch_hit_rate_per_layer"])))
    tot = s["totals_per_layer"]
    ax.bar([x - 0.2 for x in layers], s["prefetch_hit_rate_per_layer"], width=0.4, label="prefetch hit rate")
    ax.bar([x + 0.2 for x in layers], [h / max(n, 1) for h, n in zip(tot["hits"], tot["selected"])], width=0.4,
           label="hit rate")
    ax.set_xlabel("layer")
    ax.set_xticks(layers)
    ax.set_ylim(0, 1.05)
    ax.set_title("per layer: demand misses avoided by prefetch")
    ax.legend(fontsize=7)
    ax = axes[1, 0]
    ax.plot(steps, [r["resident_slots"] for r in records], label="resident slots")
    ax.set_title("device slots in use / batch")
    ax2 = ax.twinx()
    ax2.step(steps, [r["batch"] for r in records], color="tab:orange", label="batch")
    ax.legend(loc="upper left", fontsize=7)
    ax2.legend(loc="upper right", fontsize=7)
    ax = axes[1, 1]
    adm = [r.get("admission") for r in records]
    if any(adm):
        ax.plot(steps, [(a or {}).get("hideable_bytes_per_step") or 0 for a in adm], label="hideable B/step")
        ax.plot(steps, [(a or {}).get("demand_bytes_per_step") or 0 for a in adm], label="demanded B/step")
        ax.set_yscale("symlog")
        ax.legend(fontsize=7)
        ax.set_title("admission: recall budget per step")
        ax = axes[1, 2]
        for name in ("admit", "wait", "grant", "revoke"):
            ax.plot(steps, [(a or {}).get("decisions", {}).get(name, 0) for a in adm], label=name)
        ax.set_title("admission decisions (cumulative)")
        ax.legend(fontsize=7)
    else:
        ax.text(0.5, 0.5, "admission off", ha="center", va="center")
        ax.set_title("admission")
        axes[1, 2].plot(steps, [r["stall_seconds"] / r["wall_seconds"] if r["wall_seconds"] else 0 for r in records])
        axes[1, 2].set_title("stall share of the step")
    for ax in axes.flat:
        ax.set_xlabel(ax.get_xlabel() or "decode step")
    fig.suptitle(f"{title}: {s['steps']} steps, hit rate {s['hit_rate']:.3f}, stall share {s['stall_share']:.3f}")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    fig.savefig(out, dpi=90)
