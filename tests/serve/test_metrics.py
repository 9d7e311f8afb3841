"""nosa.serve.metrics without a server: the series follow the stats file's counts (counters only
go up by what is new, gauges take the last value, one histogram observation per finished request).
The real-server scrape is tests/serve/test_offload.py::test_prometheus_metrics_equal_the_stats_file."""

import pytest

prometheus_client = pytest.importorskip("prometheus_client")

from nosa.serve.metrics import COUNTERS, NosaMetrics  # noqa: E402


def counts(scale: int, requests: int = 1) -> dict:
    layers = {"steps": [3 * scale, 3 * scale], "selected": [40 * scale, 40 * scale], "hits": [35 * scale] * 2,
              "misses": [5 * scale] * 2, "recalled_bytes": [500 * scale] * 2, "warm_selected": [30 * scale] * 2,
              "warm_hits": [29 * scale] * 2, "prefetched": [scale] * 2, "prefetch_hits": [0, scale]}
    return {"requests": requests, "device_slots_in_use": 7 * requests, "offload": layers,
            "scheduler": {"demand_items": [2 * scale] * 2, "prefetch_items": [scale] * 2,
                          "stall_seconds": [0.5 * scale] * 2, "preemptions": [0, 1]},
            "admission": {"decisions": {"admit": scale, "wait": 0, "resident": 3}}}


def value(registry, name: str, **labels) -> float:
    got = registry.get_sample_value(name, {"model_name": "m", "tp_rank": "0", **labels})
    return 0.0 if got is None else got


def test_series_follow_the_stats_files_counts():
    registry = prometheus_client.CollectorRegistry()
    metrics = NosaMetrics({"model_name": "m", "tp_rank": 0}, num_layers=2, registry=registry)
    for scale in (1, 1, 4):  # the same counts twice: nothing is added the second time
        metrics.update(counts(scale), host_tokens_in_use=640)
    c = counts(4)
    for name, (_, key) in COUNTERS.items():
        want = sum(c["offload"][key]) / (2 if key == "steps" else 1)
        assert value(registry, name + "_total") == pytest.approx(want), name
    assert value(registry, "nosa:scheduler_demand_blocks_total") == 16
    assert value(registry, "nosa:admission_decisions_total", decision="admit") == 4
    assert value(registry, "nosa:admission_decisions_total", decision="resident") == 0  # a state, not a decision
    assert value(registry, "nosa:device_slots_in_use") == 7 and value(registry, "nosa:host_pool_tokens_in_use") == 640
    metrics.update(counts(4, requests=0))
    assert value(registry, "nosa:requests") == 0 and value(registry, "nosa:device_slots_in_use") == 0
    metrics.request_done(selected=200, hits=190)
    metrics.request_done(selected=0, hits=0)  # no decode step: no observation
    assert value(registry, "nosa:request_hit_rate_count") == 1
    assert value(registry, "nosa:request_hit_rate_sum") == pytest.approx(0.95)
