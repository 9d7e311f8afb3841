"""Per-request NOSA decode state, owned by the backend and freed with the request.

One ``NosaDecodeState`` per (req_to_token row, layer), its keys in the row's pages of the
backend's nosa.state_pool.StatePool (given back when the row is freed). The registry is attached to SGLang's
ReqToTokenPool as its aux cache, so ``free(row)`` runs when a request finishes, is aborted or is
retracted (ReqToTokenPool.free_rows) and ``clear()`` when the pool is flushed. Rows are reused by
later requests; the pool's per-row generation counter (bumped on every allocation) guards against
trusting a state that belongs to an earlier request of the same row.

With offloading the registry also knows the backend's offloading engine
(nosa.serve.offload.engine.OffloadEngine, ``attach_offload``): a released row's device slots go
back to it, and its counters join the registry's in the stats file.
"""

from __future__ import annotations

import json
import os
import threading
import time

from nosa import env
from nosa.decode import NosaDecodeState
from nosa.serve.parallel import rank_path

ENV_STATS_FILE = "NOSA_SERVE_STATS_FILE"  # debug: the registry writes its counts here


class RequestRegistry:
    """Decode states keyed by row, tagged with the row's generation when created."""

    def __init__(self, req_to_token_pool, num_layers: int, dense_capacity: int, state_pool):
        self.req_pool = req_to_token_pool
        self.pool = state_pool  # nosa.state_pool.StatePool: where the states keep their keys
        self.num_layers = num_layers
        self.dense_capacity = dense_capacity  # ReqToTokenPool.schedulable_token_capacity reads it
        self._rows: dict[int, tuple[int, list[NosaDecodeState | None]]] = {}
        self._freed: dict[int, int] = {}  # row -> generation it was freed at
        self._lock = threading.Lock()  # free() may come from the scheduler while a forward runs
        self._stats_file = rank_path(env.text(ENV_STATS_FILE))  # one file per TP rank / DP replica
        self.freed_total = 0
        self.offload = None  # the offloading engine, if any: release(row), counters()
        self._stats_written = 0.0  # time.monotonic() of write_stats' last write
        self.metrics = None  # nosa.serve.metrics.NosaMetrics with SGLang's --enable-metrics
        self.host_tokens_in_use = None  # () -> host pool tokens allocated (offloading), for the metrics

    def attach_offload(self, engine) -> None:
        """The offloading engine whose slots a released row frees and whose counters ``counts`` adds.
        One per registry: offloading runs nosa for prefill and decode, one backend per process."""
        if self.offload is not None and self.offload is not engine:
            raise ValueError("nosa backend: a second offloading engine for the same request pool")
        self.offload = engine

    def _generation(self, row: int) -> int:
        return int(self.req_pool.req_generation[row])

    # ---- used by the backend ---------------------------------------------------------------
    def get(self, row: int, layer: int) -> NosaDecodeState | None:
        with self._lock:
            entry = self._rows.get(row)
            if entry is None:
                return None
            generation, layers = entry
            if generation != self._generation(row):  # the row now holds another request
                del self._rows[row]
                return None
            return layers[layer]

    def put(self, row: int, layer: int, state: NosaDecodeState) -> bool:
        """Keep ``state``; False (nothing kept, the row's pages given back) when the request of
        ``row`` was already released (overlap scheduling)."""
        with self._lock:
            generation = self._generation(row)
            released = self._freed.get(row) == generation
            if not released:
                entry = self._rows.get(row)
                if entry is None or entry[0] != generation:
                    entry = (generation, [None] * self.num_layers)
                    self._rows[row] = entry
                entry[1][layer] = state
        if released:
            self.pool.release(row)
            return False
        if layer in (0, self.num_layers - 1):  # a new request shows at once; not once per layer (the
            self._write_stats()  # file may carry the offloading timeline, nosa.serve.offload.stats)
        return True

    def counts(self, timeline: bool = True) -> dict:
        with self._lock:
            counts = {
                "requests": len(self._rows),
                "layer_states": sum(s is not None for _, layers in self._rows.values() for s in layers),
                "freed_total": self.freed_total,
            }
        if self.offload is not None:
            counts.update(self.offload.counters(timeline))
        return counts

    # ---- ReqToTokenPool aux-cache protocol ---------------------------------------------------
    def free(self, row: int) -> None:
        with self._lock:
            self._rows.pop(row, None)
            self._freed[row] = self._generation(row)
            self.freed_total += 1
        self.pool.release(row)
        if self.offload is not None:
            self.offload.release(row)
        self._write_stats()

    def clear(self) -> None:
        with self._lock:
            rows = list(self._rows)
            self._rows.clear()
        for row in rows:
            self.pool.release(row)
        if self.offload is not None:
            for row in rows:
                self.offload.release(row)
        self._write_stats()

    def alloc_to_lengths(self, *, req_pool_indices_cpu, target_seq_lens_cpu) -> None:
        pass  # states grow inside the forward pass

    def reset_allocator(self) -> None:
        self.clear()

    def write_stats(self, every: float = 0.0) -> None:
        """Write the counts to $NOSA_SERVE_STATS_FILE unless this method wrote them less than ``every``
        seconds ago (the backend calls it after each decode step: at most once a second)."""
        now = time.monotonic()
        if now - self._stats_written > every:
            self._stats_written = now
            self._write_stats()

    def _write_stats(self) -> None:
        if not self._stats_file and self.metrics is None:
            return
        counts = self.counts(timeline=False)
        if self.metrics is not None:  # the same counts, at the same moments: a scrape agrees with the file
            self.metrics.update(counts, self.host_tokens_in_use() if self.host_tokens_in_use else None)
        if not self._stats_file:
            return
        tmp = f"{self._stats_file}.{os.getpid()}.tmp"
        text = json.dumps(counts)
        if self.offload is not None:  # the step timeline, its records encoded once each when logged
            text = f'{text[:-1]}, "timeline": {self.offload.stats.snapshot_json()}}}'
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, self._stats_file)
