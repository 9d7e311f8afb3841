"""Per decode step and layer counters of the offloading engine, for the stats file, W&B and the
serving dashboard (scripts/serve_dashboard.py).

Each decode step (``begin`` at its first layer, ``end`` after its last) becomes one record: the
step's wall time (attention layers and what runs between them), its batch size, and per layer the
change in the block cache's counters (selected, hits, misses, prefetch hits, prefetched and
dropped items, recalled bytes) and the recall scheduler's (recall seconds for demand and prefetch,
stall seconds: time a layer waited for its own blocks), plus resident slots and the admission
controller's state and decisions. The newest ``keep`` (256) records go into the stats file
($NOSA_SERVE_STATS_FILE, key ``timeline``); with $NOSA_SERVE_WANDB set (offline, online;
disabled: off) every record is logged to W&B as the training loop does (nosa.wandb_log:
offline by default, into $NOSA_SERVE_WANDB_DIR, also a metrics.jsonl there).

``end`` also feeds admission: the step's compute time (wall minus stalls), the link bandwidth
seen by its copies, each request's recalled bytes, then the extra slot grants for the next step.
"""

from __future__ import annotations

import os
import time
from collections import deque

ENV_WANDB = "NOSA_SERVE_WANDB"
ENV_WANDB_DIR = "NOSA_SERVE_WANDB_DIR"
CACHE_KEYS = ("selected", "hits", "misses", "prefetch_hits", "prefetched", "prefetch_dropped", "recalled_bytes")


class StepStats:
    def __init__(self, cache, scheduler=None, admission=None, keep: int = 256):
        self.cache, self.scheduler, self.admission = cache, scheduler, admission
        self.timeline: deque = deque(maxlen=keep)
        self.step = 0
        self._start = None
        self._before = None
        self._lengths: dict[int, int] = {}
        self.logger = _wandb_logger()

    def _counters(self) -> dict:
        c = {key: list(self.cache.stats[key]) for key in CACHE_KEYS}
        if self.scheduler is not None:
            s = self.scheduler.stats
            c["recall_seconds"] = [a + b for a, b in zip(s["demand_seconds"], s["prefetch_seconds"])]
            c["stall_seconds"] = list(s["stall_seconds"])
        else:
            c["recall_seconds"] = list(self.cache.stats["recall_seconds"])
            c["stall_seconds"] = list(self.cache.stats["stall_seconds"])
        return c

    def begin(self, rows: list[int], lengths: list[int]) -> None:
        self._start = time.perf_counter()
        self._before = self._counters()
        self._lengths = {self.cache.group_of(r): n for r, n in zip(rows, lengths)}
        self.cache.group_bytes.clear()

    def end(self) -> dict | None:
        if self._start is None:
            return None
        wall = time.perf_counter() - self._start
        after = self._counters()
        layers = {key: [round(a - b, 6) if isinstance(a, float) else a - b
                        for a, b in zip(after[key], self._before[key])] for key in after}
        stall = sum(layers["stall_seconds"])
        record = {"step": self.step, "time": time.time(), "batch": len(self._lengths), "wall_seconds": round(wall, 6),
                  "stall_seconds": round(stall, 6), "resident_slots": self.cache.resident_slots(), "layers": layers}
        if self.admission is not None:
            recalled_bytes = sum(layers["recalled_bytes"]) + sum(layers["prefetched"]) * self.cache.item_bytes
            self.admission.observe_transfer(recalled_bytes, sum(layers["recall_seconds"]))
            block = self.cache.block
            self.admission.observe_step(max(wall - stall, 1e-9), dict(self.cache.group_bytes),
                                        {g: -(-n // block) for g, n in self._lengths.items()})
            spare = self.cache.free_columns() + len(self.cache.lent)
            self.admission.extra = self.cache.set_extra(self.admission.grants(spare))  # what was granted
            record["admission"] = self.admission.snapshot()
        self.timeline.append(record)
        if self.logger is not None:
            self.logger.log(_flat(record), step=self.step)
        self.step += 1
        self._start = None
        return record

    def snapshot(self) -> list:
        return list(self.timeline)


def _flat(record: dict) -> dict:
    """W&B metrics: totals of the step plus one series per layer."""
    out = {k: v for k, v in record.items() if isinstance(v, (int, float)) and k not in ("step", "time")}
    for key, values in record["layers"].items():
        out[f"step/{key}"] = sum(values)
        for layer, v in enumerate(values):
            out[f"layer{layer}/{key}"] = v
    sel = sum(record["layers"]["selected"])
    out["step/hit_rate"] = sum(record["layers"]["hits"]) / sel if sel else 1.0
    out["step/stall_share"] = record["stall_seconds"] / record["wall_seconds"] if record["wall_seconds"] else 0.0
    adm = record.get("admission")
    if adm:
        for key, v in adm["decisions"].items():
            out[f"admission/{key}"] = v
        for key in ("bandwidth_bytes_per_s", "compute_s_per_step", "hideable_bytes_per_step", "demand_bytes_per_step"):
            if adm.get(key) is not None:
                out[f"admission/{key}"] = adm[key]
    return out


def _wandb_logger():
    mode = os.environ.get(ENV_WANDB, "").strip().lower()
    if mode in ("", "0", "off", "disabled"):
        return None
    if mode not in ("offline", "online", "1", "on"):
        raise ValueError(f"nosa backend: ${ENV_WANDB}={mode!r} must be offline, online or disabled")
    from nosa.wandb_log import Logger

    out = os.environ.get(ENV_WANDB_DIR) or os.path.join(os.getcwd(), "runs", "serve")
    return Logger(out, {"source": "nosa serve offloading"}, "offline" if mode in ("1", "on") else mode,
                  project="nosa-serve", name=None, wandb_dir=out)
