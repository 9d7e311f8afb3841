"""nosa's counters in SGLang's Prometheus metrics (``--enable-metrics``, scraped at ``/metrics``).

The backend's counters (the ones $NOSA_SERVE_STATS_FILE holds) become ``nosa:*`` series beside
SGLang's ``sglang:*`` ones, with SGLang's scheduler labels ``model_name`` and ``tp_rank`` (and
``dp_rank`` with data parallelism). They are made with ``prometheus_client`` in the scheduler
process, as SGLang makes its own: SGLang sets $PROMETHEUS_MULTIPROC_DIR before it starts its
processes, so each process's values go to files there and the HTTP server's collector adds them up
(counters summed; gauges by ``multiprocess_mode``). ``NosaMetrics.update`` takes the same counts the
stats file is written from, at the same moments (after a decode step, at most once a second, and
when a request leaves), so a scrape agrees with the file.

Series (``_total`` is added to counters by prometheus_client):
- ``nosa:decode_steps``, ``nosa:selected_blocks``, ``nosa:block_cache_hits``,
  ``nosa:block_cache_misses`` (= blocks recalled on demand), ``nosa:recalled_bytes``,
  ``nosa:warm_selected_blocks`` and ``nosa:warm_block_cache_hits`` (their difference per step: the
  blocks entering the selections), ``nosa:prefetched_blocks``, ``nosa:prefetch_hits``: counters
  over every layer;
- ``nosa:device_slots_in_use``, ``nosa:host_pool_tokens_in_use``, ``nosa:requests``: gauges;
- with the recall scheduler: ``nosa:scheduler_demand_blocks``, ``nosa:scheduler_prefetch_blocks``,
  ``nosa:scheduler_stall_seconds``, ``nosa:scheduler_preemptions``;
- with admission: ``nosa:admission_decisions{decision=admit|wait|grant|revoke}``;
- ``nosa:request_hit_rate``: a histogram, one observation per finished request (its device cache
  hit rate over its decode steps).
"""

from __future__ import annotations

from nosa.serve.parallel import process_ranks

COUNTERS = {  # series -> (help, the stats file's per-layer counter summed)
    "nosa:decode_steps": ("Decode steps (one per step; every layer counts it, divided by the layers).", "steps"),
    "nosa:selected_blocks": ("Blocks selected by decode steps, every layer and KV head.", "selected"),
    "nosa:block_cache_hits": ("Selected blocks already in the device block cache (prefetch hits included).", "hits"),
    "nosa:block_cache_misses": ("Selected blocks recalled from the host pool on demand.", "misses"),
    "nosa:recalled_bytes": ("Bytes recalled from the host pool on demand (host bytes: data, scales, cis).",
                            "recalled_bytes"),
    "nosa:warm_selected_blocks": ("Blocks selected by warm decode steps (the request's previous step was a decode "
                                  "step).", "warm_selected"),
    "nosa:warm_block_cache_hits": ("Of those, blocks already on the device: warm_selected - warm_hits are the blocks "
                                   "entering the selections (the locality theorem bounds them per step).", "warm_hits"),
    "nosa:prefetched_blocks": ("Blocks the recall scheduler prefetched.", "prefetched"),
    "nosa:prefetch_hits": ("Selected blocks a prefetch had brought.", "prefetch_hits"),
}
SCHEDULER = {
    "nosa:scheduler_demand_blocks": ("Blocks the recall scheduler copied on demand.", "demand_items"),
    "nosa:scheduler_prefetch_blocks": ("Blocks the recall scheduler copied ahead.", "prefetch_items"),
    "nosa:scheduler_stall_seconds": ("Seconds layers waited for their own blocks.", "stall_seconds"),
    "nosa:scheduler_preemptions": ("Prefetches interrupted by a layer's own demand.", "preemptions"),
}
HIT_RATE_BUCKETS = (0.5, 0.8, 0.9, 0.95, 0.97, 0.98, 0.99, 0.995, 1.0)


