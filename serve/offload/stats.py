"""Per decode step and layer counters of the offloading engine, for the stats file, W&B and the
serving dashboard (scripts/serve_dashboard.py).

Each decode step (``begin`` at its first layer, ``end`` after its last) becomes one record: the
step's wall time (attention layers and what runs between them), its batch size, and per layer the
change in the block cache's counters (selected, hits, misses, prefetch hits, prefetched and
dropped items, recalled bytes) and the recall scheduler's (recall seconds for demand and prefetch,
stall seconds: time a layer waited for its own blocks), plus resident slots and, when the engine
adds it, the admission controller's state and decisions. ``log`` keeps the newest ``keep`` (256)
records for the stats file ($NOSA_SERVE_STATS_FILE, key ``timeline``); with $NOSA_SERVE_WANDB set
(offline, online; disabled: off) every record is logged to W&B as the training loop does
(nosa.wandb_log: offline by default, into $NOSA_SERVE_WANDB_DIR, also a metrics.jsonl there).
"""

from __future__ import annotations

import json
import os
import time
from collections import deque
from dataclasses import dataclass

from nosa import env
from nosa.serve.offload.settings import backend_errors
from nosa.wandb_log import Logger

ENV_WANDB = "NOSA_SERVE_WANDB"
ENV_WANDB_DIR = "NOSA_SERVE_WANDB_DIR"
CACHE_KEYS = ("selected", "hits", "misses", "prefetch_hits", "prefetched", "prefetch_dropped", "recalled_bytes")


@dataclass
class StepRecord:
    """One decode step: wall and stall seconds (unrounded; the stall is the layers' waits for their
    own copies), resident slots, per-layer counter deltas ``layers`` (key -> [layers]) and the
    admission snapshot after the step's decisions (None without admission)."""

    step: int
    time: float
    batch: int
    wall_seconds: float
    stall_seconds: float
    resident_slots: int
    layers: dict[str, list]
    admission: dict | None = None

    def to_json(self) -> dict:
        out = {"step": self.step, "time": self.time, "batch": self.batch, "wall_seconds": round(self.wall_seconds, 6),
               "stall_seconds": round(self.stall_seconds, 6), "resident_slots": self.resident_slots,
               "layers": self.layers}
        if self.admission is not None:
            out["admission"] = self.admission
        return out


class StepStats:
    def __init__(self, cache, scheduler=None, keep: int = 256):
        self.cache, self.scheduler = cache, scheduler
        self.timeline: deque = deque(maxlen=keep)
        self.encoded: deque = deque(maxlen=keep)  # the same records as JSON text, each encoded once
        self._unencoded = 0  # records logged since the last snapshot_json
        self.step = 0
        self._start = 0.0
        self._before: dict = {}
        self._batch = 0
        self.logger = _wandb_logger()

    def _counters(self) -> dict:
        stats = self.cache.stats  # one host read of the device counters
        c = {key: list(stats[key]) for key in CACHE_KEYS}
        if self.scheduler is not None:
            s = self.scheduler.stats
            c["recall_seconds"] = [a + b for a, b in zip(s["demand_seconds"], s["prefetch_seconds"])]
            c["stall_seconds"] = list(s["stall_seconds"])
        else:
            c["recall_seconds"] = list(stats["recall_seconds"])
            c["stall_seconds"] = list(stats["stall_seconds"])
        return c

    def begin(self, batch: int) -> None:
        """A decode step of ``batch`` requests starts (before its first layer)."""
        self._start = time.perf_counter()
        self._before = self._counters()
        self._batch = batch

    def end(self) -> StepRecord:
        """The step's record (after its last layer); ``log`` keeps it."""
        wall = time.perf_counter() - self._start
        after = self._counters()
        layers = {key: [round(a - b, 6) if isinstance(a, float) else a - b
                        for a, b in zip(after[key], self._before[key])] for key in after}
        return StepRecord(self.step, time.time(), self._batch, wall, sum(layers["stall_seconds"]),
                          self.cache.resident_slots(), layers)

    def log(self, record: StepRecord) -> None:
        """Into the timeline (the stats file) and to W&B."""
        data = record.to_json()
        self.timeline.append(data)
        self._unencoded += 1
        if self.logger is not None:
            self.logger.log(_flat(data), step=self.step)
        self.step += 1

    def snapshot(self) -> list:
        return list(self.timeline)

    def snapshot_json(self) -> str:
        """``snapshot()`` as JSON text, each record encoded once (the newest here, the others at an
        earlier call): the stats file is written every second, and re-encoding 256 steps of per-layer
        counters took ~25 ms (SmolLM2's 30 layers)."""
        new = min(self._unencoded, len(self.timeline))
        for i in range(len(self.timeline) - new, len(self.timeline)):
            self.encoded.append(json.dumps(self.timeline[i]))
        self._unencoded = 0
        return "[" + ", ".join(self.encoded) + "]"


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
    """The W&B logger $NOSA_SERVE_WANDB asks for (None: disabled), into $NOSA_SERVE_WANDB_DIR."""
    with backend_errors():
        mode = env.choice(ENV_WANDB)
    if mode in ("0", "off", "disabled"):
        return None
    out = os.path.abspath(env.path(ENV_WANDB_DIR))  # default: runs/serve in the working directory
    return Logger(out, {"source": "nosa serve offloading"}, "offline" if mode in ("1", "on") else mode,
                  project="nosa-serve", name=None, wandb_dir=out)
