"""What the benchmarks read from a server's stats file ($NOSA_SERVE_STATS_FILE): the offloading
counters (hit rate, recalled blocks: ``offload_counters`` for scripts/bench_offload.py, ``counters``
for scripts/serve_ask.py and scripts/bench_serve.py) and the per-step timeline
(nosa.serve.offload.stats), polled while a part runs and summed into stall share and prefetch hit
rates."""

from __future__ import annotations

import json
import os
import threading


def offload_counters(stats_file: str) -> dict:
    with open(stats_file) as f:
        off = json.load(f)["offload"]
    total = {k: sum(v) for k, v in off.items() if k != "max_warm_misses"}
    return {
        "warm_hit_rate": round(total["warm_hits"] / max(total["warm_selected"], 1), 4),
        "hit_rate_all_steps": round(total["hits"] / max(total["selected"], 1), 4),
        "recalled_blocks": total["misses"], "recalled_bytes": total["recalled_bytes"],
        "max_warm_misses_per_head": max(off["max_warm_misses"]), "layer_steps": total["steps"],
        "warm_selected": total["warm_selected"], "warm_misses": total["warm_selected"] - total["warm_hits"],
    }


def read_timeline(stats_file: str, since: float) -> list[dict]:
    with open(stats_file) as f:
        return [r for r in json.load(f).get("timeline", []) if r["time"] >= since]


class TimelineRecorder:
    """Every step record of a server's stats file from ``since`` on. The file holds only the newest 256
    steps and is rewritten at most once a second, so it is polled and the records merged by step."""

    def __init__(self, stats_file: str, since: float, every: float = 0.5):
        self.stats_file, self.since, self.every = stats_file, since, every
        self.records: dict[int, dict] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        if os.path.exists(self.stats_file):
            try:
                for r in read_timeline(self.stats_file, self.since):
                    self.records[r["step"]] = r
            except (json.JSONDecodeError, OSError):
                pass  # replaced while read: the next poll reads it

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            self._poll()

    def stop(self) -> list[dict]:
        self._stop.set()
        self._thread.join()
        self._poll()
        return [self.records[k] for k in sorted(self.records)]


def summarize_timeline(records: list[dict], batch: int | None = None) -> dict:
    if batch is not None:
        records = [r for r in records if r["batch"] == batch] or records
    if not records:
        return {}
    layers = len(records[0]["layers"]["selected"])
    tot = {k: [sum(r["layers"][k][i] for r in records) for i in range(layers)] for k in records[0]["layers"]}
    wall = sum(r["wall_seconds"] for r in records)
    return {"steps": len(records), "stall_share": round(sum(r["stall_seconds"] for r in records) / wall, 4),
            "ms_layers_per_step": round(1000 * wall / len(records), 2),
            "ms_stall_per_step": round(1000 * sum(r["stall_seconds"] for r in records) / len(records), 3),
            "ms_recall_per_step": round(1000 * sum(sum(r["layers"]["recall_seconds"]) for r in records)
                                        / len(records), 3),
            "hit_rate": round(sum(tot["hits"]) / max(sum(tot["selected"]), 1), 4),
            "demand_misses_per_layer": tot["misses"], "prefetched_per_layer": tot["prefetched"],
            "prefetch_hits_per_layer": tot["prefetch_hits"],
            "prefetch_hit_rate_per_layer": [round(p / max(p + m, 1), 4)
                                            for p, m in zip(tot["prefetch_hits"], tot["misses"])],
            "prefetch_precision_per_layer": [round(h / max(p, 1), 4)
                                             for h, p in zip(tot["prefetch_hits"], tot["prefetched"])]}


def counters(stats_file: str) -> dict:
    """Hit rate, recalled bytes and peak device slots from the server's stats file."""
    with open(stats_file) as f:
        stats = json.load(f)
    off = stats["offload"]
    selected, hits = sum(off["selected"]), sum(off["hits"])
    warm_selected, warm_hits = sum(off["warm_selected"]), sum(off["warm_hits"])
    steps = stats.get("timeline", [])
    return {
        "decode_layer_steps": sum(off["steps"]), "selected_items": selected, "hit_items": hits,
        "warm_selected_items": warm_selected, "warm_hit_items": warm_hits,
        "hit_rate": hits / selected if selected else None,
        "warm_hit_rate": warm_hits / warm_selected if warm_selected else None,
        "recalled_items": sum(off["misses"]), "recalled_bytes": sum(off["recalled_bytes"]),
        "prefetched_items": sum(off["prefetched"]), "max_warm_misses": max(off["max_warm_misses"]),
        "peak_device_slots": stats.get("peak_device_slots", max((r["resident_slots"] for r in steps), default=0)),
        "peak_batch": max((r["batch"] for r in steps), default=0),
        "device_slots_in_use_after": stats["device_slots_in_use"], "requests_after": stats["requests"],
        "admission": (stats.get("admission") or {}).get("decisions"),
    }