class NosaMetrics:
    """The nosa series of one scheduler process (see the module docstring)."""

    def __init__(self, labels: dict[str, str], num_layers: int, registry=None):
        """``registry``: prometheus_client's registry to register in (default: its global one, which
        SGLang's /metrics serves; tests pass their own)."""
        # SGLang imports prometheus_client only once $PROMETHEUS_MULTIPROC_DIR is set; so does this
        from prometheus_client import Counter, Gauge, Histogram  # optional: prometheus_client (SGLang's)

        self.labels, self.num_layers = {k: str(v) for k, v in labels.items()}, num_layers
        names = list(self.labels)
        reg = {} if registry is None else {"registry": registry}
        self._counters = {name: Counter(name, text, names, **reg)
                          for name, (text, _) in {**COUNTERS, **SCHEDULER}.items()}
        self._decisions = Counter("nosa:admission_decisions", "Admission's decisions.", [*names, "decision"], **reg)
        gauges = {"nosa:device_slots_in_use": "Device block slots holding a block.",
                  "nosa:host_pool_tokens_in_use": "Host pool tokens allocated.",
                  "nosa:requests": "Requests holding decode states."}
        self._gauges = {name: Gauge(name, text, names, multiprocess_mode="livesum", **reg)
                        for name, text in gauges.items()}
        self._hit_rate = Histogram("nosa:request_hit_rate", "Device cache hit rate of each finished request.",
                                   names, buckets=HIT_RATE_BUCKETS, **reg)
        self._exported: dict[str, float] = {}  # what each counter already holds (counters only go up)

    def _add(self, counter, key: str, total: float, **extra) -> None:
        delta = total - self._exported.get(key, 0)
        if delta > 0:
            counter.labels(**self.labels, **extra).inc(delta)
            self._exported[key] = total

    def update(self, counts: dict, host_tokens_in_use: int | None = None) -> None:
        """Bring the series to ``counts`` (nosa.serve.registry.RequestRegistry.counts, the stats file's)."""
        offload = counts.get("offload", {})
        for name, (_, key) in COUNTERS.items():
            if key in offload:
                total = sum(offload[key]) / (self.num_layers if key == "steps" else 1)
                self._add(self._counters[name], name, total)
        for name, (_, key) in SCHEDULER.items():
            if key in counts.get("scheduler", {}):
                self._add(self._counters[name], name, sum(counts["scheduler"][key]))
        for decision, n in counts.get("admission", {}).get("decisions", {}).items():
            if decision in ("admit", "wait", "grant", "revoke"):
                self._add(self._decisions, f"decision {decision}", n, decision=decision)
        if "device_slots_in_use" in counts:
            self._gauges["nosa:device_slots_in_use"].labels(**self.labels).set(counts["device_slots_in_use"])
        self._gauges["nosa:requests"].labels(**self.labels).set(counts.get("requests", 0))
        if host_tokens_in_use is not None:
            self._gauges["nosa:host_pool_tokens_in_use"].labels(**self.labels).set(host_tokens_in_use)

    def request_done(self, selected: int, hits: int) -> None:
        """One finished request's hit rate (its decode steps' blocks over every layer and KV head)."""
        if selected > 0:
            self._hit_rate.labels(**self.labels).observe(hits / selected)


def start(model_runner, num_layers: int) -> NosaMetrics | None:
    """The process's NosaMetrics when SGLang's metrics are on (``--enable-metrics``), else None."""
    args = model_runner.server_args
    if not getattr(args, "enable_metrics", False):
        return None
    tp_rank, _, dp_rank = process_ranks()
    labels = {"model_name": getattr(args, "served_model_name", None) or args.model_path, "tp_rank": tp_rank}
    if dp_rank is not None:
        labels["dp_rank"] = dp_rank
    return NosaMetrics(labels, num_layers)
